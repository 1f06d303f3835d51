"""Model FLOPs utilisation (MFU): the FLOP/s a device achieves over the peak of the precision in use.

MFU is per device: tokens per second per rank x training FLOPs per token / that rank's peak. The
peak is that of the dtype the matmuls actually run in (precision.Precision.matmul_dtype):
- GPUs: the datasheet's dense tensor-core figure for bf16 or fp16, TF32 for fp32 runs (which allow
  TF32 on CUDA), matched by the device's name;
- CPUs: no datasheet fits a laptop, so the rate of square matmuls in that dtype is measured at the
  thread count training uses, at sizes large enough to reach it (cpu_peak_flops). The CPU is often
  shared (other jobs, the other ranks, a laptop's browser), and a matmul timed by the wall clock
  while other processes hold its cores reads two to four times slow: an MFU of 150%, a forecast of
  days. So each timed call also reads the CPU time the process got: a call whose threads ran
  throughout (CLEAN_SHARE) gives the peak; when none did, the rate per CPU-second of its threads
  stands in (within 10% of the idle peak under a load of 7 on 2 cores, where the wall clock read a
  quarter), used for this run and measured again at the next. Only a clean measurement is kept for
  good. A run that still does better than its peak (MFU over 100%) measures it again once; the
  MFU of a peak still below what training does is not shown (monitor.py).
"""
import contextlib
import json
import os
import platform
import re
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

import torch

from mingpt.common.files import cache_folder


@dataclass(frozen=True)
class GpuPeaks:
    """Dense (not 2:4 sparse) datasheet peaks in TFLOP/s; None where the GPU lacks the dtype."""

    name: str
    """As it appears in torch.cuda.get_device_name(), matched as whole words."""
    bf16: Optional[float]
    fp16: Optional[float]
    tf32: Optional[float]
    fp32: float
    sms: int
    """Streaming multiprocessors of the whole GPU: a MIG slice has a share of them, and of the peak."""
    memory_gb: float = 0.0
    """Memory of one GPU in GB (10^9 bytes; the datasheet's largest variant), for plan.py."""


# NVIDIA's datasheets (sparse figures halved; memory in GB, the largest variant: A100 and V100 also
# come with 40 and 16 GB, for plan.py's --memory-gb). Matched most specific name first, whole words
# only, so that "L40S" is not read as "L4" nor "GH200" as "H200".
GPU_PEAKS = (
    GpuPeaks("H100 NVL", 835.5, 835.5, 417.5, 60.0, 132, 94),
    GpuPeaks("H100 PCIe", 756.5, 756.5, 378.0, 51.2, 114, 80),
    GpuPeaks("H100", 989.5, 989.5, 494.5, 66.9, 132, 80),  # SXM; reported as "NVIDIA H100 80GB HBM3"
    GpuPeaks("H200 NVL", 835.5, 835.5, 417.5, 60.0, 132, 141),
    GpuPeaks("H200", 989.5, 989.5, 494.5, 66.9, 132, 141),
    GpuPeaks("GH200", 989.5, 989.5, 494.5, 66.9, 132, 96),
    GpuPeaks("B200", 2250.0, 2250.0, 1100.0, 75.0, 148, 180),
    GpuPeaks("A100", 312.0, 312.0, 156.0, 19.5, 108, 80),  # 40 and 80 GB, SXM and PCIe alike
    GpuPeaks("A10G", 70.0, 70.0, 35.0, 31.2, 80, 24),  # AWS's A10 variant: fewer tensor FLOPs than the A10
    GpuPeaks("A10", 125.0, 125.0, 62.5, 31.2, 72, 24),
    GpuPeaks("L40S", 362.0, 362.0, 183.0, 91.6, 142, 48),
    GpuPeaks("L40", 181.0, 181.0, 90.5, 90.5, 142, 48),
    GpuPeaks("L4", 121.0, 121.0, 60.0, 30.3, 58, 24),
    GpuPeaks("RTX 4090", 165.2, 165.2, 82.6, 82.6, 128, 24),  # fp16/bf16 with fp32 accumulation
    GpuPeaks("V100", None, 125.0, None, 15.7, 80, 32),
    GpuPeaks("T4", None, 65.0, None, 8.1, 40, 16),
)
CPU_MATMUL_SIZES = (1024, 2048)
"""Square matmuls this large reach the CPU's rate in fp32 and bf16 (notes: 4096 is slower in bf16)."""


def _mentions(device_name: str, model: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(model)}(?!\w)", device_name) is not None


def gpu_peaks_for(device_name: str) -> Optional[GpuPeaks]:
    """The table's entry for a device name, the most specific match first; None if unknown."""
    for peaks in sorted(GPU_PEAKS, key=lambda p: len(p.name), reverse=True):
        if _mentions(device_name, peaks.name):
            return peaks
    return None


def gpu_peak_flops(device: torch.device, dtype: str) -> Optional[float]:
    """Datasheet FLOP/s of this GPU in dtype ('bf16', 'fp16', 'tf32' or 'fp32'); None if unknown.
    A MIG slice matches its GPU's entry and gets the share of the peak its SMs are of the GPU's."""
    peaks = gpu_peaks_for(torch.cuda.get_device_name(device))
    tflops = getattr(peaks, dtype) if peaks else None
    if not tflops:
        return None
    share = min(torch.cuda.get_device_properties(device).multi_processor_count / peaks.sms, 1.0)
    return tflops * 1e12 * share


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


CPU_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""What a CPU trains in (precision.py); fp16 only when a test forces it, with no meaningful peak."""


@dataclass(frozen=True)
class MatmulTiming:
    """One timed matmul: its FLOPs, its wall-clock seconds and the CPU seconds the process used in them."""

    flop: float
    wall_s: float
    cpu_s: float

    def cpu_share(self, threads: int) -> float:
        """How much of its threads' time the call got: 1.0 when every thread ran throughout."""
        return self.cpu_s / (threads * self.wall_s)


CLEAN_SHARE = 0.9
"""A timed call whose threads got at least this share of the wall-clock time ran undisturbed (idle,
calls read 0.96 to 1.04; under a load of 7 on 2 cores, 0.5)."""


MEASURING_S = 5.0
"""Timing stops after this long (idle, it takes about 2 s; on a crowded CPU each call takes many
times longer, and the rate per CPU second needs few of them)."""


def timed_matmuls(dtype: torch.dtype = torch.float32, sizes: tuple[int, ...] = CPU_MATMUL_SIZES,
                  repeats: int = 3) -> list[MatmulTiming]:
    """Up to repeats timed n x n matmuls on the CPU for each n, after two untimed ones, at the current
    torch thread count, each with the CPU time the process used (all its threads) while it ran."""
    timings, deadline = [], time.monotonic() + MEASURING_S
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(2):  # library setup, page faults
            torch.mm(a, b)
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            torch.mm(a, b)
            timings.append(MatmulTiming(2 * n**3, time.perf_counter() - wall, time.process_time() - cpu))
            if time.monotonic() > deadline:
                return timings
    return timings


@dataclass(frozen=True)
class CpuPeak:
    flops: float
    clean: bool
    """Measured by the wall clock in calls that ran undisturbed; else by CPU time (the machine was busy)."""


def peak_of(timings: list[MatmulTiming], threads: int) -> CpuPeak:
    """The fastest undisturbed call's rate; when every call was disturbed, the fastest rate per CPU
    second of the threads (a call's work over the time its threads actually ran)."""
    clean = [t.flop / t.wall_s for t in timings if t.cpu_share(threads) >= CLEAN_SHARE]
    if clean:
        return CpuPeak(max(clean), clean=True)
    return CpuPeak(max(t.flop / (t.cpu_s / threads) for t in timings if t.cpu_s > 0), clean=False)


def matmul_flops_by_size(dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu"),
                         sizes: tuple[int, ...] = CPU_MATMUL_SIZES, repeats: int = 3) -> dict[int, float]:
    """FLOP/s of n x n matmuls for each n, at the current torch thread count (best of repeats), by
    the wall clock (bench/: the rate a program sees, load included)."""
    rates = {}
    for n in sizes:
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        rates[n] = 2 * n**3 / best_seconds(lambda: torch.mm(a, b), device, repeats)
    return rates


@lru_cache(maxsize=None)
def peak_flops(device: torch.device, dtype: str) -> Optional[float]:
    """FLOP/s to hold a run whose matmuls are in dtype against, on this device (None when unknown)."""
    if device.type == "cuda":
        return gpu_peak_flops(device, dtype)
    if device.type == "cpu" and dtype in CPU_DTYPES:
        return cpu_peak_flops(dtype)
    return None


def peak_above(device: torch.device, dtype: str, achieved: float) -> Optional[float]:
    """A run achieved more FLOP/s than its peak: on a CPU, the peak measured again (kept if higher);
    it, if it is now above what was achieved, else None (no peak to hold the run against). A GPU's
    datasheet figure is not measured: None."""
    if device.type != "cpu" or dtype not in CPU_DTYPES:
        return None
    peak_flops.cache_clear()
    peak = cpu_peak_flops(dtype, again=True)
    return peak if peak >= achieved else None


CPU_PEAKS_FILE = "cpu_peaks.json"
"""In the cache folder (storage.files.cache_folder): measured CPU peaks; delete it to measure again."""


def cpu_peak_flops(dtype: str, again: bool = False) -> float:
    """The square-matmul peak in dtype for this CPU model, thread count and torch version. A clean
    measurement (about 2 s) is kept in the cache folder, so that start-up does not pay for it every
    run; one taken on a busy machine serves this run and is measured again at the next (the higher
    of the two kept meanwhile). again: measure now whatever is kept (keeping the higher)."""
    key = f"{cpu_model()} | {torch.get_num_threads()} threads | {dtype} | torch {torch.__version__}"
    path = cache_folder(None) / CPU_PEAKS_FILE
    peaks = read_peaks(path)
    kept = peaks.get(key)
    if kept is not None and kept.clean and not again:
        return kept.flops
    measured = measure_cpu_peak(dtype)
    if kept is not None and kept.flops > measured.flops:
        measured = CpuPeak(kept.flops, kept.clean or measured.clean)
    peaks[key] = measured
    with contextlib.suppress(OSError):  # unwritable: measured again next time, nothing worse
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({k: vars(peak) for k, peak in peaks.items()}, indent=1))
        temporary.replace(path)
    return measured.flops


def measure_cpu_peak(dtype: str) -> CpuPeak:
    """This CPU's square-matmul peak in dtype, measured now at the current torch thread count."""
    return peak_of(timed_matmuls(CPU_DTYPES[dtype]), torch.get_num_threads())


def read_peaks(path: Path) -> dict[str, CpuPeak]:
    """The kept peaks; none when the file is missing, cut short, garbled or of another shape (a
    version that kept bare numbers, measured by the wall clock whatever the load: measured again)."""
    try:
        return {key: CpuPeak(float(peak["flops"]), bool(peak["clean"]))
                for key, peak in json.loads(path.read_text()).items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def cpu_model() -> str:
    """The CPU's model name and the flags that decide its matmul speed (machines of one name differ)."""
    with contextlib.suppress(OSError):
        info = Path("/proc/cpuinfo").read_text()
        name = re.search(r"^model name\s*:\s*(.+)$", info, re.MULTILINE)
        flags = re.search(r"^flags\s*:\s*(.+)$", info, re.MULTILINE)
        present = set(flags.group(1).split()) if flags else set()
        fast = sorted(present & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
        return f"{name.group(1) if name else 'unknown CPU'} ({' '.join(fast)})"
    return platform.processor() or "unknown CPU"


def model_flops_utilization(tokens_per_s_per_device: float, flops_per_token: float, peak: float) -> float:
    """The one definition of MFU here: one device's achieved model FLOP/s over its peak."""
    return tokens_per_s_per_device * flops_per_token / peak
