"""flops.py: the peak MFU is quoted against."""
import math
import time

import pytest
import torch

import flops


def test_best_seconds_keeps_the_fastest_call_after_two_untimed_ones():
    durations = iter([0.2, 0.2, 0.03, 0.01, 0.02])  # the first two are the untimed warm-up calls
    best = flops.best_seconds(lambda: time.sleep(next(durations)), torch.device("cpu"), repeats=3)
    assert 0.01 <= best < 0.02


def test_matmul_flops_by_size_measures_each_size(one_torch_thread):
    rates = flops.matmul_flops_by_size(sizes=(64, 128), repeats=2)
    assert list(rates) == [64, 128]
    assert all(math.isfinite(r) and r > 1e6 for r in rates.values())


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("Some Future GPU", None),
])
def test_gpu_peak_comes_from_the_datasheet_table_by_name(monkeypatch, name, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak = flops.gpu_peak_flops(torch.device("cuda"))
    assert peak == (None if tflops is None else tflops * 1e12)


def test_peak_is_measured_on_cpu_and_unknown_elsewhere():
    assert flops.peak_flops(torch.device("cpu")) > 1e8
    assert flops.peak_flops(torch.device("meta")) is None
