"""export_hf.py: a snapshot as a Hugging Face GPT-2 folder that transformers loads with the same logits."""
import json
import re
import sys

import pytest
import torch
from helpers import (
    MINGPT,
    REPO,
    assert_ok,
    make_gpt2_folder,
    make_text,
    one_error_line,
    run,
    run_main_in_process,
    tiny_overrides,
)

from mingpt import export_hf
from mingpt.generate import build_model
from mingpt.storage.snapshot import read_snapshot
from mingpt.tokens.tokenizer import Vocabulary

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def exported(tiny_epoch, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "gpt2-char"
    export_hf.main([str(tiny_epoch.snapshot), str(out)])
    return out


def test_transformers_gives_the_projects_logits_and_tokens(tiny_epoch, exported):
    snapshot = read_snapshot(str(tiny_epoch.snapshot))
    ours = build_model(snapshot, str(tiny_epoch.snapshot), torch.device("cpu"))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(exported).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(len(snapshot.vocab), (3, ours.config.block_size), generator=generator)
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids)[0], rtol=0, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    text = "".join(snapshot.vocab)  # every character, the newline too
    assert tokenizer(text)["input_ids"] == list(range(len(snapshot.vocab)))
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    prompt = tokenizer(snapshot.vocab[5] * 3, return_tensors="pt")
    written = theirs.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert written.shape == (1, 11) and len(tokenizer.decode(written[0])) == 11


def test_every_file_of_the_folder_gets_the_usual_mode(exported):
    """model.safetensors was made 0600 by safetensors while its siblings were 0644 (the umask's)."""
    modes = {path.name: path.stat().st_mode & 0o777 for path in exported.iterdir()}
    assert len(set(modes.values())) == 1, modes


@pytest.mark.slow
def test_an_existing_folder_is_refused_in_one_line_and_left_alone(tiny_epoch, exported):
    before = sorted(p.name for p in exported.iterdir())
    result = run([sys.executable, MINGPT / "export_hf.py", tiny_epoch.snapshot, exported])
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"error: {exported} exists; give a new folder for the export "
                                          "(nothing was overwritten)"]
    assert sorted(p.name for p in exported.iterdir()) == before


@pytest.mark.parametrize("broken", ["a square weight left untransposed", "a dropped bias"])
def test_a_broken_mapping_gives_other_logits(tiny_epoch, tmp_path, monkeypatch, broken):
    """The logits comparison above catches a wrong mapping: a square Conv1D weight loads whether
    transposed or not, and a missing bias loads as a new one."""
    mapping = export_hf.gpt2_weights

    def broken_weights(model_state, vocab_size):
        weights = mapping(model_state, vocab_size)
        if broken == "a dropped bias":
            del weights["transformer.h.0.mlp.c_fc.bias"]
        else:
            name = "transformer.h.0.attn.c_proj.weight"
            weights[name] = weights[name].t().contiguous()
        return weights

    monkeypatch.setattr(export_hf, "gpt2_weights", broken_weights)
    export_hf.main([str(tiny_epoch.snapshot), str(tmp_path / "broken")])
    snapshot = read_snapshot(str(tiny_epoch.snapshot))
    ours = build_model(snapshot, str(tiny_epoch.snapshot), torch.device("cpu"))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "broken").eval()
    ids = torch.arange(ours.config.block_size)[None] % len(snapshot.vocab)
    with torch.no_grad():
        assert (theirs(ids).logits - ours(ids)[0]).abs().max() > 1e-3


def test_a_character_models_folder_as_init_from_is_one_line_whose_advice_works(
        tiny_epoch, shared_text, exported, tmp_path, capsys):
    """A character model's export cannot start a run (storage/gpt2_folder.is_characters says why);
    its refusal used to advise data_config.tokenizer=bpe, which met the same refusal. What it advises
    instead, resuming the snapshot exported, on its text, trains on."""
    snapshot = tmp_path / "snap.pt"
    snapshot.write_bytes(tiny_epoch.snapshot.read_bytes())
    step = read_snapshot(str(snapshot)).step
    overrides = tiny_overrides(shared_text, snapshot, trainer_config__max_steps=step + 1)
    refused = run_main_in_process([*overrides, f"gpt_config.init_from={exported}"], capsys)
    assert one_error_line(refused) == (
        f"error: gpt_config.init_from: {exported} holds a character model (export_hf.py's tokenizer.json "
        "of one token per character); init_from tokenizes the data with a folder's byte-level BPE only; to "
        "train the character model on, resume the snapshot it was exported from "
        "(trainer_config.snapshot_path=that snapshot, with its text), or give a BPE model's folder")
    assert read_snapshot(str(snapshot)).step == step  # nothing trained

    advised = run_main_in_process(overrides, capsys)
    assert_ok(advised)
    assert "Resuming training from snapshot" in advised.stdout
    assert read_snapshot(str(snapshot)).step == step + 1


@pytest.mark.parametrize("where", ["missing.pt", "empty-folder"])
def test_no_snapshot_there_is_one_line_and_nothing_written(tmp_path, capsys, where):
    (tmp_path / "empty-folder").mkdir()
    with pytest.raises(SystemExit) as exit_:
        export_hf.main([str(tmp_path / where), str(tmp_path / "out")])
    assert exit_.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: no snapshot at {tmp_path / where}: give a snapshot file, a run's snapshot folder or a "
        "sharded_<step> folder"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


RUNS = {  # the snapshot of a 3-step run of each kind (the characters' single file: tiny_epoch's)
    "characters, sharded": dict(trainer_config__snapshot_format="sharded"),
    "bpe, single file": dict(data_config__tokenizer="bpe", data_config__bpe_vocab_size=300),
    "from a gpt-2 folder (bpe, gelu_tanh), sharded": dict(trainer_config__snapshot_format="sharded"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", RUNS)
def test_bpe_and_sharded_snapshots_export_with_their_tokenizer_and_activation(text_file, tmp_path, capsys,
                                                                               kind):
    settings = dict(RUNS[kind], trainer_config__max_steps=3)
    if "gpt-2" in kind:
        settings["gpt_config__init_from"] = make_gpt2_folder(tmp_path / "gpt2", make_text(20000))
    snapshots = tmp_path / ("snap.pt" if "single" in kind else "snaps")
    assert_ok(run_main_in_process(tiny_overrides(text_file, snapshots, **settings), capsys))
    source = snapshots if "single" in kind else snapshots / "sharded_000000003"
    export_hf.main([str(source), str(tmp_path / "out")])
    snapshot = export_hf.read_any(str(source))
    ours = build_model(snapshot, str(source), torch.device("cpu"))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    ids = torch.arange(2 * 16).view(2, 16) * 5 % len(snapshot.vocab)
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids)[0], rtol=0, atol=1e-5)
    activation = json.loads((tmp_path / "out" / "config.json").read_text())["activation_function"]
    assert activation == ("gelu_new" if "gelu_tanh" in kind else "gelu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "The king shall speak.\n"
    if "bpe" in kind:
        assert tokenizer(text)["input_ids"] == Vocabulary.from_json(snapshot.tokenizer).encode(text)
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_the_documented_snippet_runs_on_an_exported_folder_without_a_warning(exported, capfd):
    """docs/data.md's transformers snippet, as written, on an exported character model (block 16):
    it used to fail with an IndexError past n_positions, after two warnings of a bos/eos id of 50256."""
    page = (REPO / "docs" / "data.md").read_text()
    snippet = re.search(r"```python\n(from transformers import .*?)```", page, re.S).group(1)
    capfd.readouterr()
    exec(compile(snippet.replace('"gpt2-shakespeare"', repr(str(exported))), "docs/data.md", "exec"), {})
    out, err = capfd.readouterr()
    assert "bos_token_id" not in err and "eos_token_id" not in err, err
    assert len(out) == 16 + 1  # n_positions characters, and print's newline
    assert json.loads((exported / "config.json").read_text())["eos_token_id"] is None
