"""Muon's state in every snapshot format under fsdp (issue 59, item 2): real torchrun runs of main.py
(gloo), through tests/workers/full_state_probe.py, which writes the full state gathered from every
rank at each save and each resume.

A run of 6 steps on 2 ranks saves at step 3 and 6. Resumed from its step-3 snapshot alone on the same
2 ranks, it ends with the same state, bit for bit (Muon's momentum buffers, sharded as their
matrices, and AdamW's moments); resumed on another number of ranks (4, each momentum buffer cut into 4
uneven shards, or one process), what it restores is what was saved, bit for bit, and it trains on.
Not tested here or elsewhere yet: healing under the fault-tolerant mode with muon (a replica group
recovering Muon's state from another).
"""
import shutil

import pytest
import torch
from helpers import WORKER_SCRIPTS, assert_ok, run_main, tiny_overrides
from state_equality import assert_same_state

pytestmark = pytest.mark.slow

FULL_STATE_PROBE = WORKER_SCRIPTS / "full_state_probe.py"
FORMATS = {"single": ("snapshot_000000003.pt", "snapshot_000000006.pt"),
           "sharded": ("sharded_000000003", "sharded_000000006")}


def train(text_file, folder, full_state, snapshot_format, nproc=2, method="fsdp"):
    """6 steps of Muon (a snapshot every 3) into the folder, the full state at each save and resume in
    full_state; gpt_config.n_embd=30: over 4 ranks the matrices' rows split unevenly. The global batch
    is 32 samples at every world size (the same global order: the same batches) and dropout is off
    (its masks are drawn per rank)."""
    full_state.mkdir(exist_ok=True)
    overrides = tiny_overrides(text_file, folder, optimizer_config__name="muon", trainer_config__max_steps=6,
                               trainer_config__save_every_steps=3, trainer_config__snapshot_format=snapshot_format,
                               trainer_config__distributed_method=method, gpt_config__n_embd=30,
                               gpt_config__n_head=3, trainer_config__batch_size=32 // nproc,
                               gpt_config__embd_pdrop=0.0, gpt_config__resid_pdrop=0.0, gpt_config__attn_pdrop=0.0)
    result = run_main(overrides, nproc=nproc if nproc > 1 else None, script=FULL_STATE_PROBE,
                      env={"FULL_STATE_DIR": str(full_state)})
    assert_ok(result)
    return result


def state(folder, kind, step) -> dict:
    return torch.load(folder / f"{kind}_{step:09d}.pt", weights_only=True)


@pytest.fixture(scope="module", params=sorted(FORMATS))
def unbroken(request, text_file, tmp_path_factory):
    """6 steps on 2 fsdp ranks, in one format: the run's folder and the full states it saved."""
    root = tmp_path_factory.mktemp(f"muon_{request.param}")
    train(text_file, root / "run", root / "full_state", request.param)
    return request.param, root


def resumed_from_step_3(snapshot_format, root, tmp_path, text_file, nproc, method="fsdp"):
    folder = tmp_path / "run"
    folder.mkdir()
    entry = root / "run" / FORMATS[snapshot_format][0]
    (shutil.copytree if entry.is_dir() else shutil.copy)(entry, folder / entry.name)
    result = train(text_file, folder, tmp_path / "full_state", snapshot_format, nproc=nproc, method=method)
    assert "Resuming training from snapshot at Epoch 0 (step 3" in result.stdout
    return tmp_path / "full_state"


def test_the_snapshot_holds_muon_s_momentum_and_adamw_s_moments(unbroken):
    saved = state(unbroken[1] / "full_state", "saved", 3)["optimizer"]["state"]
    assert sorted(saved["blocks.0.attn.qkv.weight"]) == ["momentum_buffer"]
    assert saved["blocks.0.attn.qkv.weight"]["momentum_buffer"].shape == (90, 30)  # whole, gathered
    assert sorted(saved["tok_emb.weight"]) == ["exp_avg", "exp_avg_sq", "step"]


def test_resumed_on_the_same_ranks_it_ends_bit_for_bit_as_the_unbroken_run(unbroken, text_file, tmp_path):
    snapshot_format, root = unbroken
    full_state = resumed_from_step_3(snapshot_format, root, tmp_path, text_file, nproc=2)
    assert_same_state(state(full_state, "restored", 3), state(root / "full_state", "saved", 3))
    assert_same_state(state(full_state, "saved", 6), state(root / "full_state", "saved", 6))


@pytest.mark.parametrize("nproc, method", [(4, "fsdp"), (1, "ddp")])
def test_resumed_on_other_ranks_it_restores_what_was_saved_and_trains_on(unbroken, text_file, tmp_path, nproc,
                                                                        method):
    """4 fsdp ranks (each momentum buffer resharded into 4 uneven shards: ShardedMuon steps with them) or
    one process (torch.optim.Muon on whole matrices)."""
    snapshot_format, root = unbroken
    full_state = resumed_from_step_3(snapshot_format, root, tmp_path, text_file, nproc=nproc, method=method)
    assert_same_state(state(full_state, "restored", 3), state(root / "full_state", "saved", 3))
    # The same batches, their gradients summed over other ranks: the 3 steps' updates alike, to the
    # rounding Muon's bf16 Newton-Schulz amplifies (tests/distributed/test_muon.py: 5% after 3 steps).
    start, ended = state(root / "full_state", "saved", 3)["model"], state(full_state, "saved", 6)["model"]
    for name, value in state(root / "full_state", "saved", 6)["model"].items():
        update = value - start[name]
        assert (ended[name] - value).norm() <= 0.15 * update.norm(), name
