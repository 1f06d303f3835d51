"""common/tensor_ops.py: the CPU's dropout mask and causal attention with dropout, against torch's
arithmetic (the model's use of them: tests/test_model.py; top-k sampling: tests/test_model_generate.py)."""
import math

import pytest
import torch
import torch.nn.functional as F

from mingpt.common.tensor_ops import causal_attention, dropout, keep_mask


def test_keep_mask_drops_p_of_the_elements_and_keeps_the_mean():
    like = torch.empty(1000, 1000, dtype=torch.bfloat16)
    torch.manual_seed(0)
    keep, scale = keep_mask(like, 0.1)
    assert keep.shape == like.shape and keep.dtype == torch.bfloat16
    assert set(keep.unique().tolist()) == {0.0, 1.0}
    dropped = 1 - keep.float().mean().item()
    assert dropped == pytest.approx(0.1, abs=4 * math.sqrt(0.1 * 0.9 / like.numel()))  # 4 sigma
    assert scale == pytest.approx(1 / 0.9, rel=1e-4)
    assert scale * (1 - round(0.1 * 65536) / 65536) == pytest.approx(1.0, rel=1e-12)  # unbiased
    torch.manual_seed(0)
    assert torch.equal(keep_mask(like, 0.1)[0], keep)  # torch's generator: seeds reproduce it
    assert not torch.equal(keep_mask(like, 0.1)[0], keep)


def test_dropout_masks_the_gradient_like_the_output_and_is_off_in_eval():
    x = torch.randn(64, 64, requires_grad=True)
    torch.manual_seed(1)
    y = dropout(x, 0.3, training=True)
    y.sum().backward()
    kept = y != 0
    assert torch.allclose(y[kept], x[kept] / (1 - 0.3), rtol=1e-4)
    assert torch.equal(x.grad != 0, kept)
    assert torch.allclose(x.grad[kept], torch.full_like(x.grad[kept], 1 / (1 - 0.3)), rtol=1e-4)
    assert dropout(x, 0.3, training=False) is x


def test_cpu_attention_with_dropout_is_sdpa_arithmetic_with_the_mask():
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    torch.manual_seed(5)
    out = causal_attention(q, k, v, dropout_p=0.2)
    torch.manual_seed(5)
    keep, scale = keep_mask(torch.empty(6, 8, 8), 0.2)
    scores = (q @ k.transpose(-2, -1)) / 2  # head size 4
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    expected = (scores.softmax(-1) * keep.view(2, 3, 8, 8) * scale) @ v
    assert torch.allclose(out, expected, atol=1e-6)
    no_dropout = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(causal_attention(q, k, v, dropout_p=0.0), no_dropout)
