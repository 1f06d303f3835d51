"""FSDP2 on CPU ranks (gloo), close to DDP's speed: switched on by Parallelism.cpu_collectives.

On a GPU, FSDP2 overlaps its collectives with computation through CUDA streams, and NCCL's
collectives are fast. On the CPU neither holds. Three changes, measured in docs/performance.md
("FSDP and DDP on CPU ranks") and bench/results/fsdp_*.json: each block's all-gather issued one
block ahead, so gloo's threads fetch it while the training thread computes; all-gathers and
reduce-scatters made of gloo's faster all_to_all; and the block-sized buffers these need kept and
handed out again.
"""
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn


def overlap_and_reuse(model: nn.Module) -> None:
    """All three changes, on a model sharded by fully_shard (its blocks, then the root)."""
    prefetch_while_computing(model)
    collectives_through_all_to_all(model)


def prefetch_while_computing(model: nn.Module) -> None:
    """Start each block's all-gather while the block before it (in the backward pass: after it)
    computes, instead of when the block itself starts.

    On a GPU FSDP2 overlaps by itself: its all-gathers run on their own CUDA stream. On the CPU
    there are no streams, and every all-gather is issued and waited for in the training thread, so
    each block waits for its parameters. gloo runs a collective on its own threads: issued with
    async_op (FSDP2's unshard_async_op) one block ahead, it proceeds while the training thread
    computes. The reduce-scatter of gradients stays synchronous (FSDP2 has no async form of it).
    unshard_async_op has only a private setter in torch 2.13; without it the prefetch still runs,
    synchronously, and costs nothing.
    """
    blocks = list(model.blocks)
    model.set_modules_to_forward_prefetch(blocks[:1])  # the root's forward starts the first block's
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])
    for block, preceding in zip(blocks[1:], blocks):
        block.set_modules_to_backward_prefetch([preceding])
    if hasattr(model, "_set_unshard_async_op"):
        model._set_unshard_async_op(True)


def collectives_through_all_to_all(model: nn.Module) -> None:
    """Gather parameters and reduce gradients with gloo's all_to_all, in reused buffers.

    gloo's all_to_all moves the bytes of an all-gather or a reduce-scatter in half the time of its
    own all_gather and reduce_scatter (docs/performance.md): an all-gather is an all_to_all of N
    copies of this rank's shard, a reduce-scatter an all_to_all of the N parts followed by a local
    sum (or mean) of the N parts received, the same numbers gloo adds. The buffers these need are
    as large as a block and are needed again by every block of every step: fresh ones would come
    from new pages of the system, which the kernel faults in and zeroes on first touch, so they are
    kept and reused (HostBuffers). (FSDP2's custom-collective hooks, torch 2.8 and later; older
    versions keep gloo's own.)"""
    if AllToAllGather is None or not hasattr(model, "set_custom_all_gather"):
        return
    buffers = HostBuffers()
    gather, reduce = AllToAllGather(buffers), AllToAllReduceScatter(buffers)
    for module in (model, *model.blocks):
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(reduce)


class HostBuffers:
    """Flat tensors handed out again once nothing refers to them any more.

    Each request gets a new tensor object, a view of a kept buffer: whoever holds it (FSDP's state,
    a pending gloo work, a view of it) holds the buffer's storage. A buffer is free when its storage
    has no user but the pool's own tensor, read from torch's reference counts (private, as used
    inside torch itself); where they are missing every request gets a new tensor, as without the
    pool."""

    def __init__(self):
        self._kept: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        kept = self._kept.setdefault((numel, dtype), [])
        free = next((buffer for buffer in kept if _unreferenced(buffer)), None)
        if free is None:
            free = torch.empty(numel, dtype=dtype)
            if _COUNTS_REFERENCES:
                kept.append(free)
        return free.view(numel)


_COUNTS_REFERENCES = hasattr(torch._C, "_storage_Use_Count")


def _unreferenced(buffer: torch.Tensor) -> bool:
    storage = buffer.untyped_storage()  # itself a user of the storage, besides the buffer
    return torch._C._storage_Use_Count(storage._cdata) == 2


try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class AllToAllGather(AllGather):
        """An all-gather made of one all_to_all: every rank sends its shard to every rank."""

        def __init__(self, buffers: HostBuffers):
            self.buffers = buffers

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.buffers.get(math.prod(size), dtype)  # the gathered block, copied out by FSDP

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, async_op: bool = False) -> Optional[dist.Work]:
            # input_tensor is this rank's slot of output_tensor: what is sent must not alias it.
            copies = self.buffers.get(output_tensor.numel(), output_tensor.dtype)
            copies.view(group.size(), -1).copy_(input_tensor.expand(group.size(), -1))
            return dist.all_to_all_single(output_tensor, copies, group=group, async_op=async_op)

    class AllToAllReduceScatter(ReduceScatter):
        """A reduce-scatter made of one all_to_all (rank r receives everyone's part r) and a sum."""

        def __init__(self, buffers: HostBuffers):
            self.buffers = buffers

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            # The block's gradients, and their reduced shard, which FSDP keeps as the sharded
            # gradient: the pool hands that buffer out again once the optimizer has let it go.
            return self.buffers.get(math.prod(size), dtype)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, op, async_op: bool = False) -> None:
            if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # FSDP's two for fp32 and bf16
                dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
                return
            received = self.buffers.get(input_tensor.numel(), input_tensor.dtype)
            dist.all_to_all_single(received, input_tensor, group=group)
            parts = received.view(group.size(), -1)
            if op == dist.ReduceOp.AVG:
                torch.mean(parts, dim=0, out=output_tensor)
            else:
                torch.sum(parts, dim=0, out=output_tensor)
except ImportError:  # torch before 2.8: FSDP2 without custom collectives
    AllToAllGather = AllToAllReduceScatter = None
