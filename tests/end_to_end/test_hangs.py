"""A run that hangs by itself, on real torchrun ranks: a stopped rank named within hang_timeout_s in one
line, a long save not taken for a hang, ranks that all compute longer than the timeout left alone, a
dead launcher's ranks ending themselves, a rank blocked in its data loading named as stuck
(distributed/watchdog.py; its parts in-process: tests/distributed/test_watchdog.py). The slow-rank
line (distributed/stragglers.py) needs tens of seconds of evidence, and has its own test on real
processes beside a loaded machine: tests/end_to_end/test_slow_rank.py."""
import re
import time

import psutil
import pytest
from helpers import (
    TORCHRUN,
    WORKER_SCRIPTS,
    assert_ok,
    rank_process,
    run,
    sha256,
    start_until,
    the_error_line,
    tiny_overrides,
)

pytestmark = pytest.mark.slow

HANG_TIMEOUT_S = 4
PROGRESS_S = 0.5


def two_ranks_with_faults(overrides: list[str]) -> list:
    """torchrun of 2 ranks on this machine, main.py with the faults FAULT and SLOW plant."""
    script = WORKER_SCRIPTS / "fault_injection.py"
    return [*TORCHRUN, "--standalone", "--nproc_per_node=2", script, *overrides]


def test_a_stopped_rank_is_named_in_one_line_and_a_long_save_is_not_a_hang(text_file, tmp_path):
    """Rank 0's snapshot write at step 10 pauses twice hang_timeout_s (rank 1 waits for it: heard
    from, it is no hang); rank 1 is then SIGSTOPped (a rank stuck in I/O, a dead GPU, swapped out):
    rank 0 ends the run within the timeout and a few heartbeats, in one line, with a report, and the
    newest snapshot is as it was."""
    snapshot = tmp_path / "snap.pt"
    overrides = tiny_overrides(text_file, snapshot, trainer_config__max_epochs=2, trainer_config__log_every=1,
                               trainer_config__save_every_steps=10,
                               trainer_config__progress_interval_s=PROGRESS_S,
                               trainer_config__hang_timeout_s=HANG_TIMEOUT_S)
    env = {"FAULT": "slow_write_at:10", "FAULT_RANK": "0", "SLOW_WRITE_S": str(2 * HANG_TIMEOUT_S)}
    command = two_ranks_with_faults(overrides)
    process, seen = start_until(command, "Snapshot saved at step 10", env)  # the long save went by
    for line in process.stdout:  # half-way between two snapshots
        seen.append(line)
        if re.search(r"\| Iter \d+5 \|", line):
            break
    before = sha256(snapshot)
    stopped = rank_process(process, 1)
    stopped.suspend()
    stopped_at = time.monotonic()
    for line in process.stdout:
        seen.append(line)
        if line.startswith("error:"):
            break
    said_after = time.monotonic() - stopped_at
    stopped.kill()  # torchrun would wait for a stopped worker to answer its SIGTERM
    rest, _ = process.communicate(timeout=120)
    output = "".join(seen) + rest
    said = the_error_line(output)
    assert re.match(rf"error: rank 1 \(host \S+, pid {stopped.pid}\) has not been heard from for \d+ s; it "
                    r"was in step \d+'s .*; rank\(s\) 0 are waiting for it in step \d+'s .*; the last "
                    r"snapshot "
                    r"\(step \d+0\) is kept as it was: .*snap\.pt; each rank's position and stacks: .*"
                    r"hang_report\.txt$", said), said
    assert said_after < HANG_TIMEOUT_S + 8, said_after
    assert process.returncode == 1
    report = (tmp_path / "hang_report.txt").read_text()
    assert "== rank 0 ==\nthread MainThread" in report and "== rank 1 ==" not in report
    assert sha256(snapshot) == before


def test_ranks_that_all_compute_longer_than_the_timeout_are_no_hang(text_file, tmp_path):
    """Both ranks keep their CPUs busy for 3x hang_timeout_s in step 10 (a long step on a CPU, or a
    compilation): no rank moves, but each is seen computing, not waiting in a collective, and the run
    ends as it should."""
    overrides = tiny_overrides(text_file, tmp_path / "snap.pt", trainer_config__max_steps=10,
                               trainer_config__hang_timeout_s=HANG_TIMEOUT_S)
    result = run(two_ranks_with_faults(overrides), env={"SLOW": f"spin:{3 * HANG_TIMEOUT_S}:10", "SLOW_RANK": "all"})
    assert_ok(result)
    assert "Finished: epoch 1, step 10" in result.stdout


def test_ranks_whose_launcher_died_end_themselves(text_file, tmp_path):
    """torchrun SIGKILLed (the OOM killer, an operator's wrong pid): its workers, in sessions of their
    own, would train on as orphans; each ends within a few heartbeats, saying why (or, when the
    other has ended first, losing contact with it in a collective). The run is far too long to end
    by itself meanwhile: a worker that said the line and trained on would still be there. (It once
    checked the slow-rank line first, and failed there one run in three under load, before the
    launcher was killed: that line has its own test, test_slow_rank.py.)"""
    overrides = tiny_overrides(text_file, tmp_path / "snap.pt", trainer_config__max_epochs=1000,
                               trainer_config__progress_interval_s=PROGRESS_S,
                               trainer_config__hang_timeout_s=HANG_TIMEOUT_S)
    command = two_ranks_with_faults(overrides)
    process, seen = start_until(command, "| step ", {})  # training is under way, on both ranks
    workers = psutil.Process(process.pid).children(recursive=True)  # the ranks, and any process of theirs
    assert {rank_process(process, rank) for rank in (0, 1)} <= set(workers)
    process.kill()
    killed_at = time.monotonic()
    gone, alive = psutil.wait_procs(workers, timeout=HANG_TIMEOUT_S + 10)
    assert not alive, f"orphans still running {time.monotonic() - killed_at:.0f} s after torchrun died"
    output = process.stdout.read()
    assert "its launcher (pid" in output, output
    for rank in (0, 1):
        ended = rf"^error: \[rank {rank}\] (its launcher \(pid|lost contact with another)"
        assert re.search(ended, output, re.M), output


def test_a_rank_blocked_in_its_data_loading_is_named_as_stuck(text_file, tmp_path):
    """Rank 1 blocks for good in its data loading at step 25 (a hung filesystem, a stuck worker): it
    is still heard from (its watchdog thread posts), but it does not move while rank 0 waits for it
    in the gradient sync; within the timeout and a few heartbeats, one line names it, its step and
    phase, and who waits where; exit status 1; the snapshot of step 20 is as it was."""
    snapshot = tmp_path / "snap.pt"
    overrides = tiny_overrides(text_file, snapshot, trainer_config__save_every_steps=10,
                               trainer_config__hang_timeout_s=HANG_TIMEOUT_S)
    command = two_ranks_with_faults(overrides)
    started = time.monotonic()
    process, seen = start_until(command, "Snapshot saved at step 20", {"SLOW": "data:600:25"})
    before = sha256(snapshot)
    rest, _ = process.communicate(timeout=60)
    output = "".join(seen) + rest
    said = the_error_line(output)
    assert re.match(r"error: rank 1 \(host \S+, pid \d+\) has not moved for \d+ s; it was in step 25's "
                    r"data loading; rank\(s\) 0 are waiting for it in step 25's backward pass \(gradient "
                    r"sync\); the last snapshot \(step 20\) is kept as it was", said), said
    assert process.returncode == 1 and time.monotonic() - started < 60
    assert sha256(snapshot) == before
