"""Entry for the tests (under torchrun or alone): mingpt/main.py with a SIGKILL planted at one
point of training, and the samples each rank trains on recorded.

    FAULT=step:37 FAULT_RANK=1 torchrun ... tests/workers/fault_injection.py [hydra overrides]
    RECORD_SAMPLES=DIR python tests/workers/fault_injection.py [hydra overrides]
    SLOW=data:0.04:30 SLOW_RANK=1 torchrun ... tests/workers/fault_injection.py [hydra overrides]

FAULT is `step:N` (after optimizer step N), `eval:E` (as the eval pass of epoch E starts) or
`snapshot_write:N` (half-way through writing the snapshot of step N: give FAULT_RANK=0, the
writer). The kill happens on FAULT_RANK (default 1), in torchrun's first attempt only, so that the
restarted workers can finish. Comma-separated lists (FAULT=snapshot_write:40,eval:1 FAULT_RANK=0,1)
plant one fault per attempt: the first in the first attempt, the second in the restarted one.
`error:N` raises a user-facing error (say, a snapshot store that refused one rank) after step N
instead of killing. `slow_config:S`: reading the config takes S seconds longer (say, a rank slower
to start). `slow_write:N` makes every snapshot write from step N on trickle for SLOW_WRITE_S
seconds (a save that can be interrupted), `slow_write_at:N` only that of step N (a long save that
moves, as to a slow S3); SLOW_WRITE_S in the environment sets its length (default 30 s).

SLOW is `PHASE:SECONDS:STEP`: from optimizer step STEP on, rank SLOW_RANK (default 1; `all`: every
rank) sleeps SECONDS in each step's data loading (PHASE data: as its sampler hands out the batch) or
computation (PHASE compute: in each forward pass), or keeps its CPU busy that long (PHASE spin: a
long computation), in every attempt: a straggler. PHASE eval sleeps SECONDS in each forward pass of
an evaluation or of HellaSwag's scoring (STEP unused): a long evaluation.

RECORD_SAMPLES: each training batch a rank draws is appended to DIR/samples-rank<R>-<pid>.txt as
`epoch index index ...` (split indices; run with data_loader_workers=0, so that nothing is drawn
ahead of training).
"""
import os
import runpy
import signal
from pathlib import Path
from typing import Optional

import mingpt
from mingpt.common.errors import MinGPTError
from mingpt.tokens.data_loader import GlobalOrderSampler
from mingpt.trainer import Trainer  # the module main.py will import, patched below

MINGPT = Path(mingpt.__file__).parent  # main.py, run below as `python main.py` would be

INJECTED_ERROR = "injected: this rank's storage refused a write"


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def fail() -> None:
    raise MinGPTError(INJECTED_ERROR)


def kill_after(method_name: str, should_die, die=die) -> None:
    """Wrap Trainer.<method_name> so that the process dies once should_die(trainer, args) holds
    (_run_batch returns before the step is counted in trainer.progress)."""
    original = getattr(Trainer, method_name)

    def wrapped(self, *args, **kwargs):
        if method_name == "evaluate" and should_die(self, args):
            die()
        result = original(self, *args, **kwargs)
        if should_die(self, args):
            die()
        return result

    setattr(Trainer, method_name, wrapped)


def die_while_writing(step: int) -> None:
    """The writer dies half-way through the real write of the step's snapshot (inside
    snapshot.write_snapshot, whose torch.save call is the one cut short)."""
    import torch

    original_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == step and "model_state" in obj:
            f.write(b"PK" + bytes(1 << 16))
            f.flush()
            die()
        return original_save(obj, f, *args, **kwargs)

    torch.save = save


SLOW_WRITE_S = float(os.environ.get("SLOW_WRITE_S", 30))


def pause_while_writing(first_step: int, only: bool = False) -> None:
    """Snapshots of first_step (and later ones, unless only) pause half-way through their real write."""

    import torch

    original_save = torch.save

    def save(obj, f, *args, **kwargs):
        step = obj.get("step", -1) if isinstance(obj, dict) and "model_state" in obj else -1
        if step == first_step if only else step >= first_step:
            trickle(f, SLOW_WRITE_S)
        return original_save(obj, f, *args, **kwargs)

    torch.save = save


def trickle(f, seconds: float) -> None:
    """A slow store: a little written every tenth of a second, for seconds (the write moves all along)."""
    import time

    deadline = time.monotonic() + seconds
    f.write(b"PK")
    while time.monotonic() < deadline:
        f.write(bytes(1 << 12))
        time.sleep(0.1)


def slow_config(seconds: int) -> None:
    """Turning the composed config into dataclasses (main.load_config) takes seconds longer."""
    import time

    from omegaconf import OmegaConf

    original = OmegaConf.to_object

    def to_object(cfg):
        OmegaConf.to_object = original  # once: it may call itself for the groups inside
        time.sleep(seconds)
        return original(cfg)

    OmegaConf.to_object = to_object


def plant(fault: str) -> None:
    kind, value = fault.split(":")
    number = int(value)
    if kind == "step":
        kill_after("_run_batch", lambda trainer, args: trainer.progress.step + 1 == number)
    elif kind == "eval":
        kill_after("evaluate", lambda trainer, args: args[0] == number)
    elif kind == "snapshot_write":
        die_while_writing(number)
    elif kind == "slow_write":
        pause_while_writing(number)
    elif kind == "slow_write_at":
        pause_while_writing(number, only=True)
    elif kind == "slow_config":
        slow_config(number)
    elif kind == "error":
        kill_after("_run_batch", lambda trainer, args: trainer.progress.step + 1 == number, die=fail)
    else:
        raise ValueError(f"unknown FAULT {fault!r}")


def record_samples(folder: str) -> None:
    """Append every training batch the sampler hands out to this process's file in folder."""
    original = GlobalOrderSampler.__iter__
    path = Path(folder) / f"samples-rank{os.environ.get('RANK', '0')}-{os.getpid()}.txt"

    def recorded(self):
        for batch in original(self):
            if self.shuffle:  # the training sampler; evaluation keeps the split's order
                with open(path, "a") as f:
                    f.write(" ".join(map(str, [self.epoch, *batch.tolist()])) + "\n")
            yield batch

    GlobalOrderSampler.__iter__ = recorded


def slow_down(phase: str, seconds: float, first_step: int) -> None:
    """Every step from first_step on takes seconds longer in phase (see SLOW)."""
    import time

    if phase == "eval":
        from mingpt.model import GPT

        original_forward = GPT.forward

        def evaluating(self, *args, **kwargs):
            if not self.training:
                time.sleep(seconds)
            return original_forward(self, *args, **kwargs)

        GPT.forward = evaluating
        return
    if phase in ("compute", "spin"):
        from mingpt.model import GPT

        original, original_batch = GPT.forward, Trainer._run_batch
        taking = 0  # the step the Trainer is taking (its forward passes, not the planner's traced one)

        def run_batch(self, *args):
            nonlocal taking
            taking = self.progress.step + 1
            return original_batch(self, *args)

        def forward(self, *args, **kwargs):  # inside the forward pass, where computation is timed
            if self.training and taking >= first_step:
                if phase == "compute":
                    time.sleep(seconds)
                deadline = time.monotonic() + seconds
                while phase == "spin" and time.monotonic() < deadline:  # the CPU busy, as computing keeps it
                    sum(range(10_000))
            return original(self, *args, **kwargs)

        GPT.forward, Trainer._run_batch = forward, run_batch
        return
    assert phase == "data", f"unknown SLOW phase {phase!r}"
    original_iter = GlobalOrderSampler.__iter__
    handed_out = 0  # training batches, so steps (one batch per step; data_loader_workers=0)

    def slow_iter(self):
        nonlocal handed_out
        for batch in original_iter(self):
            if self.shuffle:
                handed_out += 1
                if handed_out >= first_step:
                    time.sleep(seconds)
            yield batch

    GlobalOrderSampler.__iter__ = slow_iter


def fault_of_this_attempt() -> Optional[str]:
    """FAULT's entry for this torchrun attempt, if it is meant for this rank (FAULT_RANK's entry)."""
    faults = os.environ["FAULT"].split(",") if "FAULT" in os.environ else []
    ranks = os.environ.get("FAULT_RANK", ",".join(["1"] * len(faults))).split(",")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt < len(faults) and os.environ.get("RANK", "0") == ranks[attempt]:
        return faults[attempt]
    return None


if __name__ == "__main__":
    fault = fault_of_this_attempt()
    if fault:
        plant(fault)
    if "SLOW" in os.environ and os.environ.get("SLOW_RANK", "1") in (os.environ.get("RANK", "0"), "all"):
        phase, seconds, step = os.environ["SLOW"].split(":")
        slow_down(phase, float(seconds), int(step))
    if "RECORD_SAMPLES" in os.environ:
        record_samples(os.environ["RECORD_SAMPLES"])
    # As a script, so that Hydra finds its config beside main.py.
    runpy.run_path(str(MINGPT / "main.py"), run_name="__main__")
