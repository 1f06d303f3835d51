"""Entry for the tests (under torchrun): mingpt/main.py with one rank made slow on demand.

    SLOW_FROM_FILE=/tmp/x SLOW_RANK=1 torchrun ... tests/workers/straggler.py [hydra overrides]

Once the file SLOW_FROM_FILE exists, rank SLOW_RANK (default 1) computes each step twice over: inside
each training forward pass it keeps its CPU busy for half as long as its previous step took, so
that its steps settle at twice their own length, whatever the machine's load makes that length (a
rank with half the others' speed). A CPU hog pinned beside a rank is no such rank on a machine with
other load: the kernel moves the other load off the hog's core, onto the other rank's, and both ranks
end up about as slow (measured: 0.94x at a load of 7 on 2 cores); this is.
"""
import os
import runpy
import time
from pathlib import Path

import mingpt
from mingpt.model import GPT
from mingpt.trainer import Trainer  # the module main.py will import, patched below


def computing_twice_over(trigger: Path) -> None:
    original_forward, original_batch = GPT.forward, Trainer._run_batch
    last_step_s = 0.0

    def run_batch(self, *args, **kwargs):
        nonlocal last_step_s
        started = time.monotonic()
        result = original_batch(self, *args, **kwargs)
        last_step_s = time.monotonic() - started
        return result

    def forward(self, *args, **kwargs):
        if self.training and last_step_s and trigger.exists():
            deadline = time.monotonic() + last_step_s / 2
            while time.monotonic() < deadline:  # the CPU busy, as computing keeps it
                sum(range(1000))
        return original_forward(self, *args, **kwargs)

    GPT.forward, Trainer._run_batch = forward, run_batch


if __name__ == "__main__":
    if os.environ.get("RANK", "0") == os.environ.get("SLOW_RANK", "1"):
        computing_twice_over(Path(os.environ["SLOW_FROM_FILE"]))
    runpy.run_path(str(Path(mingpt.__file__).parent / "main.py"), run_name="__main__")
