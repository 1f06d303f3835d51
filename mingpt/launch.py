"""Start training on this machine: one worker per GPU, or --nproc CPU workers without GPUs.

    python launch.py [--nproc N] [hydra overrides ...]

It is `torchrun --standalone --nproc_per_node=N main.py ...` through torch's own elastic launcher,
so workers get the usual RANK/LOCAL_RANK/WORLD_SIZE environment, a free rendezvous port is chosen
automatically, and a failed worker stops the others.

SIGTERM or SIGUSR1 to this process reaches every worker, which saves a snapshot and stops (see
trainer_config.stop_signals); it then exits with status 75, as main.py does.
"""
import argparse
import sys
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from control import STOP_EXIT_STATUS

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


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
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
    try:
        run(launcher_args)
    except SignalException as stop:
        print(f"launch.py: stopped on {stop.sigval.name}; the workers saved what they had", file=sys.stderr)
        return STOP_EXIT_STATUS
    except ChildFailedError as failure:
        failed = ", ".join(f"rank {rank}" for rank in sorted(failure.failures))
        print(f"error: training failed on {failed}; see the output above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
