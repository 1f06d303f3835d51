import pytest
import torch

import precision
from logger import configure_logging
from precision import resolve_precision

CPU = torch.device("cpu")


def test_amp_off_is_fp32():
    chosen = resolve_precision(False, "float16", CPU)
    assert chosen.amp_dtype is None and not chosen.needs_grad_scaler and str(chosen) == "fp32"


def test_cpu_with_native_bf16_uses_bf16_autocast(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    chosen = resolve_precision(True, "float16", CPU)
    assert chosen.amp_dtype == torch.bfloat16 and not chosen.needs_grad_scaler
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fp16_uses_a_grad_scaler():
    chosen = resolve_precision(True, "float16", torch.device("cuda"))
    assert chosen.amp_dtype == torch.float16 and chosen.needs_grad_scaler
    assert str(chosen) == "fp16 mixed precision + GradScaler"
