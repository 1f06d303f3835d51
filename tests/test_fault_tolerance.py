"""Exact resume: a worker SIGKILLed mid-run, restarted by torchrun, ends bitwise where an unbroken
run ends; and a save killed half-way never costs the previous snapshot."""
import subprocess
import sys
import time

import pytest
import torch

from helpers import REPO, TORCHRUN, assert_ok, run, sha256, tiny_overrides

STEPS_PER_EPOCH = 85  # 5,385 train samples / (32 per rank x 2 ranks)


def run_with_restarts(text_file, snapshot, fault=None):
    overrides = tiny_overrides(text_file, snapshot, trainer_config__max_epochs=2,
                               trainer_config__save_every_steps=10)
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # reliable elastic restarts (notes)
    if fault:
        env.update(FAULT=fault, FAULT_RANK="1")
    result = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=2",
                  REPO / "tests" / "fault_injection.py", *overrides], env=env, timeout=300)
    assert_ok(result)
    return result


def final_weights(snapshot):
    return torch.load(snapshot, weights_only=True)["model_state"]


@pytest.fixture(scope="module")
def unbroken(text_file, tmp_path_factory):
    snapshot = tmp_path_factory.mktemp("unbroken") / "snap.pt"
    run_with_restarts(text_file, snapshot)
    return final_weights(snapshot)


@pytest.mark.parametrize("fault, resumed_from", [
    ("step:37", "Resuming training from snapshot at Epoch 0 (step 30, sample 1920 of epoch 1)"),
    ("epoch_snapshot:1", "Resuming training from snapshot at Epoch 1"),
    ("eval:1", "Resuming training from snapshot at Epoch 1"),
])
def test_killed_worker_restarts_and_ends_bitwise_equal(text_file, tmp_path, unbroken, fault, resumed_from):
    snapshot = tmp_path / "snap.pt"
    result = run_with_restarts(text_file, snapshot, fault)
    assert "failed (exitcode: -9) local_rank: 1" in result.stderr  # the planted SIGKILL happened
    assert resumed_from in result.stdout
    weights = final_weights(snapshot)
    assert weights.keys() == unbroken.keys()
    assert all(torch.equal(weights[name], unbroken[name]) for name in weights)


HANG_MID_SAVE = """
import sys, time, torch
sys.path.insert(0, {mingpt!r})
import snapshot as s
def half_then_hang(obj, f):
    f.write(b"PK" + bytes(1 << 20))
    f.flush()
    print("writing", flush=True)
    time.sleep(600)
torch.save = half_then_hang
s.write_snapshot(s.Snapshot(step=2), {path!r})
"""


def kill_mid_save(path: str, env=None) -> None:
    """Start saving a snapshot to path in a child process and SIGKILL it half-way."""
    code = HANG_MID_SAVE.format(mingpt=str(REPO / "mingpt"), path=path)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env=env)
    assert child.stdout.readline().strip() == "writing"
    time.sleep(0.2)
    child.kill()
    child.wait()


def test_a_local_save_killed_half_way_keeps_the_previous_snapshot(tmp_path):
    from snapshot import Snapshot, read_snapshot, write_snapshot

    path = tmp_path / "snap.pt"
    write_snapshot(Snapshot(step=1), str(path))
    before = sha256(path)
    kill_mid_save(str(path))
    assert sha256(path) == before
    assert read_snapshot(str(path)).step == 1
