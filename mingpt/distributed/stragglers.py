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
since the last one, and judges each rank over a stretch of its latest windows: the shortest in which
the rank was busy for at least EVIDENCE_S seconds, and at least SLOW_WINDOWS windows long. A rank
whose busy time per step over its stretch is at least SLOW_FACTOR times the median of the other
ranks' over the same stretch is named, with the phase in which it is furthest above theirs, in the
progress line and the metrics (whose "ranks" lines hold every rank's figures of the window).

Why a stretch of seconds, and not a count of windows: on a loaded machine the kernel leaves a rank on
the busier core for seconds at a time before it moves it, so that two healthy ranks differ by far
more than any threshold over a window of a second or two. Measured on two cores at a load of 10 to
23, two healthy ranks, windows of about 1 s: 0.26x to 3.8x in one window (one rank 1.2x the other
or more in a quarter of them), 0.81x to 1.28x over stretches of 30 s. A rank that is slow for a
reason of its own stays slow: one computing each step twice over read 2.5x to 3.8x over every
stretch beside the same load. The load's imbalances last seconds, a slow rank's cause lasts, and
the stretch tells them apart (docs/troubleshooting.md#a-slow-rank).

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

SLOW_FACTOR = 1.6
"""A rank this many times the other ranks' median busy time per step over its stretch is slow:
above two healthy ranks' spread under load over EVIDENCE_S (1.28x), below a rank of half the
others' speed (2x)."""
EVIDENCE_S = 30.0
"""A rank is judged over its latest windows in which it was busy this many seconds (of its own
steps: an evaluation or a snapshot in between adds nothing)..."""
SLOW_WINDOWS = 2
"""...and over at least this many windows (at the default progress interval of 30 s: a minute)."""
PHASE_WORDS = {"data": "data loading", "compute": "computation"}


@dataclass(frozen=True)
class StepTimes:
    """One rank's running totals: steps taken, and seconds of them spent in each phase."""

    steps: int = 0
    data_s: float = 0.0
    compute_s: float = 0.0

    @property
    def busy_s(self) -> float:
        return self.data_s + self.compute_s

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
        self._history: deque[dict[int, StepTimes]] = deque()
        """Every rank's totals at the end of each window still needed for a stretch, oldest first."""

    def window(self, step: int, now: dict[int, StepTimes], hosts: dict[int, str]) -> Optional[Window]:
        """The window since the last one in which every rank took a step (None until there is one)."""
        before, self._before = self._before, now
        per_step = {rank: times.since(before[rank]) for rank, times in now.items() if rank in before}
        if len(now) < 2 or len(per_step) < len(now) or None in per_step.values():
            self._before = {**now, **before}  # the window stays open until every rank has moved
            if not self._history or set(now) != set(self._history[-1]):
                self._history = deque([self._before])  # the first totals, or a world of other ranks
            return None
        self._history.append(now)
        ranks = sorted(per_step)
        data, compute = ([per_step[rank][phase] for rank in ranks] for phase in (0, 1))
        slow = self._slow_rank(ranks, hosts)
        return Window(step, [round(s * 1000, 2) for s in data], [round(s * 1000, 2) for s in compute], slow)

    def _stretch_start(self, rank: int) -> Optional[int]:
        """The index in the history where rank's stretch starts: the latest from which it was busy
        EVIDENCE_S over SLOW_WINDOWS windows or more (None: not yet)."""
        latest = self._history[-1][rank]
        for start in range(len(self._history) - 1 - SLOW_WINDOWS, -1, -1):
            if latest.busy_s - self._history[start][rank].busy_s >= EVIDENCE_S:
                return start
        return None

    def _slow_rank(self, ranks: list[int], hosts: dict[int, str]) -> str:
        latest, found = self._history[-1], []
        starts = {rank: self._stretch_start(rank) for rank in ranks}
        for index, rank in enumerate(ranks):
            if starts[rank] is None:
                continue
            first = self._history[starts[rank]]
            data, compute = zip(*(latest[r].since(first[r]) for r in ranks))
            busy = [d + c for d, c in zip(data, compute)]
            others = statistics.median(others_than(index, busy))
            if others > 0 and busy[index] >= SLOW_FACTOR * others:
                found.append((busy[index] / others, index, data, compute))
        if None not in starts.values():  # no stretch will start before the earliest of these again
            for _ in range(min(starts.values())):
                self._history.popleft()
        if not found:
            return ""
        ratio, index, data, compute = max(found)
        excess = {"data": data[index] - statistics.median(others_than(index, list(data))),
                  "compute": compute[index] - statistics.median(others_than(index, list(compute)))}
        phase = max(excess, key=excess.get)
        host = f" ({hosts[ranks[index]]})" if ranks[index] in hosts else ""
        return f"rank {ranks[index]}{host} is {ratio:.1f}x the others' median step: {PHASE_WORDS[phase]}"


def others_than(index: int, values: list[float]) -> list[float]:
    return values[:index] + values[index + 1:]
