"""Start training on this machine: one worker per GPU, or --nproc CPU workers without GPUs.

    python launch.py [--nproc N] [hydra overrides ...]

It is `torchrun --standalone --nproc_per_node=N main.py ...` through torch's own elastic launcher,
so workers get the usual RANK/LOCAL_RANK/WORLD_SIZE environment, a free rendezvous port is chosen
automatically, and a failed worker stops the others.

SIGTERM or SIGUSR1 to this process (or to every process of the run, as Slurm sends it) reaches
every worker, which saves a snapshot and stops (see trainer_config.stop_signals); Ctrl-C does the
same, and a second Ctrl-C quits at once. This launcher exits as main.py does, 75 (130 after Ctrl-C),
only when every worker says it stopped with its snapshot written; otherwise it says that no
snapshot was written at the stop and exits with status 1.

    python launch.py --replica-groups N [--nproc N] [--min-replica-groups M] [hydra overrides ...]

A fault-tolerant run on this machine (fault_tolerance_config.enabled; docs/distributed.md): the config
checked once, torchft's lighthouse on 127.0.0.1 (its address and command printed first), then one
launcher as above per replica group, each starting its workers again after a failure (--max-restarts)
so that a lost group comes back and heals from the others. One group speaks for the run (the lowest
live one), each line prefixed with its number; a line each group says (a warning, an error) is shown
once. A stop signal reaches every group, each stopping as above; this launcher then exits with their
status. The lighthouse is part of the run: when it ends, this launcher says so and stops every group
with its snapshot (exit 1); start the run again to resume.

Workers are started again (--max-restarts) after a crash, not after an error every failed worker said
in its one line (a user's: a restart would say it again), nor after a clean stop, nor, for a replica
group, once the lighthouse is gone.
"""
import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Iterator, Optional

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from mingpt.common.errors import USER_ERROR_RECORD_ENV, MinGPTError, OneLineArgumentParser, command
from mingpt.distributed.control import INTERRUPT_EXIT_STATUS as INTERRUPTED_STATUS
from mingpt.distributed.control import STOP_EXIT_STATUS as STOP_STATUS
from mingpt.distributed.control import STOP_RECORD_ENV, clean_stops
from mingpt.distributed.fault_tolerance import RESTART_ENV, reachable

MAIN = Path(__file__).resolve().with_name("main.py")
CPU_WORKERS = 2
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
STOP_GRACE_S = 110
"""How long the workers get to save their snapshot after a stop signal before they are killed."""


def worker_count(requested: Optional[int]) -> int:
    if requested is not None:
        return requested
    return torch.cuda.device_count() or CPU_WORKERS


def stop_options() -> list[str]:
    """Forward SIGUSR1 too (Slurm's usual warning) and give workers time to save; older torch's
    launcher lacks these options."""
    known = get_args_parser().format_help()
    options = []
    if "--signals-to-handle" in known:
        options.append(f"--signals-to-handle={FORWARDED_SIGNALS}")
    if "--shutdown-timeout" in known:
        options.append(f"--shutdown-timeout={STOP_GRACE_S}")
    return options


@command
def main(argv: Optional[list[str]] = None) -> int:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Other arguments are passed to main.py as Hydra overrides.")
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help=f"worker processes (default: one per GPU, or {CPU_WORKERS} without GPUs); "
                        "with --replica-groups, per group (default: its share of the GPUs, or 1)")
    parser.add_argument("--replica-groups", type=int, default=None, metavar="N",
                        help="a fault-tolerant run of N replica groups (torchft): a lighthouse and one torchrun each")
    parser.add_argument("--min-replica-groups", type=int, default=1, metavar="M",
                        help="with --replica-groups: train only while M or more groups are live (default 1)")
    parser.add_argument("--max-restarts", type=int, default=None, metavar="R",
                        help="times failed workers are started again (default 0; with --replica-groups, "
                        f"each group's, default {GROUP_RESTARTS}); never after an error they said")
    # What --replica-groups tells each group's launcher: its number, and the lighthouse it needs.
    parser.add_argument("--replica-group", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be at least 1")
    if args.replica_groups is not None:
        if not 1 <= args.min_replica_groups <= args.replica_groups:
            parser.error("--replica-groups must be at least 1, and --min-replica-groups 1 to --replica-groups")
        restarts = GROUP_RESTARTS if args.max_restarts is None else args.max_restarts
        return run_replica_groups(args.replica_groups, args.min_replica_groups, restarts, args.nproc, overrides)
    group = None if args.replica_group is None else GroupOfRun(args.replica_group, args.lighthouse)
    return launch_workers(worker_count(args.nproc), args.max_restarts or 0, overrides, group)


class GroupOfRun:
    """This launcher as one replica group of launch.py --replica-groups: it speaks through the run's
    launcher (which prefixes its lines and says the run's end), and is started again only while the
    lighthouse answers."""

    def __init__(self, number: int, lighthouse: str):
        self.number, self.lighthouse = number, lighthouse


def launch_workers(nproc: int, max_restarts: int, overrides: list[str], group: Optional[GroupOfRun] = None) -> int:
    """torch's elastic launcher (torchrun --standalone), started again after a failure up to
    max_restarts times; the exit status as main.py's, or 1 when the workers failed."""
    launcher_args = get_args_parser().parse_args(
        ["--standalone", f"--nproc_per_node={nproc}", "--max-restarts=0", *stop_options(), str(MAIN), *overrides]
    )
    if group is not None:
        quiet_torch_launcher()
    for restart in range(max_restarts + 1):
        with tempfile.TemporaryDirectory(prefix="mingpt-run-") as record, told_to_workers(Path(record), restart):
            stops, said = Path(record, "stops"), Path(record, "errors")
            try:
                run(launcher_args)
                return 0
            except SignalException as stop:
                return stopped(stop.sigval.name, clean_stops(stops), nproc, group)
            except ChildFailedError as failure:
                if clean_stops(stops):  # a signal that reached the workers but not this launcher
                    return stopped("a signal", clean_stops(stops), nproc, group)
                crashed = crashes(failure.failures, said_errors(said))
                if not crashed:  # a user's error, said in one line: a restart would say it again
                    return 1
                why_not = restart_refused(restart, max_restarts, group)
                if why_not is not None:
                    print(f"error: {failed_ranks(crashed, group)}{why_not}; see the output above", file=sys.stderr)
                    return 1
                again = "the group again" if group else "the workers again"
                heals = "; it heals from a live replica group" if group else ""
                print(f"{'' if group else 'launch.py: '}{failed_ranks(crashed, group)}: starting {again} "
                      f"({restart + 1} of {max_restarts}){heals}", file=sys.stderr, flush=True)
    raise AssertionError("unreachable: the last attempt returns")


@contextlib.contextmanager
def told_to_workers(record: Path, restart: int) -> Iterator[None]:
    """What the workers read in their environment (they inherit this process's): where they record a
    clean stop and a user's error, and how many times they were started again."""
    for folder in ("stops", "errors"):
        (record / folder).mkdir()
    told = {STOP_RECORD_ENV: str(record / "stops"), USER_ERROR_RECORD_ENV: str(record / "errors"),
            RESTART_ENV: str(restart)}
    os.environ.update(told)
    try:
        yield
    finally:
        for name in told:
            del os.environ[name]


def said_errors(folder: Path) -> set[int]:
    """The ranks that ended on an error they said (errors.record_user_error: a file rank<N> each)."""
    return {int(path.name[len("rank"):]) for path in folder.glob("rank*") if path.name[len("rank"):].isdigit()}


def crashes(failures: dict, said: set[int]) -> dict:
    """The failed ranks that crashed: not those that said a user's error, nor, once one has, those torch's
    launcher ended with SIGTERM because it had (a rank waiting for local rank 0 to say a mistake they
    share is stopped before it can say that it was said)."""
    return {rank: failure for rank, failure in failures.items()
            if rank not in said and not (said and failure.exitcode == -signal.SIGTERM)}


def restart_refused(restart: int, max_restarts: int, group: Optional[GroupOfRun]) -> Optional[str]:
    """Why the workers are not started again, said after what failed (None: they are)."""
    if group is not None and not reachable(group.lighthouse):
        return f", and is not started again: the lighthouse at {group.lighthouse} does not answer"
    if restart < max_restarts:
        return None
    return f" after {max_restarts} restart(s)" if max_restarts else ""


def failed_ranks(failures: dict, group: Optional[GroupOfRun]) -> str:
    """"training failed on rank 1 (killed by SIGKILL)"; of a replica group (its lines prefixed with its
    number by the run's launcher), "lost rank 0 (...)"."""
    ranks = ", ".join(f"rank {rank} ({how_it_ended(failure.exitcode)})" for rank, failure in sorted(failures.items()))
    return f"lost {ranks}" if group else f"training failed on {ranks}"


def how_it_ended(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
    return f"exit status {status}"


def quiet_torch_launcher() -> None:
    """Under --replica-groups, torch's elastic launcher's own log lines (a failed worker in a line of
    its own, each restart) repeat what this launcher says in one line of the run's."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""A group's workers restarted by torchrun often fail to connect ("Gloo connectFullMesh failed") when
they share its rendezvous's TCP store (pytorch issues 135712, 167288); with a store of their own they
restart cleanly (slurm/sbatch_run.sh sets the same)."""
GROUP_RESTARTS = 3
"""How many times a replica group's torchrun restarts its workers by default: a group that fails comes
back and heals from the others."""
LIGHTHOUSE_WAIT_S = 120
"""How long the lighthouse gets to start answering (it imports torch first: seconds on a laptop)."""


def run_replica_groups(groups: int, min_groups: int, max_restarts: int, nproc: Optional[int],
                       overrides: list[str]) -> int:
    """The config checked, the lighthouse, then this launcher once per replica group (its own torchrun,
    its own record of clean stops); waits for them all, passing stop signals on and watching the
    lighthouse, then stops it."""
    check_config(groups, min_groups, overrides)
    devices = group_devices(groups)
    nproc = nproc or (len(devices[0]) if devices else 1)
    address, lighthouse = start_lighthouse(min_groups)
    ft = ["fault_tolerance_config.enabled=true", f"fault_tolerance_config.lighthouse={address}",
          f"fault_tolerance_config.replica_groups={groups}", f"fault_tolerance_config.min_replica_groups={min_groups}"]
    replicas, chorus = [], Chorus()
    try:
        for group in range(groups):
            # The user's arguments first: Hydra takes its options (--config-name) only before the overrides.
            launcher = [sys.executable, __file__, f"--nproc={nproc}", f"--max-restarts={max_restarts}",
                        f"--replica-group={group}", f"--lighthouse={address}", *overrides, *ft,
                        f"fault_tolerance_config.replica_group={group}"]
            visible = {"CUDA_VISIBLE_DEVICES": ",".join(devices[group])} if devices else {}
            # A session of its own: a Ctrl-C at the terminal reaches the group once, passed on from here
            # (a second would quit it without a snapshot).
            replicas.append(subprocess.Popen(launcher, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             env={**RESTARTABLE, **os.environ, "PYTHONUNBUFFERED": "1", **visible},
                                             start_new_session=True))
            chorus.follow(replicas[-1], group)
        ending = wait_for_groups(replicas, lighthouse)
    finally:
        for process in [*replicas, lighthouse]:
            if process.poll() is None:
                process.terminate()
                process.wait()
    chorus.finish()  # every line said before the run's last
    return replica_groups_status([process.returncode for process in replicas], ending, chorus.errors_said)


def check_config(groups: int, min_groups: int, overrides: list[str]) -> None:
    """A mistake in the config said once, here, before anything starts (each group would say it, and
    none could train). Hydra's other options (--cfg, -m, ...) are left to the groups' main.py."""
    from mingpt.run_config import DEFAULT_CONFIG, from_command_line

    config_name, keys, items = DEFAULT_CONFIG, [], iter(overrides)
    for item in items:
        if item in ("--config-name", "-cn"):
            config_name = next(items, "")
        elif item.startswith("--config-name="):
            config_name = item.split("=", 1)[1]
        elif item.startswith("-"):
            return
        else:
            keys.append(item)
    from_command_line([*keys, "fault_tolerance_config.enabled=true", f"fault_tolerance_config.replica_groups={groups}",
                       f"fault_tolerance_config.min_replica_groups={min_groups}"], "launch.py", config_name)


def group_devices(groups: int) -> list[list[str]]:
    """On a machine with GPUs, each group's own share of them (two groups never share a GPU); none
    without GPUs (each group then runs --nproc CPU ranks, 1 by default)."""
    gpus = torch.cuda.device_count()
    if not gpus:
        return []
    if gpus < groups:
        raise MinGPTError(f"--replica-groups {groups} on a machine of {gpus} GPU(s): each group needs a GPU of its own")
    share = gpus // groups
    return [[str(share * group + index) for index in range(share)] for group in range(groups)]


def start_lighthouse(min_groups: int) -> tuple[str, subprocess.Popen]:
    """torchft's lighthouse on a free loopback port, a process of its own (ps shows it; restart it
    with the command printed), answering before any group starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(Path(sys.executable).with_name("torchft_lighthouse")), "--bind", f"127.0.0.1:{port}",
               "--min_replicas", str(min_groups)]
    if not Path(command[0]).exists():
        raise MinGPTError("--replica-groups needs torchft, which is not installed: pip install -e '.[ft]' (torchft)")
    lighthouse = subprocess.Popen(command, env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
                                  start_new_session=True)  # a Ctrl-C must not end it while the groups save
    address = f"http://127.0.0.1:{port}"
    print(f"Lighthouse: {address} (pid {lighthouse.pid}); if it dies, start it again with: "
          f"{' '.join(command)}, then restart the replica groups", flush=True)
    deadline = time.monotonic() + LIGHTHOUSE_WAIT_S
    while lighthouse.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return address, lighthouse
        except OSError:
            time.sleep(0.2)
    lighthouse.kill()
    raise MinGPTError(f"the lighthouse ({' '.join(command)}) did not start answering within {LIGHTHOUSE_WAIT_S} s")


class Chorus:
    """The replica groups' lines on this launcher's stdout and stderr (a thread per stream), each
    prefixed with its group. A line said already is not said again when another group says it (the same
    warning or error, said by each), nor when its own group says it again once started again (its
    start-up's first lines, said before it knows it heals)."""

    KEPT = 10_000
    """Lines remembered (a long run forgets the oldest)."""
    STARTED_AGAIN = b": starting the group again ("
    """What a group's launcher says when it starts the group again (launch_workers)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._said: dict[bytes, tuple[int, int]] = {}
        """Each line said: by which group, in which of its starts."""
        self._starts: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        self.errors_said: set[int] = set()
        """The groups that said an error line (their own failure said)."""

    def follow(self, process: subprocess.Popen, group: int) -> None:
        for source, sink in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
            thread = threading.Thread(target=self._copy, args=(source, sink, group), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _copy(self, source: IO[bytes], sink: IO[str], group: int) -> None:
        prefix = f"[replica {group}] ".encode()
        for line in iter(source.readline, b""):
            line = line if line.endswith(b"\n") else line + b"\n"  # a last line cut short, or its group's next would join it
            with self._lock:
                if line.startswith(b"error:"):
                    self.errors_said.add(group)
                if self._repeated(line, group):
                    continue
                sink.buffer.write(prefix + line)
                sink.flush()
                if self.STARTED_AGAIN in line:
                    self._starts[group] = self._starts.get(group, 0) + 1

    def _repeated(self, line: bytes, group: int) -> bool:
        speaker = (group, self._starts.get(group, 0))
        if self._said.get(line, speaker) != speaker:
            return True
        self._said.pop(line, None)  # the newest last
        self._said[line] = speaker
        if len(self._said) > self.KEPT:
            for old in list(self._said)[:self.KEPT // 2]:
                del self._said[old]
        return False

    def finish(self, timeout_s: float = 10.0) -> None:
        """The groups have ended: their last lines said (their pipes closed)."""
        for thread in self._threads:
            thread.join(timeout_s)


WATCH_S = 0.2
"""How often the launcher of replica groups looks at the lighthouse."""


def wait_for_groups(processes: list[subprocess.Popen], lighthouse: subprocess.Popen) -> str:
    """Wait for every group, passing on the stop signals this launcher gets, and watching the
    lighthouse: when it ends (no quorum forms without it), say so and stop every group with its
    snapshot. What ended the run: "", the name of the stop signal passed on, or "lighthouse"."""
    ending = ""

    def forward(number: int, frame) -> None:
        nonlocal ending
        ending = ending or signal.Signals(number).name
        for process in processes:
            if process.poll() is None:
                process.send_signal(number)

    names = [name for name in FORWARDED_SIGNALS.split(",") if name != "SIGQUIT"]
    previous = {name: signal.signal(getattr(signal, name), forward) for name in names}
    try:
        while any(process.poll() is None for process in processes):
            if ending != "lighthouse" and lighthouse.poll() is not None:
                ending = "lighthouse"
                print(f"error: the lighthouse (pid {lighthouse.pid}) ended ({how_it_ended(lighthouse.returncode)}); "
                      "no quorum forms without it, so every replica group stops now with a snapshot; start the "
                      "run again (the same command) to resume from it", file=sys.stderr, flush=True)
                for process in processes:
                    if process.poll() is None:
                        process.send_signal(signal.SIGTERM)
            time.sleep(WATCH_S)
        return ending
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)


def replica_groups_status(statuses: list[int], ending: str = "", errors_said: frozenset = frozenset()) -> int:
    """The run's exit status from its groups' (each this launcher's): 0 when a group finished the run;
    1 when the lighthouse ended it (said then); a stop's (75, or 130 after Ctrl-C) when groups stopped
    on a signal with the run's snapshot written; else 1. A group that failed is named, with its exit
    status unless it said its own error."""
    stops = [status for status in statuses if status in (STOP_STATUS, INTERRUPTED_STATUS)]
    failed = [group for group, status in enumerate(statuses) if status not in (0, STOP_STATUS, INTERRUPTED_STATUS)]
    named = ", ".join(f"replica group {group}" + ("" if group in errors_said else f" (exit {statuses[group]})")
                      for group in failed)
    if 0 in statuses:
        if failed:
            print(f"launch.py: {named} failed; the others finished the run", file=sys.stderr)
        return 0
    if ending == "lighthouse":
        return 1
    if not stops:
        if not set(failed) <= set(errors_said):
            print(f"error: every replica group failed ({named}); see the output above", file=sys.stderr)
        return 1
    stopped_groups = f"{named} failed, the others stopped" if failed else "every replica group stopped"
    print(f"launch.py: stopped on {ending or 'a signal'}; {stopped_groups} with the snapshot written", file=sys.stderr)
    return max(stops)


def stopped(reason: str, stops: dict[int, int], nproc: int, group: Optional[GroupOfRun] = None) -> int:
    """The exit status of a run stopped by a signal: the workers' own (75, or 130 after Ctrl-C)
    when every one stopped with its snapshot written, 1 otherwise. A replica group leaves the clean
    stop to the run's launcher to say, once for every group."""
    missing = [f"rank {rank}" for rank in range(nproc) if rank not in stops]
    if missing:
        print(f"error: stopped on {reason}, but {', '.join(missing)} did not stop cleanly: no snapshot "
              "was written at the stop (the last complete one is kept); see the output above",
              file=sys.stderr)
        return 1
    if group is None:
        print(f"launch.py: stopped on {reason}; every worker saved its snapshot first", file=sys.stderr)
    return max(stops.values())


if __name__ == "__main__":
    sys.exit(main())
