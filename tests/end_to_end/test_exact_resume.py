"""Exact resume: a worker SIGKILLed mid-run and restarted by torchrun, or a run stopped by a signal to
every process (data workers too) and started again, ends bitwise where an unbroken run ends; a save
killed half-way never costs the previous snapshot; a snapshot taken mid-shard and resumed at another
world size continues the sample order exactly."""
import os
import re
import signal
import subprocess
import sys
import time
from typing import Optional

import pytest
import torch
from helpers import (
    MAIN,
    MINGPT,
    TORCHRUN,
    WORKER_SCRIPTS,
    assert_ok,
    check_two_rank_run,
    final_state,
    llmc_shards_of,
    run,
    run_main_in_process,
    run_with_restarts,
    sha256,
    signal_every_process,
    start_until,
    tiny_overrides,
)
from state_equality import assert_same_state

from mingpt.distributed.control import INTERRUPT_EXIT_STATUS, STOP_EXIT_STATUS

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH = 85  # 5,385 train samples / (32 per rank x 2 ranks)


@pytest.fixture(scope="module")
def unbroken(ddp_two_epochs):
    """Where the 2-rank runs below end when nothing stops them (snapshot cadences change no bit)."""
    return final_state(ddp_two_epochs.snapshots[-1])


def unbroken_after(request, method: str, epochs: int) -> dict:
    """Where the suite's unbroken 2-rank run of the method stands after epochs: a run of that many
    epochs ends there (the learning rate is constant)."""
    run = request.getfixturevalue(f"{method}_two_epochs")
    return final_state(run.snapshots[epochs - 1])


AT_STEP_30 = "Resuming training from snapshot at Epoch 0 (step 30, sample 1920 of epoch 1)"
AT_EPOCH_1 = "Resuming training from snapshot at Epoch 1"
AT_A_STEP_SAVED_IN_THE_BACKGROUND = re.compile(
    r"Resuming training from snapshot at Epoch 0 \(step (20|30), sample (1280|1920) of epoch 1\)")
"""Step 30's, or step 20's where step 30's background write was still under way at the kill (a loaded
machine: seen once in CI); either way the run ends where the unbroken one does."""
ASYNC = {"trainer_config__async_snapshots": True}
SHARDED = {"trainer_config__snapshot_format": "sharded"}


# Kill points: during a snapshot's write, then (in the restarted attempt) during the eval pass after
# epoch 1's snapshot, over two epochs; mid-epoch after a background save, over one. (Mid-epoch with
# synchronous saves, the SIGTERM tests below resume from a step snapshot.)
@pytest.mark.parametrize("method, faults, fault_ranks, resumed_from, epochs, settings", [
    # The writer itself, half-way through the step-40 snapshot: the one of step 30 is resumed; then
    # rank 1, as the eval pass after epoch 1 starts: epoch 1's snapshot is resumed.
    pytest.param("ddp", ["snapshot_write:40", "eval:1"], [0, 1], [AT_STEP_30, AT_EPOCH_1], 2, {},
                 id="mid-write-then-mid-eval"),
    # Snapshots written in the background while training went on to step 37: each holds its step.
    # FSDP's full state is gathered from the shards for the background writer.
    pytest.param("fsdp", ["step:37"], [1], [AT_A_STEP_SAVED_IN_THE_BACKGROUND], 1, ASYNC, id="fsdp-async"),
    pytest.param("ddp", ["step:37"], [1], [AT_A_STEP_SAVED_IN_THE_BACKGROUND], 1, {**ASYNC, **SHARDED},
                 id="async-sharded"),
])
def test_killed_worker_restarts_and_ends_bitwise_equal(request, text_file, tmp_path, method, faults,
                                                      fault_ranks, resumed_from, epochs, settings):
    sharded = settings.get("trainer_config__snapshot_format") == "sharded"
    snapshot = tmp_path / ("snaps" if sharded else "snap.pt")
    result = run_with_restarts(text_file, snapshot, ",".join(faults), ",".join(map(str, fault_ranks)),
                               method=method, epochs=epochs, **settings)
    for rank in fault_ranks:  # each planted SIGKILL happened
        assert f"failed (exitcode: -9) local_rank: {rank}" in result.stderr
    for resumed in resumed_from:
        assert re.search(resumed, result.stdout) if isinstance(resumed, re.Pattern) else resumed in result.stdout, \
            result.stdout
    assert_same_state(newest_state(snapshot), unbroken_after(request, method, epochs))


def newest_state(snapshot):
    """final_state of a single-file snapshot, or of the newest sharded one in a folder."""
    if snapshot.suffix == ".pt":
        return final_state(snapshot)
    from mingpt.storage.sharded_store import to_single_file

    newest = sorted(snapshot.glob("sharded_*"))[-1]
    to_single_file(str(newest), str(snapshot.parent / "converted.pt"))
    return final_state(snapshot.parent / "converted.pt")


HANG_MID_SAVE = """
import sys, time, torch
from mingpt.storage import snapshot as s
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
    code = HANG_MID_SAVE.format(path=path)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env=env)
    assert child.stdout.readline().strip() == "writing"
    time.sleep(0.2)
    child.kill()
    child.wait()


def test_a_local_save_killed_half_way_keeps_the_previous_snapshot(tmp_path):
    from mingpt.storage.snapshot import Snapshot, read_snapshot, write_snapshot

    path = tmp_path / "snap.pt"
    write_snapshot(Snapshot(step=1), str(path))
    before = sha256(path)
    kill_mid_save(str(path))
    assert sha256(path) == before
    assert read_snapshot(str(path)).step == 1


# Stopping on a signal: every rank finishes its step, one snapshot, exit 75 (130 after Ctrl-C); a
# restart resumes there and ends bitwise where an unbroken run ends. The signal goes to every process
# of the run, data workers included (two per rank here), as Slurm, `timeout` and a terminal send it.

STOPPED = re.compile(r"Stopping on (SIG\w+): snapshot saved at step (\d+)")
WORKERS = {"trainer_config__data_loader_workers": 2}


def stop_with(cmd: list, number: int, everyone: bool = True, env: Optional[dict] = None) -> tuple[int, str]:
    """Run cmd, signal it (every process, or the launcher alone) once training is under way; its exit
    status and whole output."""
    process, seen = start_until(cmd, "| Iter 40 |", env)
    if everyone:
        signalled = signal_every_process(process, number)
        assert any(p.name() == "pt_data_worker" for p in signalled), "no data worker was running"
    else:
        process.send_signal(number)
    rest, _ = process.communicate(timeout=120)
    return process.returncode, "".join(seen) + rest


@pytest.fixture(scope="module")
def unbroken_one_process(tiny_epoch):
    return final_state(tiny_epoch.snapshot)


def assert_stopped_and_saved(output: str, snapshot, signal_name: str = "SIGTERM") -> int:
    match = STOPPED.search(output)
    assert match and match.group(1) == signal_name, output
    step = int(match.group(2))
    assert torch.load(snapshot, weights_only=True)["step"] == step
    assert output.index(f"Snapshot saved at step {step}") < match.start()  # written before the line
    assert "Traceback" not in output[:match.start()] and "killed by signal" not in output, output
    return step


@pytest.mark.parametrize("number, status, settings", [
    (signal.SIGTERM, STOP_EXIT_STATUS, {}),
    (signal.SIGUSR1, STOP_EXIT_STATUS, ASYNC),  # the save is written before the stop line
    (signal.SIGINT, INTERRUPT_EXIT_STATUS, {}),  # Ctrl-C once
], ids=["SIGTERM", "SIGUSR1-async", "Ctrl-C"])
def test_a_signal_to_every_process_stops_one_process_with_a_snapshot_and_resumes_exactly(
        text_file, tmp_path, capsys, one_torch_thread, unbroken_one_process, number, status, settings):
    snapshot = tmp_path / "snap.pt"
    overrides = tiny_overrides(text_file, snapshot, **WORKERS, **settings)
    code, output = stop_with([sys.executable, MAIN, *overrides], number)
    assert code == status, output
    step = assert_stopped_and_saved(output, snapshot, signal.Signals(number).name)
    assert "Traceback" not in output, output
    if number == signal.SIGINT:
        assert output.count("Ctrl-C: stopping at the end of this step with a snapshot; press Ctrl-C") == 1
        return  # its snapshot resumes as SIGTERM's does
    # What the restart does, not how it is started: main.run() in this process, loading in it too.
    resumed = run_main_in_process(tiny_overrides(text_file, snapshot, **settings), capsys)
    assert_ok(resumed)
    assert f"(step {step}, sample {step * 32} of epoch 1)" in resumed.stdout
    assert_same_state(final_state(snapshot), unbroken_one_process)


def test_a_second_ctrl_c_quits_at_once_and_keeps_the_last_snapshot(text_file, tmp_path):
    """The second Ctrl-C lands while the stop's own snapshot is being written (paused half-way)."""
    snapshot = tmp_path / "snap.pt"
    overrides = tiny_overrides(text_file, snapshot, trainer_config__save_every_steps=20, **WORKERS)
    process, seen = start_until([sys.executable, WORKER_SCRIPTS / "fault_injection.py", *overrides],
                                "| Iter 40 |", env={"FAULT": "slow_write:41", "FAULT_RANK": "0"})
    before = sha256(snapshot)  # step 40's
    signal_every_process(process, signal.SIGINT)
    for line in process.stdout:
        seen.append(line)
        if line.startswith("Ctrl-C: stopping"):
            break
    assert seen[-1].startswith("Ctrl-C: stopping"), "".join(seen)  # the first Ctrl-C asked for a stop
    time.sleep(2)  # the stop's save is under way, paused half-way through its write
    started = time.monotonic()
    signal_every_process(process, signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    output = "".join(seen) + rest
    assert process.returncode == INTERRUPT_EXIT_STATUS, output
    assert time.monotonic() - started < 15  # not after the 30 s write (the bound leaves room for load)
    last_line = output.rstrip().splitlines()[-1]  # what is left, as it was when it quit
    # The stop's step: after step 40 (the line was read, then the signal sent: a loaded machine's run has
    # gone on a few steps by then), the one under way or the next (the agreement is read a step late);
    # its save is the one cut short.
    stopped_at = re.fullmatch(rf"Interrupted: quit at once; the last snapshot \(step 40\) is kept as it was: "
                              rf"{re.escape(str(snapshot))}; the save of step (\d+) was not finished", last_line)
    assert stopped_at and int(stopped_at[1]) > 40, output
    assert "Traceback" not in output and "Stopping on" not in output, output
    assert sha256(snapshot) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap.metrics.jsonl", "snap.pt"]  # no temporary


# Every process signalled with SIGTERM: torchrun's (the README's command; torchrun passes the signal
# on too, so each worker gets it twice). launch.py alone, with SIGUSR1 (Slurm's usual warning, which
# torchrun does not pass on unless told): it passes the signal on to each worker's session and says
# what the workers did (with every process signalled too, its workers would get what torchrun's get,
# checked above).
@pytest.mark.parametrize("launcher, everyone, number", [
    ("torchrun", True, signal.SIGTERM),
    ("launch.py", False, signal.SIGUSR1),
], ids=["torchrun-every-process", "launch.py-alone"])
def test_a_stop_signal_stops_every_rank_at_one_step_with_data_workers_and_resumes_exactly(
        text_file, tmp_path, unbroken, launcher, everyone, number):
    snapshot = tmp_path / "snap.pt"
    overrides = tiny_overrides(text_file, snapshot, trainer_config__max_epochs=2,
                               trainer_config__save_every_steps=10, trainer_config__data_loader_workers=1)
    if launcher == "torchrun":
        command = [*TORCHRUN, "--standalone", "--nproc_per_node=2", MAIN, *overrides]
    else:
        command = [sys.executable, MINGPT / "launch.py", "--nproc", "2", *overrides]
    status, output = stop_with(command, number, everyone)
    name = signal.Signals(number).name
    if launcher == "launch.py":
        assert status == STOP_EXIT_STATUS, output
        assert f"launch.py: stopped on {name}; every worker saved its snapshot first" in output
        assert "Traceback" not in output, output
    else:  # torchrun's own: it exits 1 with a traceback of its own whatever its workers' statuses
        assert status == 1, output
    step = assert_stopped_and_saved(output, snapshot, name)
    assert output.count(f"Stopping on {name}") == 1  # rank 0 speaks for both
    if everyone:
        return  # what a resume does with a step snapshot does not depend on who got the signal
    resumed = run(command)  # launch.py's two CPU workers: one snapshot writer, rank 0's lines alone
    check_two_rank_run(resumed, snapshot)
    assert f"Resuming training from snapshot at Epoch 0 (step {step}," in resumed.stdout
    assert_same_state(final_state(snapshot), unbroken)


def test_a_mid_shard_snapshot_resumed_at_another_world_size_continues_the_sample_order(
        text_file, tmp_path, capsys, monkeypatch, one_torch_thread):
    """2 ranks stop mid-epoch, in the second of 3 llm.c shards read one at a time (a step budget; the
    shards hold 60,000 ids, and a validation shard of its own gives consecutive windows); 1
    rank (main.run() in this process) finishes the epoch: each sample once, and from the resumed
    sample on in exactly the order a run of 1 rank takes them."""
    from workers.fault_injection import record_samples

    from mingpt.char_dataset import DataConfig, open_corpus, split_dataset
    from mingpt.distributed.process_group import DistEnv
    from mingpt.tokens.data_loader import GlobalOrderSampler, rank_loader

    snapshot, record = tmp_path / "snap.pt", tmp_path / "samples"
    record.mkdir()
    shards = llmc_shards_of(text_file, tmp_path / "shards", tmp_path / "tokenizer.json", shards=3,
                            ids_per_shard=20_000, val_ids=2000)
    data = DataConfig(path=shards, val_path=str(tmp_path / "shards" / "val.bin"), block_size=16,
                      tokenizer=str(tmp_path / "tokenizer.json"), shards_at_once=1)
    overrides = tiny_overrides(shards, snapshot, data_config__tokenizer=data.tokenizer,
                               data_config__val_path=data.val_path, data_config__shards_at_once=1)
    first = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", WORKER_SCRIPTS / "fault_injection.py",
                 *overrides, "trainer_config.max_steps=30"], env={"RECORD_SAMPLES": str(record)})
    assert_ok(first)
    assert "Snapshot saved at step 30 (the last)" in first.stdout
    monkeypatch.setattr(GlobalOrderSampler, "__iter__", GlobalOrderSampler.__iter__)  # put back after
    record_samples(str(record))
    second = run_main_in_process(overrides, capsys)
    assert_ok(second)
    assert "resumed by 1: epoch 1 continues at sample 1,920" in second.stderr + second.stdout
    assert torch.load(snapshot, weights_only=True)["finished_epoch"] == 1
    by_process = samples_by_process(record)  # before the sampler below adds its own

    seed = 1337  # trainer_config.seed's default
    train, test = split_dataset(open_corpus(data), data, seed, open_corpus(data, validation=True))
    one_rank = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                       backend="gloo")
    loader = rank_loader(train, 32, 1, 0, 0, seed, one_rank, ())
    loader.sampler.set_epoch(1)
    order = torch.cat(list(loader.sampler)).tolist()  # the order of a run of 1 rank
    assert 1920 < len(order) and len(train) == len(order)
    resumed = by_process.pop(os.getpid())
    assert sorted(sum(by_process.values(), [])) == sorted(order[:1920])
    assert resumed == order[1920:]


def samples_by_process(folder) -> dict[int, list[int]]:
    """The samples each process trained in epoch 1, in its order, by process id."""
    by_pid = {}
    for path in folder.glob("samples-*.txt"):
        pid = int(path.stem.rsplit("-", 1)[1])
        by_pid[pid] = [i for line in path.read_text().splitlines() for i in map(int, line.split()[1:])
                       if line.split()[0] == "1"]
    return by_pid
