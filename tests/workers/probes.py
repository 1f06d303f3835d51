"""Run once per suite under torchrun (tests/conftest.py's `probes`): every probe of this folder in
one launch, each into a folder of its own under OUT_DIR, in one process group.

    torchrun --standalone --nproc_per_node=2 tests/workers/probes.py TEXT_FILE OUT_DIR

init_probe.py -> OUT_DIR/init, probe.py (ddp, then fsdp) -> OUT_DIR/steps, grad_sync_probe.py ->
OUT_DIR/grad_sync (last: it patches torch.distributed's functions to count collectives). Each
script also runs alone, as its docstring says.
"""
import sys
from pathlib import Path

import grad_sync_probe
import init_probe
import probe

from mingpt.common.logger import configure_logging
from mingpt.distributed.process_group import distributed_session

METHODS = ["ddp", "fsdp"]
FOLDERS = ("init", "steps", "grad_sync")

if __name__ == "__main__":
    text, out = sys.argv[1], Path(sys.argv[2])
    with distributed_session() as env:
        configure_logging(env.rank)
        for folder in FOLDERS:
            (out / folder).mkdir(exist_ok=True)
        init_probe.record(out / "init", env)  # first: it measures a peak of resident memory
        probe.record(METHODS, text, out / "steps", env)
        grad_sync_probe.record(out / "grad_sync", env)
