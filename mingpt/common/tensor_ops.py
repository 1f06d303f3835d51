"""Tensor operations the model uses where torch's own cost more on the CPU or are not exact enough:
dropout's mask and causal attention with dropout (a CPU's bernoulli_ is 10% of a step), and the
sampling of the next token (top-k keeping exactly k). model.py's GPT and generate call them; they
know nothing of the model (bench/bench_dropout.py measures them against torch's).
"""
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """F.dropout, with a cheaper mask on the CPU (see keep_mask); GPUs keep F.dropout."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    keep, scale = keep_mask(x, p)
    return x * keep * scale  # autograd keeps the mask for the backward pass


def keep_mask(like: torch.Tensor, p: float) -> tuple[torch.Tensor, float]:
    """A mask in like's shape and dtype, 0 with probability p and 1 otherwise, and 1 / (1 - p).

    The CPU's bernoulli_, behind F.dropout, costs about 7 ns per element: 10% of a training step of
    the default model. Here one 64-bit draw from torch's generator gives four 16-bit numbers, one per
    element, and the mask costs about 1 ns per element. p is rounded to a multiple of 1/65536 (0.1
    becomes 0.100006); the scale uses the rounded p, so the expected output is still the input.
    """
    dropped = min(round(p * 65536), 65535)  # of the 65536 equally likely 16-bit values, drop this many
    words = torch.empty((like.numel() + 3) // 4, dtype=torch.int64).random_(-2**63, None)  # all 64 bits
    numbers = words.view(torch.int16)[: like.numel()].view(like.shape)  # uniform in [-32768, 32767]
    keep = torch.ge(numbers, dropped - 32768, out=torch.empty(like.shape, dtype=like.dtype))
    return keep, 65536 / (65536 - dropped)


class Dropout(nn.Dropout):
    """nn.Dropout through dropout() above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal softmax attention over (B, nh, T, hs) tensors.

    SDPA's fused CPU kernel cannot drop attention weights, so with attention dropout on the CPU SDPA
    falls back to unfused attention with bernoulli_. This is that arithmetic in fewer passes: the
    scale and the causal mask go into the first matmul (baddbmm), and dropout() makes the mask.
    """
    if dropout_p == 0.0 or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    B, nh, T, hs = q.shape
    q, k, v = (t.reshape(B * nh, T, hs) for t in (q, k, v))
    future = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    scores = torch.baddbmm(future, q, k.transpose(1, 2), alpha=1.0 / math.sqrt(hs))  # (B * nh, T, T)
    weights = dropout(scores.softmax(dim=-1), dropout_p, training=True)
    return torch.bmm(weights, v).view(B, nh, T, hs)


def check_sampling_args(max_new_tokens: int, temperature: float, top_k: Optional[int]) -> None:
    """ValueError for settings that have no meaning; callers facing users check these first."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must not be negative, got {max_new_tokens}")
    if not temperature >= 0:  # written so that NaN fails too
        raise ValueError(f"temperature must be 0 (greedy) or positive, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")


def keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits (B, V) with all but the k largest of each row set to -inf.

    Exactly k survive even when values tie at the boundary (a `logits < kth` mask would keep them all).
    """
    k = min(k, logits.size(-1))
    values, indices = torch.topk(logits, k, dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, indices, values)


def next_token(
    logits: torch.Tensor, temperature: float, top_k: Optional[int], generator: Optional[torch.Generator]
) -> torch.Tensor:
    """One token id per row, shape (B, 1), from the last position's logits (B, V)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature  # float32: fp16 logits would overflow at low temperatures
    if top_k is not None:
        logits = keep_top_k(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
