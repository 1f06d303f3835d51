"""Subword tokens and GPT-2 weights on 2 ranks, in one torchrun launch (tests/workers/tokens_probe.py):
a BPE run resumed from a mid-epoch snapshot ends bit for bit as the unbroken run does; a run started
from a GPT-2 folder has the folder's logits before its first step, under DDP and FSDP, then trains."""
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    TORCHRUN,
    WORKER_SCRIPTS,
    assert_ok,
    final_state,
    gpt2_logits,
    make_gpt2_folder,
    make_text,
    run,
)
from safetensors.torch import load_file
from state_equality import assert_same_state

from mingpt.storage.snapshot import read_snapshot

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

IDS = torch.arange(2 * 16).view(2, 16) * 11 % 300


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> SimpleNamespace:
    work = tmp_path_factory.mktemp("tokens_probe")
    text = work / "input.txt"
    text.write_text(make_text(6000, seed=3))
    folder = make_gpt2_folder(work / "gpt2", make_text(20000))
    torch.save(IDS, work / "ids.pt")
    (work / "out").mkdir()
    result = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", WORKER_SCRIPTS / "tokens_probe.py",
                  text, folder, work / "ids.pt", work / "out"])
    assert_ok(result)
    return SimpleNamespace(out=work / "out", folder=folder, stdout=result.stdout)


def test_bpe_training_resumed_mid_epoch_ends_as_the_unbroken_run(probe):
    assert "Resuming training from snapshot at Epoch 0 (step 3" in probe.stdout
    unbroken, resumed = (probe.out / run / "snapshot_000000006.pt" for run in ("bpe_a", "bpe_b"))
    assert_same_state(final_state(resumed), final_state(unbroken))
    snapshot = read_snapshot(str(resumed))
    assert snapshot.tokenizer and len(snapshot.vocab) == 300 == snapshot.model_config["vocab_size"]


@pytest.mark.parametrize("method", ["ddp", "fsdp"])
def test_a_gpt2_folder_gives_its_logits_then_trains(probe, method):
    logits = torch.load(probe.out / f"{method}_logits.pt")
    torch.testing.assert_close(logits, gpt2_logits(probe.folder, IDS), rtol=0, atol=1e-5)
    trained = read_snapshot(str(probe.out / method / "snapshot_000000002.pt"))
    assert trained.model_config["activation"] == "gelu_tanh" and trained.step == 2
    wte = load_file(probe.folder / "model.safetensors")["transformer.wte.weight"]
    assert not torch.equal(trained.model_state["tok_emb.weight"], wte)
    assert trained.tokenizer == (probe.folder / "tokenizer.json").read_text()
