"""A rank that holds the others back, named with the phase that makes it slow.

Under DDP every rank's step lasts as long as the slowest rank's: the gradient all-reduce waits for
the last one to arrive, so step times taken after it all look the same. What differs is how long
each rank takes *before* it arrives. Each rank times, per step, on its own clock:
- data: waiting for its batch (the DataLoader, the copy to the device);
- compute: from its batch to the moment its backward pass has the gradients it computes last, those
  of the input embeddings (the forward pass uses them first); the gradient synchronisation then
  waits for the other ranks. On a GPU this is timed by CUDA events, read once they have passed:
  nothing waits for the device.
A rank's busy time per step is their sum. Each rank posts its running totals with its watchdog
position (watchdog.py, through the run's store); at each progress line rank 0 takes the window
since the last one: a rank whose busy time per step is at least SLOW_FACTOR times the median of the
other ranks' for SLOW_WINDOWS windows in a row is named, with the phase in which it is furthest above
theirs, in the progress line and the metrics (whose "ranks" lines hold every rank's figures).

Under FSDP and HSDP each block's all-gather in the forward pass makes the ranks wait for each other
within the computation, so a rank slow at computing slows every rank's compute time alike and is
not told apart; a rank slow at loading data still is (its wait comes before any collective). A slow
network link slows the collectives of every rank that uses it, and is not attributed to a rank.
"""
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

SLOW_FACTOR = 1.2
"""A rank this many times the other ranks' median busy time per step is slow..."""
SLOW_WINDOWS = 2
"""...when it is so in this many progress windows in a row (one window is noise: a page fault, a
neighbour's burst)."""
PHASE_WORDS = {"data": "data loading", "compute": "computation"}


@dataclass(frozen=True)
class StepTimes:
    """One rank's running totals: steps taken, and seconds of them spent in each phase."""

    steps: int = 0
    data_s: float = 0.0
    compute_s: float = 0.0

    def since(self, before: "StepTimes") -> Optional[tuple[float, float]]:
        """Seconds of data and compute per step in the window from before to self (None: no step)."""
        steps = self.steps - before.steps
        if steps <= 0:
            return None
        return (self.data_s - before.data_s) / steps, (self.compute_s - before.compute_s) / steps


class StepClock:
    """This rank's StepTimes, kept as the training thread moves through a step (RunWatchdog.at)."""

    def __init__(self, device: torch.device):
        self.on_cuda = device.type == "cuda"
        self.times = StepTimes()
        self._data_from: Optional[float] = None
        self._compute_from = None
        """When this step's computation started: a host time, or a CUDA event."""
        self._arrival = None
        """When the last gradients of the step were computed (None: not seen; the step's end counts)."""
        self._unread: deque = deque()  # (start, end) CUDA events of steps the device has not passed yet

    def time_arrival_at(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Arrival is when these parameters' gradients are accumulated: those backward computes last.
        (Under FSDP the sharded parameters get theirs after the reduce-scatter: the step's end counts.)"""
        for parameter in parameters:
            parameter.register_post_accumulate_grad_hook(lambda _: self._arrived())

    def waiting_for_data(self) -> None:
        self._data_from = time.perf_counter()

    def computing(self) -> None:
        now = time.perf_counter()
        if self._data_from is not None:
            self._add(data_s=now - self._data_from)
            self._data_from = None
        self._compute_from, self._arrival = self._now(now), None

    def _arrived(self) -> None:
        self._arrival = self._now(time.perf_counter())  # the last call of a step (micro-batch) counts

    def step_done(self) -> None:
        if self._compute_from is None:
            return
        end = self._arrival or self._now(time.perf_counter())
        if self.on_cuda:
            self._unread.append((self._compute_from, end))
            while self._unread and self._unread[0][1].query():  # passed: reading it waits for nothing
                start, passed = self._unread.popleft()
                self._add(compute_s=start.elapsed_time(passed) / 1000)
            self._add(steps=1)
        else:
            self._add(steps=1, compute_s=end - self._compute_from)
        self._compute_from = None

    def _now(self, host_time: float):
        if not self.on_cuda:
            return host_time
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _add(self, steps: int = 0, data_s: float = 0.0, compute_s: float = 0.0) -> None:
        times = self.times  # replaced whole: the watchdog's thread reads it
        self.times = StepTimes(times.steps + steps, times.data_s + data_s, times.compute_s + compute_s)


@dataclass(frozen=True)
class Window:
    """Every rank's figures over one progress window, and the slow rank's sentence if one is slow."""

    step: int
    data_ms: list[float]
    compute_ms: list[float]
    slow: str = ""

    def metrics(self) -> dict:
        fields = {"step": self.step, "data_ms": self.data_ms, "compute_ms": self.compute_ms}
        return {**fields, "slow": self.slow} if self.slow else fields


class StragglerWatch:
    """Rank 0's judge of windows of every rank's StepTimes."""

    def __init__(self) -> None:
        self._before: dict[int, StepTimes] = {}
        self._streaks: dict[int, int] = {}

    def window(self, step: int, now: dict[int, StepTimes], hosts: dict[int, str]) -> Optional[Window]:
        """The window since the last one in which every rank took a step (None until there is one)."""
        before, self._before = self._before, now
        per_step = {rank: times.since(before[rank]) for rank, times in now.items() if rank in before}
        if len(now) < 2 or len(per_step) < len(now) or None in per_step.values():
            self._before = {**now, **before}  # the window stays open until every rank has moved
            return None
        ranks = sorted(per_step)
        data, compute = ([per_step[rank][phase] for rank in ranks] for phase in (0, 1))
        slow = self._slow_rank(ranks, data, compute, hosts)
        return Window(step, [round(s * 1000, 2) for s in data], [round(s * 1000, 2) for s in compute], slow)

    def _slow_rank(self, ranks: list[int], data: list[float], compute: list[float],
                   hosts: dict[int, str]) -> str:
        busy = [d + c for d, c in zip(data, compute)]
        for index, rank in enumerate(ranks):
            others = statistics.median(others_than(index, busy))
            slow = others > 0 and busy[index] >= SLOW_FACTOR * others
            self._streaks[rank] = self._streaks.get(rank, 0) + 1 if slow else 0
        named = [index for index, rank in enumerate(ranks) if self._streaks[rank] >= SLOW_WINDOWS]
        if not named:
            return ""
        index = max(named, key=lambda i: busy[i])
        excess = {"data": data[index] - statistics.median(others_than(index, data)),
                  "compute": compute[index] - statistics.median(others_than(index, compute))}
        phase = max(excess, key=excess.get)
        ratio = busy[index] / statistics.median(others_than(index, busy))
        host = f" ({hosts[ranks[index]]})" if ranks[index] in hosts else ""
        return f"rank {ranks[index]}{host} is {ratio:.1f}x the others' median step: {PHASE_WORDS[phase]}"


def others_than(index: int, values: list[float]) -> list[float]:
    return values[:index] + values[index + 1:]
