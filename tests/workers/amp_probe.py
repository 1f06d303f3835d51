"""Entry point for the tests (alone, or under torchrun): mingpt/main.py with fp16 autocast and a
GradScaler forced on the CPU, which a CPU never chooses (precision.py) but every CUDA run does.

    [SCALER_GROWTH_INTERVAL=N] [torchrun ...] tests/workers/amp_probe.py [hydra overrides]

Only the choice is forced: with use_amp=True the run trains as a GPU run with amp_dtype=float16
would, through the real Trainer, its GradScaler and snapshots. SCALER_GROWTH_INTERVAL=N makes the
loss scale double after N clean steps instead of 2,000, so that a run of a few dozen steps sees
what a long one does: the scale growing until the fp16 gradients overflow, a skipped step, and the
scale halved; global rank 0 then names the scaler class the run built ("Scaler: ..."): under FSDP
the sharded one, whose overflow flag is all-reduced over the ranks.
"""
import os
import runpy
from pathlib import Path

import torch

import mingpt
from mingpt.distributed import parallel, precision

MINGPT = Path(mingpt.__file__).parent  # main.py, run below as `python main.py` would be

resolve_as_configured = precision.resolve_precision


def fp16_with_a_scaler(use_amp: bool, amp_dtype: str, device: torch.device) -> precision.Precision:
    if not use_amp:
        return resolve_as_configured(use_amp, amp_dtype, device)
    return precision.Precision(device.type, torch.float16)


def growing_fast(scaler_class: type) -> type:
    """scaler_class with the loss scale doubling after SCALER_GROWTH_INTERVAL clean steps."""
    class FastGrowing(scaler_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, growth_interval=int(os.environ["SCALER_GROWTH_INTERVAL"]))
            if os.environ.get("RANK", "0") == "0":
                print(f"Scaler: {scaler_class.__name__}", flush=True)

    return FastGrowing


FastGrowingScaler = growing_fast(torch.amp.GradScaler)
FastGrowingShardedScaler = growing_fast(parallel.FusedShardedGradScaler)


if __name__ == "__main__":
    if "SCALER_GROWTH_INTERVAL" in os.environ:
        torch.amp.GradScaler = FastGrowingScaler  # what parallel.grad_scaler builds, or under FSDP
        parallel.FusedShardedGradScaler = FastGrowingShardedScaler
    # Before main.py imports start_up, which takes resolve_precision from this module.
    precision.resolve_precision = fp16_with_a_scaler
    runpy.run_path(str(MINGPT / "main.py"), run_name="__main__")
