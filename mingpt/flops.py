"""The peak a device could reach, for model FLOPs utilisation (MFU): achieved FLOP/s / peak.

GPUs: the datasheet's dense bf16 tensor-core peak (the convention MFU figures are quoted in).
CPUs: no datasheet figure fits a laptop, so the fp32 matmul rate is measured at the thread count
training uses; it is the most a matmul-bound model can reach there.
"""
import time
from functools import lru_cache
from typing import Callable, Optional

import torch

# Dense bf16 TFLOP/s, matched in order against torch.cuda.get_device_name().
GPU_BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM, also reported as "H100 80GB HBM3"
    ("H200", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A10G", 125.0),
    ("L4", 121.0),
    ("L40S", 362.0),
    ("RTX 4090", 165.0),
    ("V100", 125.0),
)
CPU_MATMUL_SIZES = (1024, 2048)


def gpu_peak_flops(device: torch.device) -> Optional[float]:
    name = torch.cuda.get_device_name(device)
    for fragment, tflops in GPU_BF16_PEAK_TFLOPS:
        if fragment in name:
            return tflops * 1e12
    return None


def wait_for(device: torch.device) -> None:
    """CUDA runs asynchronously: wait for its queued kernels before reading a clock. CPU ops are
    synchronous."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` calls of fn, after two untimed ones (library setup, page faults)."""
    for _ in range(2):
        fn()
    wait_for(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        wait_for(device)
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops_by_size(dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
                         sizes: tuple[int, ...] = CPU_MATMUL_SIZES, repeats: int = 3) -> dict[int, float]:
    """FLOP/s of n x n matmuls for each n, at the current torch thread count (best of repeats)."""
    rates = {}
    for n in sizes:
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        rates[n] = 2 * n**3 / best_seconds(lambda: torch.mm(a, b), device, repeats)
    return rates


@lru_cache(maxsize=None)
def peak_flops(device: torch.device) -> Optional[float]:
    """FLOP/s to measure MFU against on this device (None when unknown)."""
    if device.type == "cuda":
        return gpu_peak_flops(device)
    if device.type == "cpu":
        return max(matmul_flops_by_size().values())
    return None
