"""Decisions every rank must take at the same step: stop on a signal, snapshot on a timer, stop
because a background snapshot save failed, stop because training diverged.

A cluster stops a job with a signal: SIGTERM at preemption or `scancel`, or one chosen with
`sbatch --signal` before the time limit. It may reach some ranks and not others, at different
moments, yet every rank must stop after the same step and take part in one last snapshot. In the
same way a snapshot every N minutes must be taken at the same step on every rank, though their
clocks differ.

A stop must land inside the grace a cluster gives (Slurm's KillWait, 30 s by default; torchrun's
30 s after it is signalled), wherever it finds the run, not only at a step's end. So:
- while a stop loses nothing (the start-up, before any step; a step begun since the last snapshot
  was written; the first step's compile), the signal's handler stops this process at once
  (StopRequested): there is nothing to save, and every rank of a run meets the same condition;
- during a step, the stop comes at its end, with a snapshot of it (below);
- between steps (each batch of an evaluation or of HellaSwag's scoring, and after each snapshot),
  every rank asks the same small all-reduce whether any rank was signalled (StepAgreement.stop_asked):
  the phase is abandoned at the same batch everywhere, and the run stops with the snapshot of its
  last step. Every rank calls it at the same points whether or not it was signalled, so no rank that
  missed the signal is left waiting.

So after every step each rank posts what it wants (stop: the number of a signal it received; save:
rank 0's timer has run out; save failed: its background snapshot writer ended with an error, which
as a rule only the writing rank sees) to a small all-reduce (max) of host integers on a gloo group
of its own, and every rank reads the same result after the same step: all act at the step in which
the request came, at its end. (It was read one step later, so that no rank waited for it; but a step
of the default model is minutes on a laptop CPU, and Ctrl-C then ran a whole step more. Waiting
costs one small gloo all-reduce per step, which never synchronises a GPU: bench/bench_step_checks.py.)

Every process of a run may receive the signal: Slurm signals every process of a job step, `timeout`
and `kill -- -PGID` a whole process group, torchrun each worker's whole session. DataLoader workers
therefore ignore the stop signals and Ctrl-C (`leave_stops_to_training`, their worker_init_fn) and
the training process stops them itself once it has saved; a worker that dies of anything else is
still reported by the DataLoader as before.

A run that diverges is judged by divergence.py's DivergenceWatch a step late (each step's loss and
gradient norm copied to the host without waiting for the device), and its verdict posted to the
same all-reduce, so every rank stops at the same step, before any snapshot of the ruined weights.

Ctrl-C (SIGINT) is always a stop request: the first stops like SIGTERM, with a snapshot; a second
quits at once (KeyboardInterrupt), leaving the last complete snapshot as it is (writes are atomic),
and says which one that is; once the stop's own snapshot is written, a second changes nothing. Either
way the process exits with status 130.
Python runs a signal's handler only between two of its own instructions, and a step may sit in one
long call of C++ for minutes (a whole backward pass on a laptop CPU, a collective waiting for a
peer): so a thread of its own (CtrlC) sees each Ctrl-C the moment it comes, says the first at once,
and ends the process after the second if the handler has not within QUIT_WAIT_S.
"""
import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Callable, Optional

import torch
import torch.distributed as dist

from mingpt.common import files
from mingpt.common.errors import MinGPTError, check
from mingpt.distributed.process_group import DistEnv, side_group

STOP_EXIT_STATUS = 75
"""Exit status of a run stopped by a signal after saving its snapshot (EX_TEMPFAIL: try again
later); resuming from the snapshot continues it."""
INTERRUPT_EXIT_STATUS = 130
"""Exit status after Ctrl-C (128 + SIGINT, what shells expect of an interrupted command), with or
without a snapshot."""
STOP_RECORD_ENV = "MINGPT_STOP_RECORD"
"""A folder where each rank that stopped cleanly on a signal records its exit status (launch.py
sets it, and exits 75 only when every rank did)."""


def signal_number(name: str) -> int:
    """SIGTERM, TERM or sigterm -> signal.SIGTERM."""
    upper = name.upper()
    return int(getattr(signal.Signals, upper if upper.startswith("SIG") else f"SIG{upper}"))


def check_signal_names(names: list[str], key: str) -> None:
    for name in names:
        try:
            signal_number(name)
        except AttributeError:
            check(False, key, f"unknown signal {name!r}; use names such as SIGTERM or SIGUSR1")


def exit_status_for(number: int) -> int:
    return INTERRUPT_EXIT_STATUS if number == signal.SIGINT else STOP_EXIT_STATUS


class RunStopped(Exception):
    """Raised on every rank, at the same step, once a stop signal's snapshot is written; main.py
    then exits with `exit_status`: 130 after Ctrl-C, STOP_EXIT_STATUS otherwise."""

    def __init__(self, number: int):
        super().__init__(signal.Signals(number).name)
        self.exit_status = exit_status_for(number)


def record_clean_stop(exit_status: int) -> None:
    """Tell the launcher (STOP_RECORD_ENV) that this rank stopped with its snapshot written."""
    folder = os.environ.get(STOP_RECORD_ENV)
    if folder:
        (Path(folder) / f"rank{os.environ.get('RANK', '0')}").write_text(str(exit_status))


def clean_stops(folder: Path) -> dict[int, int]:
    """rank -> exit status, for every rank that recorded a clean stop in folder (a record a killed
    rank left cut short is no clean stop)."""
    stops = {}
    for path in folder.glob("rank*"):
        with contextlib.suppress(ValueError):
            stops[int(path.name[len("rank"):])] = int(path.read_text())
    return stops


def leave_stops_to_training(numbers: tuple[int, ...], worker_id: int) -> None:
    """A DataLoader worker's worker_init_fn: ignore the stop signals and Ctrl-C, which the training
    process handles (it ends its workers itself; their watchdog ends them if it dies)."""
    for number in numbers:
        signal.signal(number, signal.SIG_IGN)


@dataclass(frozen=True)
class Decision:
    """What every rank does after this step."""

    stop_signal: Optional[int] = None
    """The signal that asks the run to stop (a snapshot first), or None to carry on."""
    save: bool = False
    """Take a snapshot now (the timer of save_every_minutes ran out on rank 0)."""
    save_failed: bool = False
    """A background snapshot save failed on some rank: every rank stops, with its error."""
    diverged_since: int = 0
    """The step from which some rank's loss has not been finite (DivergenceWatch); 0: none."""

    @property
    def stop_signal_name(self) -> str:
        return signal.Signals(self.stop_signal).name if self.stop_signal else ""


CTRL_C_LINE = (b"\nCtrl-C: stopping at the end of this step with a snapshot; "
               b"press Ctrl-C again to quit at once without one\n")
CLOSING = 0
"""What CtrlC's thread reads to end (no signal has the number 0)."""
QUIT_WAIT_S = 2.0
"""After a second Ctrl-C, how long the training thread has to quit by itself (KeyboardInterrupt,
which removes a half-written temporary file) before CtrlC ends the process."""


class CtrlC:
    """Each Ctrl-C seen the moment it comes, by a thread reading the byte Python's C-level handler
    writes to the wakeup fd for every signal (the Python-level handler, StopSignals', runs only
    once the training thread is back in Python). The first is said at once (global rank 0); after
    the second, a process still there QUIT_WAIT_S later says so and ends, its temporary files gone."""

    def __init__(self, is_main: bool, quit_line: Callable[[], str], settled: Callable[[], bool]):
        self.is_main = is_main
        self.quit_line = quit_line
        """The line a second Ctrl-C ends the process with (what is left to resume from, as it is then)."""
        self.settled = settled
        """Whether the stop's snapshot is written: a second Ctrl-C then changes nothing."""
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        self._write = write
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._quitting: Optional[threading.Timer] = None
        self._thread = threading.Thread(target=self._watch, name="mingpt-ctrl-c", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        presses = 0
        while True:
            try:
                numbers = os.read(self._read, 64)
            except OSError:
                return
            if not numbers or CLOSING in numbers:  # the run is over
                return
            for number in numbers:
                if number != signal.SIGINT:
                    continue
                presses += 1
                if presses == 1 and self.is_main:
                    os.write(sys.stdout.fileno(), CTRL_C_LINE)
                elif presses == 2 and not self.settled():
                    self._quitting = threading.Timer(QUIT_WAIT_S, self._quit)
                    self._quitting.daemon = True
                    self._quitting.start()

    def _quit(self) -> None:
        files.abandon_transfers()
        if self.is_main:
            os.write(sys.stderr.fileno(), f"{self.quit_line()}\n".encode())
        os._exit(INTERRUPT_EXIT_STATUS)

    def close(self) -> None:
        """The training thread has left training (a second Ctrl-C's KeyboardInterrupt among the ways):
        nothing more to watch, nothing to end."""
        signal.set_wakeup_fd(self._previous_fd)
        self._thread_stopping()

    def _thread_stopping(self) -> None:
        # A byte of its own wakes the thread: DataLoader workers forked meanwhile hold the pipe's
        # writing end too, so closing it here would never read as its end.
        os.write(self._write, bytes([CLOSING]))
        self._thread.join()
        os.close(self._write)
        os.close(self._read)
        if self._quitting is not None:
            self._quitting.cancel()


def handled_signals(stop_signals: list[str]) -> tuple[int, ...]:
    """The signals a training run handles: the configured stop signals, and Ctrl-C."""
    return tuple(dict.fromkeys([*map(signal_number, stop_signals), int(signal.SIGINT)]))


class StopRequested(BaseException):
    """Raised by the signal handler itself, wherever the training thread is, when a stop loses nothing
    (StopSignals.at_once). A BaseException, as KeyboardInterrupt is: no `except Exception` on its way
    may swallow it."""

    def __init__(self, number: int):
        super().__init__(signal.Signals(number).name)
        self.number = number


UNCHANGED = "the last complete snapshot is as it was"


class StopSignals:
    """The process's stop signals and Ctrl-C, from the start of a run to its end: one per process,
    opened by its first user (main.run before the start-up; else the Trainer's StepAgreement) and
    shared by the others (`open`, `close`)."""

    _current: Optional["StopSignals"] = None

    def __init__(self, stop_signals: list[str], is_main: bool):
        self.requested = 0
        """The first stop signal this process received (0: none)."""
        self.at_once: Callable[[], bool] = lambda: True
        """Whether a stop now loses nothing (then the handler raises StopRequested): always, until
        the Trainer says what it has not saved yet."""
        self.kept: Callable[[], str] = lambda: UNCHANGED
        """What a second Ctrl-C leaves to resume from, said as it quits."""
        self.settled = False
        """The stop's snapshot is written: a second Ctrl-C changes nothing."""
        self._users = 0
        self._previous_handlers = {number: signal.signal(number, self._on_signal)
                                   for number in handled_signals(stop_signals)}
        self._ctrl_c = CtrlC(is_main, self.quit_line, lambda: self.settled)

    @classmethod
    def open(cls, stop_signals: list[str], is_main: bool) -> "StopSignals":
        if cls._current is None:
            cls._current = cls(stop_signals, is_main)
        cls._current._users += 1
        return cls._current

    def close(self) -> None:
        """The last user gives the signals back to their previous handlers."""
        self._users -= 1
        if self._users > 0:
            return
        self._ctrl_c.close()
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        StopSignals._current = None

    def _on_signal(self, number: int, frame: Optional[FrameType]) -> None:
        """Note the first stop request, and stop at once when that loses nothing (CtrlC says a
        first Ctrl-C). A second signal, say during the stop's snapshot, changes nothing; a second
        Ctrl-C quits at once, unless the stop's snapshot is written already. A process already ending
        on an error of the run's (a MinGPTError on its way out, seen from here as the exception being
        handled) only notes the signal: torchrun's SIGTERM to the other ranks once one has failed must
        not put a traceback in place of this rank's one line (CI: a torn shard every rank met)."""
        if self.requested:
            if number == signal.SIGINT and not self.settled:
                raise KeyboardInterrupt
            return
        self.requested = number
        if self.at_once() and not isinstance(sys.exc_info()[1], MinGPTError):
            raise StopRequested(number)

    def quit_line(self) -> str:
        return f"Interrupted: quit at once; {self.kept()}"


class StepAgreement:
    """Signals turned into a stop request, and rank 0's snapshot timer, agreed on by every rank."""

    def __init__(self, stop_signals: list[str], save_every_minutes: float, env: DistEnv):
        self.save_interval_s = 60.0 * save_every_minutes
        self.is_main = env.is_main
        self.signals = StopSignals.open(stop_signals, env.is_main)
        self._group = side_group(env)  # never queued behind gradient traffic
        self._last_save = time.monotonic()

    @property
    def requested(self) -> int:
        """The first stop signal this process received (0: none)."""
        return self.signals.requested

    def after_step(self, save_failed: bool = False, diverged_since: int = 0) -> Decision:
        """Every rank calls this after every step, saying whether its background save failed and
        since which step its run has diverged (0: it has not); what all of them want decides."""
        save_due = (self.is_main and self.save_interval_s > 0
                    and time.monotonic() - self._last_save >= self.save_interval_s)
        wishes = torch.tensor([self.requested, int(save_due), int(save_failed), diverged_since],
                              dtype=torch.int64)
        dist.all_reduce(wishes, op=dist.ReduceOp.MAX, group=self._group)
        stop, save, save_failed, diverged_since = wishes.tolist()
        return Decision(stop_signal=stop or None, save=bool(save), save_failed=bool(save_failed),
                        diverged_since=diverged_since)

    def stop_asked(self) -> Decision:
        """Between two steps (each batch of an evaluation, after a snapshot), every rank at the same
        point: whether any rank was asked to stop."""
        wish = torch.tensor([self.requested], dtype=torch.int64)
        dist.all_reduce(wish, op=dist.ReduceOp.MAX, group=self._group)
        return Decision(stop_signal=int(wish) or None)

    def saved(self) -> None:
        """A snapshot was taken (for whatever reason): the timer starts again."""
        self._last_save = time.monotonic()

    def __enter__(self) -> "StepAgreement":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self, failed: bool = False) -> None:
        """Give the signals back (unless main.run holds them). A run that fails leaves its group to the
        process's end: torn down now, it would reset the other ranks' connections while they wait in
        its all-reduce, and they would say they lost contact before this rank has said why."""
        self.signals.close()
        if not failed:
            dist.destroy_process_group(self._group)
