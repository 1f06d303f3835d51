"""A run that goes wrong by itself: a rank that hangs or dies, or a launcher that dies, is found
within hang_timeout_s and said in one line, instead of after the 30-minute collective timeout.

Each rank keeps its position, the step and phase it is in (data, forward, backward, optimizer,
snapshot, evaluation), which the training thread sets as it goes: an attribute assignment, nothing
measurable. A daemon thread per rank posts it to the run's store (the TCPStore of torchrun's agent,
through a connection of its own) every few seconds with a heartbeat count, and reads every other
rank's; its own clock times what it sees, so hosts' clocks never meet. A rank is hung when
- not heard from: its heartbeat has not moved for hang_timeout_s (stopped, swapped out, dead), or
- stuck: no rank has moved for hang_timeout_s, and it is behind the others, who wait for it in a
  collective (or all are in one collective that never completes). While a rank writes a snapshot
  (rank 0 alone, to S3, for minutes) it is heard from and the others wait for it as they should:
  no rank is stuck then.
The first rank to see it posts the verdict; every rank that still can adds its Python stacks; that
first rank writes `hang_report.txt` beside the snapshots and says the one line; every rank then
exits with status 1, so torchrun, launch.py and Slurm see a failed run (and an elastic torchrun
restarts it from the last snapshot). A rank whose launcher has died (its parent process changed,
or the store stopped answering) ends itself the same way instead of training on as an orphan.

Not moving is not always hanging. A rank compiling (torch.compile's first steps, minutes on a CPU)
posts the phase "compile" and, like one writing a snapshot, is never taken for stuck. On a CPU a rank
whose process keeps its cores busy is computing: when every rank is, none is stuck (a step longer
than the timeout); a rank waiting in a collective is idle. (On a GPU the host may spin while it
waits, so there only compilation is told apart.)

A store that stops moving is named too, in any run, a single process included: every read and write
of the run's files is a transfer (common/files.py), and one whose bytes have not moved for
hang_timeout_s (a snapshot or metrics upload to an S3 that stopped answering, a stale NFS mount)
ends the run in one line naming the rank, the file and how much was written, long before the
collective timeout; the snapshot before it is whole (writes are atomic).
"""
import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from mingpt.common import files
from mingpt.common.errors import say_line
from mingpt.common.logger import warn_once
from mingpt.distributed.process_group import mark_said
from mingpt.distributed.stragglers import StepClock, StepTimes

PHASES = ("data", "compile", "forward", "backward", "optimizer", "snapshot", "evaluation")
"""In the order a step meets them: a step's data to its optimizer step, then what follows the step."""
NEVER_STUCK = ("snapshot", "compile")
"""Phases a rank may spend long in without moving: its transfers are watched instead (snapshot), or
it is busy by definition (compile)."""
WORDS = {"data": "data loading", "compile": "compilation", "forward": "forward pass",
         "backward": "backward pass (gradient sync)", "optimizer": "optimizer step", "snapshot": "snapshot",
         "evaluation": "evaluation"}
BUSY_SHARE = 0.1
"""A process that used at least this share of one core's time since its last post is computing: one
waiting in a collective uses next to none, and one computing on a machine shared with other work
may get a fraction of a core."""
KEY = "mingpt/watch"
REPORT = "hang_report.txt"
STACKS_WAIT_S = 5.0
"""How long the rank that found a hang waits for the others' stacks before it reports without them."""


@dataclass(frozen=True)
class Position:
    step: int = 0
    phase: str = "data"
    item: int = 0
    """A count within the phase (an evaluation's batch): a long phase that moves is not stuck."""

    def order(self) -> tuple[int, int, int]:
        return self.step, PHASES.index(self.phase), self.item

    def __str__(self) -> str:
        return f"step {self.step}'s {WORDS[self.phase]}"


@dataclass
class Seen:
    """What one rank's thread knows of another rank, timed by its own clock."""

    position: Position
    heartbeat: int
    host: str
    pid: int
    heard_at: float
    moved_at: float
    times: StepTimes = StepTimes()
    """Its running step times (stragglers.py)."""
    busy: bool = False
    """Whether it kept computing over the last timeout (a CPU rank's CPU time grew; note_cpu)."""
    cpu_seen: deque = field(default_factory=deque)
    """(when heard, its process's CPU time) of its posts over the last timeout, and of the one before
    them; from its first post heard on."""

    def note_cpu(self, now: float, cpu_s: float, window_s: float) -> None:
        """Its CPU time at a post just heard. Busy: it used BUSY_SHARE of a core over the last window_s,
        the stall a verdict looks at; not merely between two posts, an interval through which a loaded
        machine may starve a computing rank (CI: a spinning rank taken for one waiting)."""
        seen = self.cpu_seen
        seen.append((now, cpu_s))
        while len(seen) > 2 and seen[1][0] <= now - window_s:
            seen.popleft()
        since, cpu_then = seen[0]
        self.busy = cpu_s - cpu_then >= (now - since) * BUSY_SHARE


def hang_verdict(seen: dict[int, Seen], now: float, timeout_s: float) -> Optional[str]:
    """The sentence that names what hangs, or None while nothing does."""
    silent = sorted(rank for rank, s in seen.items() if now - s.heard_at > timeout_s)
    if silent:
        return _sentence(seen, silent, "has not been heard from", now - seen[silent[0]].heard_at)
    # A rank that stops stops every other within a collective: while any moves, none is stuck (and
    # a rank seen far ahead of another may only be seen before the other's next post).
    still = now - max(s.moved_at for s in seen.values())
    if still <= timeout_s or any(s.position.phase in NEVER_STUCK for s in seen.values()):
        return None
    if all(s.busy for s in seen.values()):
        return None  # every rank computing: a long step, no collective that hangs
    last = max(s.position.order() for s in seen.values())
    behind = sorted(rank for rank, s in seen.items() if s.position.order() < last)
    if behind:
        return _sentence(seen, behind, "has not moved", now - seen[behind[0]].moved_at)
    return (f"no rank has moved for {still:.0f} s: every rank is in {seen[0].position} (a collective that "
            "never completes)")


def _sentence(seen: dict[int, Seen], culprits: list[int], what: str, for_s: float) -> str:
    first = seen[culprits[0]]
    who = ", ".join(f"rank {rank} (host {seen[rank].host}, pid {seen[rank].pid})" for rank in culprits)
    waiting = sorted(rank for rank in seen if rank not in culprits)
    wait = ""
    if waiting:
        ranks = ", ".join(map(str, waiting))
        wait = f"; rank(s) {ranks} are waiting for it in {seen[waiting[0]].position}"
    return f"{who} {what} for {for_s:.0f} s; it was in {first.position}{wait}"


class RunWatchdog:
    """One rank's watch over the run (a context: the thread runs inside it)."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, report_folder: str,
                 kept: Callable[[], str], clock: StepClock, compiled: bool = False):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.clock = clock
        self.on_cpu = not clock.on_cuda
        """Whether a busy process means a computing rank (BUSY_SHARE)."""
        self._compiling = 0
        """torch.compile's compilations under way (its callbacks, when the model is compiled)."""
        self._before_compiling = Position()
        if compiled:
            watch_compilation(self._compilation_starts, self._compilation_ends)
        """This rank's step times, kept by at() and posted with its position (when active)."""
        self.seen: dict[int, Seen] = {}
        """Every rank as this rank's thread last read them (once all have posted)."""
        self.report_folder = report_folder
        self.kept = kept
        """What the run leaves to resume from, for the line (Checkpointer.kept)."""
        self.position = Position()
        launched = "MASTER_ADDR" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ
        self.active = world_size > 1 and launched
        """Only under a launcher, with other ranks to watch."""
        self.interval_s = min(5.0, timeout_s / 6)
        self._parent = os.getppid()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store: Optional[dist.Store] = None
        # Keys of this attempt: an elastic restart keeps torchrun's store, and must not meet the
        # verdict that ended the attempt before it.
        self._key = f"{KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def _compilation_starts(self, *args) -> None:
        if self._compiling == 0:
            self._before_compiling = self.position
            self.position = Position(self.position.step, "compile")
        self._compiling += 1

    def _compilation_ends(self, *args) -> None:
        self._compiling = max(self._compiling - 1, 0)
        if self._compiling == 0 and self.position.phase == "compile":
            self.position = self._before_compiling

    def check_timeout(self, step_estimate_s: float) -> None:
        """Warn at start-up when a step may well take longer than hang_timeout_s (while a rank computes
        a step, another that waits for it in a collective has not moved)."""
        if self.active and step_estimate_s * 2 > self.timeout_s:
            warn_once(f"trainer_config.hang_timeout_s={self.timeout_s:g} is shorter than twice this run's "
                      f"estimated step (about {step_estimate_s:.0f} s, before any is measured): a rank "
                      "computing a step that long while another waits for it would be taken for hung; raise "
                      "it (compilation is watched as a phase of its own, never taken for a hang)")

    def at(self, phase: str, step: int, item: int = 0) -> None:
        """The training thread's position: phase of step (IN_STEP phases: the step being taken)."""
        self.position = Position(step, phase, item)
        if not self.active:
            return  # nobody reads the step times: no event, no clock on the hot path
        if phase == "data":
            self.clock.waiting_for_data()
        elif phase == "forward" and item == 0:
            self.clock.computing()
        elif phase == "optimizer":
            self.clock.step_done()

    def rank_times(self) -> tuple[dict[int, StepTimes], dict[int, str]]:
        """Every rank's step times and host, as last read (empty before every rank has posted)."""
        seen = dict(self.seen)
        return {rank: s.times for rank, s in seen.items()}, {rank: s.host for rank, s in seen.items()}

    def __enter__(self) -> "RunWatchdog":
        if self.active:
            self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                        is_master=False, timeout=timedelta(seconds=self.interval_s * 2),
                                        wait_for_workers=False)
        self._thread = threading.Thread(target=self._watch, name="mingpt-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()

    def _watch(self) -> None:
        heartbeat, unanswered_since = 0, None
        while not self._stop.wait(self.interval_s):
            stalled = files.stalled_transfer(self.timeout_s)
            if not self.active:  # alone: only this process's files to watch
                if stalled is not None:
                    self._end(f"{self._stall_line(stalled)}; {self.kept()}")
                continue
            if os.getppid() != self._parent:
                self._end(f"[rank {self.rank}] its launcher (pid {self._parent}) has gone: this rank ends "
                          f"instead of training on alone; {self.kept()}")
            try:
                heartbeat += 1
                self._post(heartbeat)
                found = self._claimed(self._stall_line(stalled)) if stalled is not None else self._judge()
                verdict = self._verdict_posted() or found
                unanswered_since = None
            except (RuntimeError, OSError, dist.DistStoreError) as error:
                unanswered_since = unanswered_since or time.monotonic()
                if time.monotonic() - unanswered_since > self.timeout_s:
                    self._end(f"[rank {self.rank}] the run's store has not answered for "
                              f"{self.timeout_s:.0f} s ({type(error).__name__}): its launcher is gone; "
                              f"{self.kept()}")
                continue
            if verdict:
                self._report(verdict)

    def _stall_line(self, stalled: files.Transfer) -> str:
        return (f"rank {self.rank} (host {socket.gethostname()}, pid {os.getpid()}): its "
                f"{stalled.describe(time.monotonic())}; the store stopped answering (a lost connection, "
                "a stale mount, a saturated link)")

    def _post(self, heartbeat: int) -> None:
        position, times = self.position, self.clock.times
        cpu_s = sum(os.times()[:2])
        self._store.set(f"{self._key}/{self.rank}", json.dumps(
            [heartbeat, position.step, position.phase, position.item, socket.gethostname(), os.getpid(),
             cpu_s, times.steps, times.data_s, times.compute_s]))

    def _judge(self) -> Optional[str]:
        keys = [f"{self._key}/{rank}" for rank in range(self.world_size)]
        if not self._store.check(keys):
            return None  # not every rank has started watching yet
        now, seen = time.monotonic(), self.seen
        for rank, raw in enumerate(self._store.multi_get(keys)):
            heartbeat, step, phase, item, host, pid, cpu_s, *times = json.loads(raw)
            position, before = Position(step, phase, item), seen.get(rank)
            if before is None:
                seen[rank] = Seen(position, heartbeat, host, pid, now, now, StepTimes(*times),
                                  cpu_seen=deque([(now, cpu_s)]))
                continue
            before.times = StepTimes(*times)
            if heartbeat != before.heartbeat:
                if self.on_cpu:  # a GPU rank's host process may idle while its device computes
                    before.note_cpu(now, cpu_s, self.timeout_s)
                before.heartbeat, before.heard_at = heartbeat, now
            if position != before.position:
                before.position, before.moved_at = position, now
        return self._claimed(hang_verdict(seen, now, self.timeout_s))

    def _claimed(self, verdict: Optional[str]) -> Optional[str]:
        """The verdict, if this rank is the first to post one (it then reports); None otherwise."""
        if not verdict:
            return None
        # Claimed with this rank's number: two ranks that see the same sentence at once must not
        # both take compare_set's answer (the value now there) for their own win.
        claim = f"rank {self.rank}: {verdict}"
        if self._store.compare_set(f"{self._key}/verdict", "", claim) == claim.encode():
            return verdict  # this rank saw it first: it reports
        return None

    def _verdict_posted(self) -> Optional[str]:
        """Another rank found the run hung: give it this rank's stacks, then end."""
        if not self._store.check([f"{self._key}/verdict"]):
            return None
        self._store.set(f"{self._key}/stacks/{self.rank}", python_stacks())
        if self._store.check([f"{self._key}/reported"]):
            os._exit(1)  # the reporting rank has said it
        return None

    def _report(self, verdict: str) -> None:
        self._store.set(f"{self._key}/stacks/{self.rank}", python_stacks())
        deadline = time.monotonic() + STACKS_WAIT_S
        keys = [f"{self._key}/stacks/{rank}" for rank in range(self.world_size)]
        while time.monotonic() < deadline and not self._store.check(keys):
            time.sleep(0.2)
        stacks = {rank: self._store.get(key).decode() for rank, key in enumerate(keys)
                  if self._store.check([key])}
        report = f"{self.report_folder.rstrip('/')}/{REPORT}"
        text = f"{verdict}\n\n" + "\n".join(f"== rank {rank} ==\n{stack}" for rank, stack in stacks.items())
        where = write_report(report, text)
        self._store.set(f"{self._key}/reported", "1")
        self._end(f"{verdict}; {self.kept()}{where}")

    def _end(self, line: str) -> None:
        """Say it and end this process now: its training thread may be blocked in a collective."""
        if self.active:
            mark_said()  # the ranks that lose contact with this one keep quiet
        sys.stdout.flush()
        say_line(f"error: {line}")
        os._exit(1)


REPORT_WAIT_S = 5.0
"""How long the report may take to write: its folder may be on the store that stopped answering."""


def write_report(report: str, text: str) -> str:
    """Write the hang report, within REPORT_WAIT_S; what the line says of it."""
    outcome: list[str] = []

    def write() -> None:
        try:
            files.write_atomically(report, lambda f: f.write(text.encode()))
            outcome.append(f"; each rank's position and stacks: {report}")
        except Exception as error:  # the report is a help; the line is the verdict
            outcome.append(f" (no report: {type(error).__name__})")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(REPORT_WAIT_S)
    return outcome[0] if outcome else f" (no report: {report} did not answer)"


def watch_compilation(starts: Callable[..., None], ends: Callable[..., None]) -> None:
    """Have torch.compile call starts and ends around each compilation (torch._dynamo's callbacks; a
    torch without them leaves compilation a phase like any other)."""
    from torch._dynamo.callback import callback_handler  # loaded only for a compiled model

    with contextlib.suppress(AttributeError):
        callback_handler.register_start_callback(starts)
        callback_handler.register_end_callback(ends)


def python_stacks() -> str:
    """Every thread's Python stack in this process, the training thread's first."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sorted(sys._current_frames().items(), key=lambda item: names.get(item[0]) != "MainThread")
    return "\n".join(f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
                     for ident, frame in frames)
