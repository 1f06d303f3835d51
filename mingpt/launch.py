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

A fault-tolerant run on this machine (trainer_config.fault_tolerant; docs/distributed.md): torchft's
lighthouse on 127.0.0.1 (its address and command printed first), then one launcher as above per
replica group, each restarting its workers after a failure (--max-restarts) so that a lost group
comes back and heals from the others. Each group's lines are prefixed with its number. A stop signal
reaches every group, each stopping as above; this launcher then exits with their status.
"""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Optional

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from mingpt.common.errors import MinGPTError, OneLineArgumentParser, command
from mingpt.distributed.control import INTERRUPT_EXIT_STATUS as INTERRUPTED_STATUS
from mingpt.distributed.control import STOP_EXIT_STATUS as STOP_STATUS
from mingpt.distributed.control import STOP_RECORD_ENV, clean_stops

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
                        help="times torchrun restarts failed workers (default 0; with --replica-groups, "
                        f"each group's, default {GROUP_RESTARTS})")
    args, overrides = parser.parse_known_args(argv)
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be at least 1")
    if args.replica_groups is not None:
        if not 1 <= args.min_replica_groups <= args.replica_groups:
            parser.error("--replica-groups must be at least 1, and --min-replica-groups 1 to --replica-groups")
        restarts = GROUP_RESTARTS if args.max_restarts is None else args.max_restarts
        return run_replica_groups(args.replica_groups, args.min_replica_groups, restarts, args.nproc, overrides)
    nproc = worker_count(args.nproc)
    launcher_args = get_args_parser().parse_args(
        ["--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={args.max_restarts or 0}", *stop_options(),
         str(MAIN), *overrides]
    )
    with tempfile.TemporaryDirectory(prefix="mingpt-stops-") as record:
        os.environ[STOP_RECORD_ENV] = record  # the workers inherit it
        try:
            run(launcher_args)
        except SignalException as stop:
            return stopped(stop.sigval.name, clean_stops(Path(record)), nproc)
        except ChildFailedError as failure:
            stops = clean_stops(Path(record))
            if stops:  # a signal that reached the workers but not this launcher
                return stopped("a signal", stops, nproc)
            failed = ", ".join(f"rank {rank}" for rank in sorted(failure.failures))
            print(f"error: training failed on {failed}; see the output above", file=sys.stderr)
            return 1
        finally:
            del os.environ[STOP_RECORD_ENV]
    return 0


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
    """The lighthouse, then this launcher once per replica group (its own torchrun, its own record of
    clean stops); waits for them all, passing stop signals on, then stops the lighthouse."""
    devices = group_devices(groups)
    nproc = nproc or (len(devices[0]) if devices else 1)
    address, lighthouse = start_lighthouse(min_groups)
    ft = ["trainer_config.fault_tolerant=true", f"trainer_config.ft_lighthouse={address}",
          f"trainer_config.ft_replica_groups={groups}", f"trainer_config.ft_min_replica_groups={min_groups}"]
    replicas = []
    try:
        for group in range(groups):
            # The user's arguments first: Hydra takes its options (--config-name) only before the overrides.
            launcher = [sys.executable, __file__, f"--nproc={nproc}", f"--max-restarts={max_restarts}", *overrides,
                        *ft, f"trainer_config.ft_replica_group={group}"]
            visible = {"CUDA_VISIBLE_DEVICES": ",".join(devices[group])} if devices else {}
            # A session of its own: a Ctrl-C at the terminal reaches the group once, passed on from here
            # (a second would quit it without a snapshot).
            replicas.append(subprocess.Popen(launcher, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             env={**RESTARTABLE, **os.environ, "PYTHONUNBUFFERED": "1", **visible},
                                             start_new_session=True))
            prefix_lines(replicas[-1], f"[replica {group}] ")
        statuses = wait_forwarding_stops(replicas)
    finally:
        for process in [*replicas, lighthouse]:
            if process.poll() is None:
                process.terminate()
                process.wait()
    return replica_groups_status(statuses)


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


def prefix_lines(process: subprocess.Popen, prefix: str) -> None:
    """Each line of the process's stdout and stderr, prefixed, on ours (a thread each)."""
    for source, sink in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
        threading.Thread(target=copy_lines, args=(source, sink, prefix.encode()), daemon=True).start()


def copy_lines(source: IO[bytes], sink: IO[str], prefix: bytes) -> None:
    for line in iter(source.readline, b""):
        sink.buffer.write(prefix + line)
        sink.flush()


def wait_forwarding_stops(processes: list[subprocess.Popen]) -> list[int]:
    """Wait for every process, passing the stop signals this launcher gets on to each."""
    def forward(number: int, frame) -> None:
        for process in processes:
            if process.poll() is None:
                process.send_signal(number)

    names = [name for name in FORWARDED_SIGNALS.split(",") if name != "SIGQUIT"]
    previous = {name: signal.signal(getattr(signal, name), forward) for name in names}
    try:
        return [process.wait() for process in processes]
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)


def replica_groups_status(statuses: list[int]) -> int:
    """The run's exit status from its groups' (each this launcher's): 0 when a group finished the run;
    else a stop's (75, or 130 after Ctrl-C) when a group stopped on a signal with the run's snapshot
    written; else 1. Groups that failed are named."""
    stops = [status for status in statuses if status in (STOP_STATUS, INTERRUPTED_STATUS)]
    failed = [f"replica group {group} (exit {status})" for group, status in enumerate(statuses)
              if status not in (0, STOP_STATUS, INTERRUPTED_STATUS)]
    if 0 not in statuses and not stops:
        print(f"error: every replica group failed ({', '.join(failed)}); see the output above", file=sys.stderr)
        return 1
    if failed:
        went_on = "finished the run" if 0 in statuses else "stopped with a snapshot"
        print(f"launch.py: {', '.join(failed)} failed after its restarts; the others {went_on}", file=sys.stderr)
    return 0 if 0 in statuses else max(stops)


def stopped(reason: str, stops: dict[int, int], nproc: int) -> int:
    """The exit status of a run stopped by a signal: the workers' own (75, or 130 after Ctrl-C)
    when every one stopped with its snapshot written, 1 otherwise."""
    missing = [f"rank {rank}" for rank in range(nproc) if rank not in stops]
    if missing:
        print(f"error: stopped on {reason}, but {', '.join(missing)} did not stop cleanly: no snapshot "
              "was written at the stop (the last complete one is kept); see the output above",
              file=sys.stderr)
        return 1
    print(f"launch.py: stopped on {reason}; every worker saved its snapshot first", file=sys.stderr)
    return max(stops.values())


if __name__ == "__main__":
    sys.exit(main())
