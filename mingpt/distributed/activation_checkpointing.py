"""Activation checkpointing: keep each transformer block's input, recompute the rest in the backward pass.

Without it autograd holds every block's intermediate tensors (attention scores and weights, the 4x
wide MLP activations, dropout masks) from the forward pass until the backward pass uses them; with
`full`, only each block's input is held, and the block's forward pass runs again, block by block,
during the backward pass: about a third more compute for a fraction of the activation memory.

The mechanism is torch.utils.checkpoint, non-reentrant, around each block's own forward method, set
on the block instance before the Trainer wraps the model. Nothing is wrapped or renamed, so
parameter names and snapshots stay as they are. FSDP's hooks stay outside it: its pre-backward hook
gathers a block's parameters when the gradient reaches the block's output, before the first saved
tensor is asked for, so the recomputation runs with the gathered parameters (see
torch/distributed/fsdp/_fully_shard/_fsdp_state.py, _pre_backward). The RNG state is saved with
each block's input and restored for its recomputation, so dropout draws the same masks twice
(model.py's CPU dropout draws from torch's default generator, which checkpoint saves); autocast's
state is restored the same way.
"""
import functools
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

CHECKPOINTING_MODES = ("none", "full")


def checkpoint_blocks(model: nn.Module, mode: str) -> None:
    """Make each of model.blocks recompute its activations in the backward pass (mode `full`).

    Call it on the unwrapped model, before DDP or FSDP wraps it and before torch.compile."""
    if mode == "none":
        return
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False,
                                          preserve_rng_state=True)


class SavedActivations:
    """Bytes of the tensors autograd keeps for the backward pass, counted as they are saved.

    Each storage counts once, whole (q, k and v are views of one qkv output; a tensor saved by
    two operations is held once). Parameters are not activations: a saved parameter, a view of one
    (a Linear saves its weight transposed), FSDP's gathered copy of one (a leaf too) or autocast's
    low-precision copy of one are left out.

    Inside a checkpointed block, checkpoint's own hooks take the tensors (and keep none of them:
    they are recomputed), so these hooks do not see them. What checkpoint does keep, the block's
    input, it saves with torch's saved-tensor mechanism before its hooks start, and these count
    it: so the sum is all the activation memory held between the forward and the backward pass.
    Not counted: checkpoint's copy of the RNG state, 5 KB per block on the CPU.
    """

    def __init__(self) -> None:
        self._bytes_by_storage: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self._bytes_by_storage.values())

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(tensor):
            storage = tensor.untyped_storage()
            # Saved tensors stay alive until the backward pass: no two share an address meanwhile.
            self._bytes_by_storage[storage.data_ptr()] = storage.nbytes()
        return tensor


def _is_parameter(tensor: torch.Tensor) -> bool:
    base = tensor if tensor._base is None else tensor._base
    if base.is_leaf:
        return base.requires_grad  # a parameter; other leaves (masks, token ids) are activations
    if base.grad_fn.name() != "ToCopyBackward0":
        return False
    source = base.grad_fn.next_functions[0][0]
    return hasattr(source, "variable")  # an AccumulateGrad node: a cast of a parameter


@contextmanager
def saved_activations() -> Iterator[SavedActivations]:
    """Count what autograd saves for backward in the forward pass run inside (run only the forward
    pass inside: the backward pass frees what it saved, and a freed address may be reused)."""
    saved = SavedActivations()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        yield saved
