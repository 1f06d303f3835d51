"""flops.py: the peak MFU is held against, and MFU's one definition."""
import json
import math
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from mingpt.reporting import flops


def test_best_seconds_keeps_the_fastest_call_after_two_untimed_ones():
    durations = iter([0.2, 0.2, 0.03, 0.01, 0.02])  # the first two are the untimed warm-up calls
    best = flops.best_seconds(lambda: time.sleep(next(durations)), torch.device("cpu"), repeats=3)
    assert 0.01 <= best < 0.02


def test_matmul_flops_by_size_measures_each_size(one_torch_thread):
    rates = flops.matmul_flops_by_size(sizes=(64, 128), repeats=2)
    assert list(rates) == [64, 128]
    assert all(math.isfinite(r) and r > 1e6 for r in rates.values())


def pretend_gpu(monkeypatch, name: str, sms: int = 1000) -> None:
    """torch.cuda reports a GPU of this name with this many SMs (by default more than any has)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(multi_processor_count=sms))


def test_a_mig_slice_is_measured_against_its_share_of_the_gpu(monkeypatch):
    """A MIG slice's name holds its GPU's; its SMs say how much of the GPU it is (1g.10gb: 16 of 132)."""
    pretend_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", sms=16)
    assert flops.gpu_peak_flops(torch.device("cuda"), "bf16") == pytest.approx(989.5e12 * 16 / 132)
    pretend_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", sms=132)
    assert flops.gpu_peak_flops(torch.device("cuda"), "bf16") == 989.5e12


# Names as torch.cuda.get_device_name() reports them, with the dense bf16 TFLOP/s expected.
@pytest.mark.parametrize("name, bf16", [
    ("NVIDIA H100 80GB HBM3", 989.5),
    ("NVIDIA H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", 989.5),
    ("NVIDIA GH200 480GB", 989.5),
    ("NVIDIA A100-SXM4-40GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA L4", 121.0),
    ("NVIDIA L40", 181.0),
    ("NVIDIA L40S", 362.0),
    ("NVIDIA A10G", 70.0),
    ("NVIDIA A10", 125.0),
    ("NVIDIA GeForce RTX 4090", 165.2),
    ("Tesla V100-SXM2-16GB", None),  # no bf16 tensor cores
    ("Some Future GPU", None),
])
def test_gpu_peak_is_the_most_specific_datasheet_entry(monkeypatch, name, bf16):
    pretend_gpu(monkeypatch, name)
    peak = flops.gpu_peak_flops(torch.device("cuda"), "bf16")
    assert peak == (None if bf16 is None else bf16 * 1e12)


def test_gpu_peak_follows_the_precision_in_use(monkeypatch):
    pretend_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda")
    assert [flops.gpu_peak_flops(cuda, dtype) for dtype in ("bf16", "fp16", "tf32", "fp32")] == [
        312e12, 312e12, 156e12, 19.5e12]
    pretend_gpu(monkeypatch, "Tesla V100-PCIE-32GB")
    assert flops.gpu_peak_flops(cuda, "fp16") == 125e12 and flops.gpu_peak_flops(cuda, "tf32") is None


def test_cpu_peak_is_measured_in_the_dtype_asked_for_once_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("MINGPT_CACHE_DIR", str(tmp_path))
    measured = []

    def fake_peak(dtype):
        measured.append(dtype)
        return flops.CpuPeak(8e9 if dtype == "bf16" else 2e9, clean=True)

    monkeypatch.setattr(flops, "measure_cpu_peak", fake_peak)
    cpu = torch.device("cpu")
    flops.peak_flops.cache_clear()
    try:
        assert flops.peak_flops(cpu, "bf16") == 8e9 and flops.peak_flops(cpu, "fp32") == 2e9
        assert flops.peak_flops(cpu, "fp16") is None  # a CPU never trains in fp16
        assert flops.peak_flops(torch.device("meta"), "fp32") is None
        flops.peak_flops.cache_clear()  # a new process: the peaks come from the cache folder
        assert flops.peak_flops(cpu, "bf16") == 8e9 and flops.peak_flops(cpu, "fp32") == 2e9
    finally:
        flops.peak_flops.cache_clear()
    assert measured == ["bf16", "fp32"]
    (tmp_path / flops.CPU_PEAKS_FILE).unlink()  # measured again once the cache is gone
    assert flops.cpu_peak_flops("fp32") == 2e9 and measured[-1] == "fp32"


def timing(gflop_per_s: float, cpu_share: float, threads: int = 2) -> flops.MatmulTiming:
    """A call of 1 GFLOP at this rate by the wall clock, its threads running this share of it."""
    wall_s = 1 / gflop_per_s
    return flops.MatmulTiming(1e9, wall_s, cpu_share * threads * wall_s)


def test_the_peak_is_the_fastest_undisturbed_call_or_else_the_rate_per_cpu_second():
    """Calls whose threads did not run throughout (other processes held the cores) read slow by the
    wall clock: the peak comes from those that did; when none did, from the time the threads ran."""
    calls = [timing(180, 0.99), timing(90, 0.5), timing(190, 0.97), timing(60, 0.3)]
    assert flops.peak_of(calls, threads=2) == flops.CpuPeak(190e9, clean=True)
    crowded = [timing(90, 0.5), timing(45, 0.25), timing(30, 0.2)]  # 180, 180 and 150 per CPU second
    assert flops.peak_of(crowded, threads=2) == flops.CpuPeak(pytest.approx(180e9), clean=False)


def test_timed_matmuls_read_the_cpu_time_of_every_thread(one_torch_thread):
    calls = flops.timed_matmuls(torch.float32, sizes=(256, 512), repeats=2)
    assert [call.flop for call in calls] == [2 * 256**3] * 2 + [2 * 512**3] * 2
    assert all(call.wall_s > 0 and call.cpu_s > 0 for call in calls)
    assert max(call.cpu_share(1) for call in calls) > 0.3  # one thread: it ran for much of each call


def test_a_peak_measured_on_a_busy_cpu_serves_its_run_and_is_measured_again_at_the_next(
        monkeypatch, tmp_path):
    """A measurement without an undisturbed call is not kept for good: the next run measures again,
    keeps the higher, and once one is clean, that one serves every run after."""
    monkeypatch.setenv("MINGPT_CACHE_DIR", str(tmp_path))
    measurements = iter([flops.CpuPeak(1.5e11, clean=False), flops.CpuPeak(1.2e11, clean=False),
                         flops.CpuPeak(1.9e11, clean=True)])
    monkeypatch.setattr(flops, "measure_cpu_peak", lambda dtype: next(measurements))
    assert flops.cpu_peak_flops("fp32") == 1.5e11
    assert flops.cpu_peak_flops("fp32") == 1.5e11  # measured again, the higher kept
    assert flops.cpu_peak_flops("fp32") == 1.9e11  # clean
    assert flops.cpu_peak_flops("fp32") == 1.9e11  # kept: no measurement left to take
    kept = json.loads((tmp_path / flops.CPU_PEAKS_FILE).read_text())
    assert list(kept.values()) == [{"flops": 1.9e11, "clean": True}]


def test_a_peak_a_run_beats_is_measured_again_once_and_dropped_if_still_beaten(monkeypatch, tmp_path):
    monkeypatch.setenv("MINGPT_CACHE_DIR", str(tmp_path))
    measurements = iter([flops.CpuPeak(5e10, clean=True), flops.CpuPeak(1.9e11, clean=True),
                         flops.CpuPeak(1e11, clean=True)])
    monkeypatch.setattr(flops, "measure_cpu_peak", lambda dtype: next(measurements))
    cpu = torch.device("cpu")
    flops.peak_flops.cache_clear()
    try:
        assert flops.peak_flops(cpu, "fp32") == 5e10  # clean, yet too low (measured under a burst)
        assert flops.peak_above(cpu, "fp32", achieved=7e10) == 1.9e11  # measured again: kept for good
        assert flops.peak_flops(cpu, "fp32") == 1.9e11
        assert flops.peak_above(cpu, "fp32", achieved=2.5e11) is None  # 1e11 measured, 1.9e11 kept: beaten
        assert flops.cpu_peak_flops("fp32") == 1.9e11
    finally:
        flops.peak_flops.cache_clear()
    assert flops.peak_above(torch.device("cuda"), "bf16", achieved=2e15) is None  # a datasheet's figure


@pytest.mark.parametrize("damage", [
    lambda text: text[: len(text) // 2], lambda text: "", lambda text: "[1, 2]", lambda text: '{"x": "y"}',
    lambda text: '{"AMD EPYC | 2 threads | fp32 | torch 2.13.0": 4.5e10}'],
    ids=["cut", "emptied", "another-shape", "garbled-value", "bare-numbers-of-before"])
def test_a_damaged_or_older_peaks_file_is_measured_again_and_rewritten(monkeypatch, tmp_path, damage):
    """The file of a version that kept bare numbers (measured by the wall clock, whatever the load)
    is measured again like a damaged one."""
    monkeypatch.setenv("MINGPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "measure_cpu_peak", lambda dtype: flops.CpuPeak(3e9, clean=True))
    assert flops.cpu_peak_flops("fp32") == 3e9
    path = tmp_path / flops.CPU_PEAKS_FILE
    path.write_text(damage(path.read_text()))
    assert flops.cpu_peak_flops("fp32") == 3e9
    assert list(json.loads(path.read_text()).values()) == [{"flops": 3e9, "clean": True}]


HOGS = 4
"""Processes that keep a core busy each, on a 2-core machine: a load of 4 more."""


@pytest.mark.slow
def test_a_peak_measured_beside_cpu_hogs_is_the_peak_measured_without_them():
    """On real matmuls, at the thread count a run uses: with HOGS busy loops holding the cores, the
    wall clock reads the matmuls far slower; the peak does not move with them."""
    threads = torch.get_num_threads()
    before = flops.measure_cpu_peak("fp32")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: sum(range(10_000))"]) for _ in range(HOGS)]
    try:
        time.sleep(1)  # the hogs are running
        wall_clock = max(flops.matmul_flops_by_size(torch.float32, sizes=(1024,), repeats=2).values())
        loaded = flops.measure_cpu_peak("fp32")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    after = flops.measure_cpu_peak("fp32")
    print(f"threads {threads}: peak {before.flops / 1e9:.0f} GFLOP/s before (clean: {before.clean}), "
          f"{loaded.flops / 1e9:.0f} beside {HOGS} hogs (clean: {loaded.clean}; the wall clock read "
          f"{wall_clock / 1e9:.0f}), {after.flops / 1e9:.0f} after")
    unloaded = max(before.flops, after.flops)
    assert wall_clock < 0.8 * unloaded  # the hogs did crowd the matmuls
    assert loaded.flops > 0.8 * unloaded


def test_mfu_is_one_device_rate_over_its_peak():
    assert flops.model_flops_utilization(500.0, 1000, 1e6) == 0.5
