"""Which numeric precision training actually uses, decided once from the config and the device.

- CUDA, amp_dtype=float16 (the original): fp16 autocast with a GradScaler.
- CUDA, amp_dtype=bfloat16: bf16 autocast, no scaler (bf16 has fp32's range); fp16 on GPUs
  without native bf16 (V100, T4: torch would otherwise emulate it, slowly).
- CUDA, use_amp=False: fp32 with TF32 matmuls allowed on Ampere and newer, the field's usual
  practice (10 bits of mantissa in the matmul inputs, fp32 accumulation): several times faster.
- CPU: bf16 autocast when the CPU computes bf16 natively (AVX512-BF16 or AMX); otherwise AMP is
  ignored with one warning, because emulated bf16 is many times slower than fp32 there.
"""
import contextlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

from mingpt.common.logger import warn_once

AMP_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
SHORT_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def dtype_name(dtype: Optional[torch.dtype], tf32: bool = False) -> str:
    """A compute dtype as peaks and log lines name it (fp16, bf16); None, no mixed precision: fp32,
    or tf32 where fp32 matmuls may run as TF32."""
    if dtype is None:
        return "tf32" if tf32 else "fp32"
    return SHORT_NAMES[dtype]


@dataclass(frozen=True)
class Precision:
    device_type: str
    amp_dtype: Optional[torch.dtype]
    """Autocast dtype; None trains in fp32."""

    @property
    def needs_grad_scaler(self) -> bool:
        """fp16 gradients underflow without loss scaling; bf16 and fp32 ones do not."""
        return self.amp_dtype == torch.float16

    @property
    def allows_tf32(self) -> bool:
        """fp32 matmuls may run as TF32: on CUDA (GPUs without TF32 simply run fp32)."""
        return self.device_type == "cuda"

    @property
    def matmul_dtype(self) -> str:
        """What the matmuls run in, which sets the peak MFU is held against: bf16, fp16, tf32, fp32."""
        return dtype_name(self.amp_dtype, tf32=self.allows_tf32)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.amp_dtype)

    def configure_matmuls(self) -> None:
        """Let fp32 matmuls use TF32 where this precision allows it (a process-wide setting)."""
        if self.allows_tf32:
            torch.set_float32_matmul_precision("high")

    def __str__(self) -> str:
        if self.amp_dtype is None:
            return "fp32 (TF32 matmuls)" if self.allows_tf32 else "fp32"
        return f"{self.matmul_dtype} mixed precision" + (" + GradScaler" if self.needs_grad_scaler else "")


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists AVX512-BF16 or AMX-BF16 (Linux; elsewhere assume not)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def gpu_has_native_bf16() -> bool:
    """Without including_emulation=False torch also counts bf16 emulated on older GPUs."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_precision(use_amp: bool, amp_dtype: str, device: torch.device) -> Precision:
    if not use_amp:
        return Precision(device.type, None)
    if device.type == "cuda":
        wanted = AMP_DTYPES[amp_dtype]
        if wanted == torch.bfloat16 and not gpu_has_native_bf16():
            warn_once("this GPU has no native bf16: training with fp16 autocast and a GradScaler instead")
            wanted = torch.float16
        return Precision("cuda", wanted)
    if cpu_has_native_bf16():
        return Precision(device.type, torch.bfloat16)
    warn_once("trainer_config.use_amp ignored: this CPU has no native bf16, which would be many "
              "times slower than fp32; training in fp32")
    return Precision(device.type, None)
