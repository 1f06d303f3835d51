"""Autoregressive sampling from a GPT, kept out of model.py so that the model stays a plain network.

    from sampling import sample
    generator = torch.Generator().manual_seed(1337)
    ids = sample(model, prompt_ids, max_new_tokens=500, temperature=0.8, top_k=40, generator=generator)

Each step feeds the last block_size tokens (B, T <= block_size) to the model, turns the logits of
the last position into a distribution and draws one token from it.

Greedy decoding: temperature=0 takes the most likely token at every step (argmax) and never draws
from the generator. top_k=1 gives the same tokens by the ordinary route (one candidate left), so
both spellings of "greedy" agree. Ties go to the lowest token id, as torch.argmax does.
"""
from typing import Optional

import torch
import torch.nn as nn


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


@torch.no_grad()
def sample(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """idx (B, T) followed by max_new_tokens sampled ids: (B, T + max_new_tokens).

    The model runs in eval mode (no dropout) and is put back in the mode it was in. The generator
    must live on idx's device; the same generator state gives the same tokens.
    """
    check_sampling_args(max_new_tokens, temperature, top_k)
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"idx must be (B, T) with T >= 1 token to continue from, "
                         f"got shape {tuple(idx.shape)}")
    block_size = model.config.block_size
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = idx[:, -block_size:]  # the model has positions for block_size tokens only
            logits, _ = model(context)
            idx = torch.cat([idx, next_token(logits[:, -1, :], temperature, top_k, generator)], dim=1)
    finally:
        model.train(was_training)
    return idx
