"""Entry point for the tests (alone, or under torchrun): mingpt/main.py that also writes the full
model and optimizer state, gathered from every rank, right after each snapshot save and right after
resuming, so that a test can compare what a snapshot restored with what was saved.

    FULL_STATE_DIR=DIR [torchrun ...] tests/workers/full_state_probe.py [hydra overrides]

Rank 0 writes DIR/saved_<step>.pt and DIR/restored_<step>.pt, each {"model": ..., "optimizer": ...}
as parallel.gather_full_state returns them (parameter names, CPU tensors).
"""
import os
import runpy
from pathlib import Path

import torch

import mingpt
from mingpt.distributed.parallel import gather_full_state
from mingpt.trainer import Trainer  # the module main.py will import, patched below

MINGPT = Path(mingpt.__file__).parent  # main.py, run below as `python main.py` would be


def write_full_state(trainer: Trainer, kind: str) -> None:
    model_state, optimizer_state = gather_full_state(trainer.model, trainer.optimizer)  # every rank
    if trainer.env.is_main:
        path = Path(os.environ["FULL_STATE_DIR"]) / f"{kind}_{trainer.progress.step:09d}.pt"
        torch.save({"model": model_state, "optimizer": optimizer_state}, path)


def write_after(method_name: str, kind: str, when=lambda trainer: True) -> None:
    """Wrap Trainer.<method_name> so that the full state is written once it returns."""
    original = getattr(Trainer, method_name)

    def wrapped(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if when(self):
            write_full_state(self, kind)
        return result

    setattr(Trainer, method_name, wrapped)


if __name__ == "__main__":
    write_after("_save_snapshot", "saved")
    write_after("__init__", "restored", when=lambda trainer: trainer.progress.step > 0)  # resumed
    # As a script, so that Hydra finds its config beside main.py.
    runpy.run_path(str(MINGPT / "main.py"), run_name="__main__")
