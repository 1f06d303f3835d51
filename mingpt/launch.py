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
"""
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from mingpt.common.errors import OneLineArgumentParser, command
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
                        help=f"worker processes (default: one per GPU, or {CPU_WORKERS} without GPUs)")
    args, overrides = parser.parse_known_args(argv)
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be at least 1")
    nproc = worker_count(args.nproc)
    launcher_args = get_args_parser().parse_args(
        ["--standalone", f"--nproc_per_node={nproc}", *stop_options(), str(MAIN), *overrides]
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
