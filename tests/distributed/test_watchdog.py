"""watchdog.py: which rank hangs, from what each rank posted, timed by the judging rank's clock (the
real runs: tests/end_to_end/test_hangs.py)."""
import io
import os
import socket
import sys
import time
from collections import deque

import pytest

from mingpt.distributed.watchdog import Position, Seen, hang_verdict

TIMEOUT = 60.0


def seen(step: int, phase: str, heard_at: float = 100.0, moved_at: float = 100.0, item: int = 0) -> Seen:
    return Seen(Position(step, phase, item), heartbeat=1, host="node1", pid=4242, heard_at=heard_at,
                moved_at=moved_at, cpu_seen=deque([(heard_at, 0.0)]))


def test_a_rank_not_heard_from_is_named_with_where_it_was_and_who_waits():
    ranks = {0: seen(401, "backward", moved_at=30), 1: seen(400, "backward", heard_at=30, moved_at=30),
             2: seen(401, "backward", moved_at=30)}
    assert hang_verdict(ranks, now=100.0, timeout_s=TIMEOUT) == (
        "rank 1 (host node1, pid 4242) has not been heard from for 70 s; it was in step 400's backward pass "
        "(gradient sync); rank(s) 0, 2 are waiting for it in step 401's backward pass (gradient sync)")


def test_a_rank_heard_from_but_stuck_behind_the_others_is_named():
    ranks = {0: seen(12, "backward", moved_at=20), 1: seen(12, "data", moved_at=20)}
    assert hang_verdict(ranks, now=100.0, timeout_s=TIMEOUT).startswith(
        "rank 1 (host node1, pid 4242) has not moved for 80 s; it was in step 12's data loading; rank(s) 0 "
        "are waiting for it in step 12's backward pass")


def test_no_verdict_while_everything_moves_within_the_timeout_or_a_snapshot_is_written():
    moving = {0: seen(12, "forward", moved_at=90), 1: seen(12, "backward", moved_at=50)}
    assert hang_verdict(moving, now=100.0, timeout_s=TIMEOUT) is None
    # Rank 0 writes a snapshot alone for minutes; the others wait for it in the next step.
    writing = {0: seen(10, "snapshot", moved_at=-500), 1: seen(11, "backward", moved_at=-400)}
    assert hang_verdict(writing, now=100.0, timeout_s=TIMEOUT) is None
    # A long evaluation moves batch by batch.
    evaluating = {0: seen(85, "evaluation", item=7, moved_at=95),
                  1: seen(85, "evaluation", item=6, moved_at=99)}
    assert hang_verdict(evaluating, now=100.0, timeout_s=TIMEOUT) is None


def test_every_rank_in_one_collective_that_never_completes():
    ranks = {0: seen(7, "backward", moved_at=0), 1: seen(7, "backward", moved_at=10)}
    assert hang_verdict(ranks, now=100.0, timeout_s=TIMEOUT) == (
        "no rank has moved for 90 s: every rank is in step 7's backward pass (gradient sync) (a collective "
        "that never completes)")


def test_a_rank_seen_behind_just_after_a_long_wait_is_not_stuck():
    """After a long save, rank 0 posts its new step before rank 1's next post is read: rank 1 looks
    far behind and long unmoved, but rank 0 moves, so nothing is stuck (this once ended a good run)."""
    ranks = {0: seen(24, "optimizer", moved_at=100), 1: seen(11, "backward", moved_at=92)}
    assert hang_verdict(ranks, now=100.0, timeout_s=4.0) is None


def test_ranks_that_all_compute_or_one_that_compiles_are_not_stuck():
    """A step longer than the timeout on CPU ranks that all keep their cores busy is no collective that
    hangs; nor is a rank compiling (torch.compile's first step, minutes on a CPU). An idle rank behind
    busy ones is still named."""
    busy = {rank: seen(7, "forward", moved_at=0) for rank in (0, 1)}
    for rank in busy.values():
        rank.busy = True
    assert hang_verdict(busy, now=100.0, timeout_s=TIMEOUT) is None
    compiling = {0: seen(1, "compile", moved_at=0), 1: seen(1, "backward", moved_at=0)}
    assert hang_verdict(compiling, now=100.0, timeout_s=TIMEOUT) is None
    busy[1] = seen(6, "data", moved_at=0)
    assert hang_verdict(busy, now=100.0, timeout_s=TIMEOUT).startswith("rank 1 (host node1, pid 4242) has not moved")


def test_a_rank_is_busy_by_its_share_of_a_core_over_the_timeout_not_over_one_interval():
    """Posts every second, a 4 s timeout: a rank computing at half a core is still busy after one
    interval a loaded machine starved it through (CI took such a rank for one waiting in a collective);
    one that used no CPU for a whole timeout is not, whatever it did before."""
    spinning = seen(10, "forward", heard_at=0.0)
    for now, cpu_s in [(1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0), (5, 2.0)]:  # starved from 4 to 5
        spinning.note_cpu(now, cpu_s, window_s=4.0)
        spinning.heard_at = now
    assert spinning.busy
    waiting = seen(10, "backward", heard_at=0.0)
    for now, cpu_s in [(1, 0.9), (2, 1.8), (3, 1.8), (4, 1.8), (5, 1.8), (6, 1.8), (7, 1.8)]:
        waiting.note_cpu(now, cpu_s, window_s=4.0)
        waiting.heard_at = now
    assert not waiting.busy


# The net itself, in this process: the ranks' watchdog threads meet in a real TCPStore (as torchrun's
# agent's), a rank stops posting, and the one that finds it says the line and ends (its os._exit
# recorded instead), within the timeout and a few heartbeats.

class RecordingRaw(io.RawIOBase):
    """A file descriptor's writes, one entry per write(2). Under `python -u` (torchrun's and Slurm's
    usual PYTHONUNBUFFERED) sys.stderr is a TextIOWrapper that writes through to the raw file: each
    write() of the text reaches the descriptor at once, print's text and its newline as two."""

    def __init__(self):
        super().__init__()
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.writes.append(bytes(data))
        return len(data)


def unbuffered_stderr(monkeypatch) -> RecordingRaw:
    """sys.stderr as `python -u` makes it, over a RecordingRaw (set in the test itself: pytest sets
    its own capture again between a fixture and the test)."""
    raw = RecordingRaw()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace",
                                                        line_buffering=True, write_through=True))
    return raw


@pytest.fixture
def launched(monkeypatch):
    """A torchrun-like environment around a real TCPStore on loopback (the agent's, served here)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                        "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    yield store


def test_a_rank_that_stops_posting_is_named_in_one_line_in_one_write_and_the_run_ends(
        launched, monkeypatch, tmp_path):
    """Two ranks' watchdogs post to the store; rank 1's stops (a rank SIGSTOPped, swapped out, dead)
    while rank 0 moves on. Rank 0's thread names it with where it was and where rank 0 is, writes the
    report with its own stacks (rank 1 gives none), ends with status 1, and its line reaches stderr in
    one write, newline included: two ranks ending at once must not interleave their lines (print
    writes the text, then the newline)."""
    import torch

    from mingpt.distributed import watchdog
    from mingpt.distributed.stragglers import StepClock
    from mingpt.distributed.watchdog import RunWatchdog

    stderr = unbuffered_stderr(monkeypatch)
    exits = []

    def record_exit(status: int) -> None:  # os._exit, recorded: the watchdogs' threads end, not the process
        exits.append(status)
        for rank in ranks:
            rank._stop.set()

    monkeypatch.setattr(watchdog.os, "_exit", record_exit)
    monkeypatch.setattr(watchdog, "STACKS_WAIT_S", 0.5)  # rank 1 gives no stacks: no need to wait 5 s
    timeout_s = 1.5  # a heartbeat every 0.25 s
    ranks = [RunWatchdog(rank, 2, timeout_s, str(tmp_path), lambda: "the last snapshot (step 20) is kept",
                         StepClock(torch.device("cpu"))) for rank in (0, 1)]
    assert all(rank.active for rank in ranks)
    ranks[1].at("data", 402)
    started = time.monotonic()
    with ranks[0], ranks[1]:
        for item in range(6):  # both heard from; rank 0 evaluates, batch by batch
            ranks[0].at("evaluation", 402, item)
            time.sleep(0.1)
        ranks[1].__exit__(None, None, None)  # rank 1 stops posting
        stopped = time.monotonic()
        while ranks[0]._thread.is_alive() and time.monotonic() < stopped + timeout_s + 10:
            item += 1
            ranks[0].at("evaluation", 402, item)  # rank 0 moves on: nobody is stuck, rank 1 is silent
            time.sleep(0.05)
    assert not ranks[0]._thread.is_alive(), "rank 0's watchdog said nothing"
    said_after = time.monotonic() - stopped
    assert exits == [1] and timeout_s < said_after < timeout_s + 5, (exits, said_after)
    line = f"error: rank 1 (host {socket.gethostname()}, pid {os.getpid()}) has not been heard from for"
    assert len(stderr.writes) == 1, stderr.writes
    written = stderr.writes[0].decode()
    assert written.startswith(line) and written.endswith(
        "s; it was in step 402's data loading; rank(s) 0 are waiting for it in step 402's evaluation; "
        f"the last snapshot (step 20) is kept; each rank's position and stacks: "
        f"{tmp_path}/hang_report.txt\n"), written
    report = (tmp_path / "hang_report.txt").read_text()
    assert report.startswith(written[len("error: "):written.index("; the last snapshot")])
    assert "== rank 0 ==\nthread MainThread" in report and "== rank 1 ==" not in report
    assert time.monotonic() - started < 20


def test_a_run_with_compile_posts_its_compilations_as_the_compile_phase(world_of_one, tmp_path, monkeypatch):
    """Through the run's own path: the Trainer of trainer_config.compile=True builds its RunGuard, whose
    watchdog has torch.compile's callbacks registered (a test that built the watchdog itself held
    nothing of a Trainer or a guard that forgot them). A compilation under way (a backend that looks at
    the position stands in for inductor) finds the run's watchdog in the compile phase, and leaves it
    where it was."""
    import torch

    from helpers import make_text
    from mingpt.char_dataset import CharDataset
    from mingpt.model import GPT, GPTConfig
    from mingpt.optimizer import OptimizerConfig
    from mingpt.reporting import flops
    from mingpt.start_up import place_model
    from mingpt.trainer import Trainer, TrainerConfig

    monkeypatch.setattr(flops, "measure_cpu_peak", lambda dtype: flops.CpuPeak(1e11, clean=True))
    monkeypatch.setenv("MINGPT_CACHE_DIR", str(tmp_path))
    flops.peak_flops.cache_clear()
    torch._dynamo.reset()  # (it clears the callbacks too)
    dataset = CharDataset(make_text(500), 8)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=dataset.vocab_size, block_size=8))
    config = TrainerConfig(compile=True, use_amp=False, data_loader_workers=0,
                           snapshot_path=str(tmp_path / "snap.pt"))
    try:
        placed = place_model(config, OptimizerConfig(), model, world_of_one)
        trainer = Trainer(config, placed, dataset, None, dataset.vocab, world_of_one)
        watch = trainer.guard.watch
        watch.at("forward", 3)
        phases = []

        def looking_backend(graph, inputs):
            phases.append(watch.position.phase)
            return graph.forward

        compiled = torch.compile(lambda x: x * 2 + 1, backend=looking_backend)
        assert compiled(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
        assert phases == ["compile"] and watch.position == Position(3, "forward")
    finally:
        torch._dynamo.reset()
        flops.peak_flops.cache_clear()
