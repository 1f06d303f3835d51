"""Which numeric precision training actually uses, decided once from the config and the device.

- CUDA, amp_dtype=float16 (the original): fp16 autocast with a GradScaler.
- CUDA, amp_dtype=bfloat16: bf16 autocast, no scaler (bf16 has fp32's range); fp16 on GPUs
  without bf16.
- CPU: bf16 autocast when the CPU computes bf16 natively (AVX512-BF16 or AMX); otherwise AMP is
  ignored with one warning, because emulated bf16 is about 70x slower than fp32 there.
"""
import contextlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from logger import warn_once

AMP_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    device_type: str
    amp_dtype: Optional[torch.dtype]
    """Autocast dtype; None trains in fp32."""

    @property
    def needs_grad_scaler(self) -> bool:
        """fp16 gradients underflow without loss scaling; bf16 and fp32 ones do not."""
        return self.amp_dtype == torch.float16

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.amp_dtype)

    def __str__(self) -> str:
        if self.amp_dtype is None:
            return "fp32"
        name = "fp16" if self.amp_dtype == torch.float16 else "bf16"
        return f"{name} mixed precision" + (" + GradScaler" if self.needs_grad_scaler else "")


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists AVX512-BF16 or AMX-BF16 (Linux; elsewhere assume not)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(use_amp: bool, amp_dtype: str, device: torch.device) -> Precision:
    if not use_amp:
        return Precision(device.type, None)
    if device.type == "cuda":
        wanted = AMP_DTYPES[amp_dtype]
        if wanted == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            warn_once("this GPU has no bf16: training with fp16 autocast and a GradScaler instead")
            wanted = torch.float16
        return Precision("cuda", wanted)
    if cpu_has_native_bf16():
        return Precision(device.type, torch.bfloat16)
    warn_once("trainer_config.use_amp ignored: this CPU has no native bf16, which would be about "
                "70x slower than fp32; training in fp32")
    return Precision(device.type, None)
