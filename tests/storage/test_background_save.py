"""background_save.py: the staging copy a background writer reads, and a write that fails mid-run."""
import os
import sys
import threading
import time

import pytest
import torch
from helpers import MAIN, assert_ok, one_error_line, run, run_main_in_process, sha256, tiny_overrides
from state_equality import assert_same_state
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from mingpt.distributed.parallel import gather_full_state
from mingpt.storage.background_save import BackgroundSaves, StagingBuffer
from mingpt.storage.checkpointer import training_tensors
from mingpt.storage.snapshot import read_snapshot


def stepped_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, full: bool):
    """One more optimizer step, then the state a snapshot takes: gathered whole (single-file) or
    this rank's shards (sharded); either way views of the live tensors here, on the CPU."""
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    if full:
        return gather_full_state(model, optimizer)
    return get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)["state"]


def local_values(state):
    """Plain tensors (an FSDP shard's local part), cloned: what the state held at this moment."""
    if isinstance(state, (dict, list, tuple)):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        return {key: local_values(value) for key, value in items}
    if isinstance(state, torch.Tensor):
        return (state.to_local() if hasattr(state, "to_local") else state).clone()
    return state


def local_memory(tensor: torch.Tensor) -> int:
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).data_ptr()


def test_the_staged_copy_shares_nothing_with_training_and_is_reused(world_of_one):
    plain = torch.nn.Linear(4, 4)
    sharded = fully_shard(torch.nn.Linear(4, 4))  # DTensor parameters on a CPU mesh of one
    for model, full in ((plain, True), (sharded, False)):
        optimizer = torch.optim.AdamW(model.parameters())
        staging = StagingBuffer()
        state = stepped_state(model, optimizer, full)
        taken = local_values(state)
        copy = staging.copy(state, training_tensors(model, optimizer))
        stepped_state(model, optimizer, full)  # training goes on while the writer writes
        assert not torch.equal(local_values(state)[0]["weight"], taken[0]["weight"])  # views of live state
        assert_same_state(local_values(copy), taken)  # the copy kept the step it was taken at
        if not full:
            assert type(copy[0]["weight"]) is type(state[0]["weight"])  # a DTensor, for DCP's planner
            assert copy[0]["weight"].placements == state[0]["weight"].placements
        again = staging.copy(stepped_state(model, optimizer, full), training_tensors(model, optimizer))
        assert local_memory(again[0]["weight"]) == local_memory(copy[0]["weight"])  # reused
        assert_same_state(local_values(again), local_values(state))


def test_what_a_gather_has_just_made_is_not_copied_again(world_of_one):
    """Only what shares memory with training is staged: a freshly made tensor (FSDP's gathered full
    state, a GPU's state moved to the host) is the writer's already; a second copy would only
    double the host memory a save holds."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    live_state, _ = stepped_state(model, optimizer, full=True)  # views of the parameters (CPU DDP)
    fresh_state = {name: tensor.clone() for name, tensor in live_state.items()}
    staging = StagingBuffer()
    staged = staging.copy({"live": live_state, "fresh": fresh_state}, training_tensors(model, optimizer))
    assert all(staged["fresh"][name] is fresh_state[name] for name in fresh_state)
    assert all(local_memory(staged["live"][name]) != local_memory(live_state[name]) for name in live_state)
    assert staging.copied_bytes == sum(t.numel() * t.element_size() for t in live_state.values())


def test_finish_hands_over_the_writers_error_and_failed_never_waits():
    saves = BackgroundSaves()
    assert not saves.failed() and saves.finish() is None
    release = threading.Event()

    def refused_once_released():
        release.wait()
        raise OSError("disk full")

    saves.submit(refused_once_released)
    answers = []
    asking = threading.Thread(target=lambda: answers.append(saves.failed()), daemon=True)
    asking.start()
    asking.join(timeout=5)
    assert answers == [False], "failed() waited for the write in flight"
    release.set()
    deadline = time.monotonic() + 10
    while not saves.failed():  # the error shows without finish()
        assert time.monotonic() < deadline, "failed() never saw the writer's error"
        time.sleep(0.01)
    assert saves.failed()  # and stays there for finish() to hand over
    error = saves.finish()
    assert isinstance(error, OSError) and str(error) == "disk full"
    assert saves.finish() is None and not saves.failed()  # handed over once


def test_the_writer_thread_drives_the_ranks_gpu(monkeypatch):
    """Not GPU 0, a new thread's default: set before its first save (recorded here, no GPU needed)."""
    devices_set = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: devices_set.append(
        (device, threading.current_thread().name)))
    saves = BackgroundSaves(torch.device("cuda", 3))
    saves.submit(lambda: None)
    assert saves.finish() is None
    [(device, thread)] = devices_set
    assert device == torch.device("cuda", 3) and thread.startswith("snapshot-writer")
    BackgroundSaves(torch.device("cpu")).submit(lambda: None)
    assert len(devices_set) == 1  # on the CPU nothing to set


@pytest.mark.slow
def test_a_save_refused_mid_run_stops_the_run_with_its_error_and_keeps_the_previous_snapshot(
        text_file, tmp_path, capsys, one_torch_thread):
    """The disk refuses the resumed run's first snapshot (of step 50): a file size limit
    (RLIMIT_FSIZE binds root too) of half a snapshot; the start-up probe writes an empty file."""
    snapshot = tmp_path / "snap.pt"
    assert_ok(run_main_in_process(tiny_overrides(text_file, snapshot, trainer_config__max_steps=20), capsys))
    before, limit = sha256(snapshot), snapshot.stat().st_size // 2
    overrides = tiny_overrides(text_file, snapshot, trainer_config__max_steps=200,
                               trainer_config__async_snapshots=True, trainer_config__save_every_steps=50)
    result = run(["prlimit", f"--fsize={limit}", sys.executable, MAIN, *overrides])
    line = one_error_line(result)
    assert result.returncode == 1
    assert line.startswith(f"error: could not write snapshot {snapshot} ("), line
    assert "Snapshot saved at step 50" not in result.stdout  # logged only once written
    # Stopped within a few steps of the failure, not at the next save (step 100).
    assert "Iter 40 |" in result.stdout and "Iter 80 |" not in result.stdout
    assert sha256(snapshot) == before and read_snapshot(str(snapshot)).step == 20
    assert sorted(os.listdir(tmp_path)) == ["snap.metrics.jsonl", "snap.pt"]  # no temporary left
