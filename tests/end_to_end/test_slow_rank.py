"""The slow-rank line on real processes (distributed/stragglers.py): two torchrun ranks on a machine
whose cores are loaded by other processes are never named; one of them computing each step twice
over beside the same load is, with its phase."""
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time

import pytest
from helpers import REPO, TORCHRUN, WORKER_SCRIPTS, kill_tree, make_text, tiny_overrides

from mingpt.distributed.stragglers import EVIDENCE_S, SLOW_FACTOR

pytestmark = pytest.mark.slow

JUDGED_S = 10.0
"""The healthy ranks train beside the load until each has been busy EVIDENCE_S and this much more
(a rank of this tiny model is busy less than half of its step's wall time: 40 to 60 s here), so that
every window of the last JUDGED_S of steps was judged over a whole stretch."""
NAMED_WITHIN_S = 4 * EVIDENCE_S
"""The slowed rank's line comes once its stretch of EVIDENCE_S holds more slow steps than healthy
ones (about 1.5 EVIDENCE_S of wall time here); the rest is room for a crowded machine."""
HOGS = 2
"""Processes that keep a core busy each, placed by the kernel: the load spread over both cores."""
PROGRESS = re.compile(r"^epoch \d+/\d+ \| step (\d+)/")
NAMED = re.compile(r"\| rank (\d+) \(\S+\) is (\d+\.\d)x the others' median step: (.+)$")


class Lines:
    """A process's output lines as they come, read by a thread of their own (a wait never blocks)."""

    def __init__(self, process: subprocess.Popen):
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        def read() -> None:
            for line in process.stdout:
                self.lines.put(line)

        threading.Thread(target=read, daemon=True).start()

    def until(self, deadline: float, wanted=lambda line: False) -> str:
        """Lines until one that is wanted (returned) or the deadline ("")."""
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if wanted(line):
                return line
        return ""


def hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: sum(range(10_000))"])


def test_healthy_ranks_on_loaded_cores_are_not_named_and_a_rank_of_half_their_speed_is(tmp_path):
    text = tmp_path / "input.txt"
    text.write_text(make_text(100_000))  # epochs of 1,400 steps: few evaluations to pause the windows
    trigger = tmp_path / "slow_from_now"
    overrides = tiny_overrides(text, tmp_path / "snap.pt", trainer_config__max_epochs=1000,
                               trainer_config__save_every=1000, trainer_config__log_every=100,
                               trainer_config__progress_interval_s=0.5, trainer_config__hang_timeout_s=12,
                               gpt_config__n_embd=128)  # steps mostly computation: busy time comes fast
    command = [*TORCHRUN, "--standalone", "--nproc_per_node=2", WORKER_SCRIPTS / "straggler.py", *overrides]
    process = subprocess.Popen([str(part) for part in command], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                    "SLOW_FROM_FILE": str(trigger), "SLOW_RANK": "1"})
    hogs = []
    try:
        output = Lines(process)
        assert output.until(time.monotonic() + 180, PROGRESS.match), "".join(output.seen)
        hogs = [hog() for _ in range(HOGS)]
        deadline = time.monotonic() + 400
        while min(busy_until(tmp_path, None)) < EVIDENCE_S + JUDGED_S and time.monotonic() < deadline:
            output.until(time.monotonic() + 2)
        healthy = [line for line in output.seen if PROGRESS.match(line)]
        assert not any(NAMED.search(line) for line in healthy), "".join(healthy)
        slowed_from = int(PROGRESS.match(healthy[-1])[1])
        trigger.touch()
        named = output.until(time.monotonic() + NAMED_WITHIN_S, NAMED.search)
        assert named, "".join(output.seen[-20:])
        rank, ratio, phase = NAMED.search(named).groups()
        assert (rank, phase) == ("1", "computation") and float(ratio) >= SLOW_FACTOR, named
        assert int(PROGRESS.match(named)[1]) > slowed_from
    finally:
        for busy_loop in hogs:
            busy_loop.kill()
            busy_loop.wait()
        kill_tree(process)
    # The healthy stretch was judged: each rank was busy longer than EVIDENCE_S before the slowdown.
    assert min(busy_until(tmp_path, slowed_from)) > EVIDENCE_S


def busy_until(folder, last_step) -> list[float]:
    """Each rank's busy seconds in the windows of the run's metrics (up to last_step)."""
    metrics = folder / "snap.metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    busy, before = [0.0, 0.0], None
    for window in (json.loads(line) for line in lines[:-1] if '"ranks"' in line):  # the last: being written
        if before is not None and (last_step is None or window["step"] <= last_step):
            steps = window["step"] - before
            for rank in (0, 1):
                busy[rank] += (window["data_ms"][rank] + window["compute_ms"][rank]) / 1000 * steps
        before = window["step"]
    return busy
