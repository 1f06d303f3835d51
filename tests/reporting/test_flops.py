"""flops.py: the peak MFU is held against, and MFU's one definition."""
import json
import math
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

    def fake_rates(dtype):
        measured.append(dtype)
        return {1024: 1e9 if dtype == torch.float32 else 4e9, 2048: 2e9 if dtype == torch.float32 else 8e9}

    monkeypatch.setattr(flops, "matmul_flops_by_size", fake_rates)
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
    assert measured == [torch.bfloat16, torch.float32]
    (tmp_path / flops.CPU_PEAKS_FILE).unlink()  # measured again once the cache is gone
    assert flops.cpu_peak_flops("fp32") == 2e9 and measured[-1] == torch.float32


@pytest.mark.parametrize("damage", [
    lambda text: text[: len(text) // 2], lambda text: "", lambda text: "[1, 2]", lambda text: '{"x": "y"}'],
    ids=["cut", "emptied", "another-shape", "garbled-value"])
def test_a_damaged_peaks_file_is_measured_again_and_rewritten(monkeypatch, tmp_path, damage):
    monkeypatch.setenv("MINGPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flops, "matmul_flops_by_size", lambda dtype: {1024: 3e9})
    assert flops.cpu_peak_flops("fp32") == 3e9
    path = tmp_path / flops.CPU_PEAKS_FILE
    path.write_text(damage(path.read_text()))
    assert flops.cpu_peak_flops("fp32") == 3e9
    assert list(json.loads(path.read_text()).values()) == [3e9]


def test_mfu_is_one_device_rate_over_its_peak():
    assert flops.model_flops_utilization(500.0, 1000, 1e6) == 0.5
