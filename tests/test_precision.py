import pytest
import torch

import precision
from logger import configure_logging
from precision import Precision, resolve_precision

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only described, never used: nothing here touches a GPU


def test_amp_off_is_fp32():
    chosen = resolve_precision(False, "float16", CPU)
    assert chosen.amp_dtype is None and not chosen.needs_grad_scaler and str(chosen) == "fp32"
    assert chosen.matmul_dtype == "fp32"


def test_cpu_with_native_bf16_uses_bf16_autocast(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    chosen = resolve_precision(True, "float16", CPU)
    assert chosen.amp_dtype == torch.bfloat16 and not chosen.needs_grad_scaler
    assert chosen.matmul_dtype == "bf16"
    with chosen.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_cpu_without_native_bf16_ignores_amp_with_one_warning(monkeypatch, capsys):
    configure_logging(rank=0)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    chosen = resolve_precision(True, "bfloat16", CPU)
    assert chosen.amp_dtype is None
    out = capsys.readouterr().out
    assert out.count("warning: trainer_config.use_amp ignored") == 1


def test_the_warning_is_rank_zeros_alone(monkeypatch, capsys):
    configure_logging(rank=1)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    resolve_precision(True, "float16", CPU)
    assert capsys.readouterr().out == ""
    configure_logging(rank=0)


def test_cuda_fp16_uses_a_grad_scaler():
    chosen = resolve_precision(True, "float16", CUDA)
    assert chosen.amp_dtype == torch.float16 and chosen.needs_grad_scaler
    assert str(chosen) == "fp16 mixed precision + GradScaler" and chosen.matmul_dtype == "fp16"


def test_bf16_on_a_gpu_that_only_emulates_it_falls_back_to_fp16(monkeypatch):
    # A V100 or T4: torch counts bf16 as supported unless asked about native support.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    chosen = resolve_precision(True, "bfloat16", CUDA)
    assert chosen.amp_dtype == torch.float16 and chosen.needs_grad_scaler


def test_bf16_on_a_gpu_with_native_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    chosen = resolve_precision(True, "bfloat16", CUDA)
    assert chosen.amp_dtype == torch.bfloat16 and str(chosen) == "bf16 mixed precision"


def test_fp32_on_cuda_allows_tf32_and_says_so():
    chosen = resolve_precision(False, "float16", CUDA)
    assert chosen.matmul_dtype == "tf32" and str(chosen) == "fp32 (TF32 matmuls)"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        chosen.configure_matmuls()
        assert torch.get_float32_matmul_precision() == "high"
        torch.set_float32_matmul_precision("highest")
        Precision("cpu", None).configure_matmuls()  # the CPU's fp32 stays fp32
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
