"""distributed/cpu_collectives.py: the block-sized buffers FSDP2's collectives on CPU ranks hand out
again. The collectives themselves, on real ranks: tests/distributed/test_parallel.py (FSDP with
cpu_collectives against DDP, step by step, and its gradient syncs counted by
tests/workers/grad_sync_probe.py)."""
import torch

from mingpt.distributed.cpu_collectives import HostBuffers


def storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_host_buffers_hand_a_buffer_out_again_only_once_nothing_refers_to_it():
    """FSDP's collectives on the CPU reuse their block-sized buffers (cpu_collectives.HostBuffers): a
    buffer still held, even only through a view of it or a pending work, must not be handed out."""
    buffers = HostBuffers()
    first = buffers.get(1000, torch.float32)
    second = buffers.get(1000, torch.float32)
    assert storage_of(second) != storage_of(first), "a buffer in use was handed out again"
    kept = storage_of(first)
    view = first[10:20]
    del first
    assert storage_of(buffers.get(1000, torch.float32)) != kept, "handed out while a view of it lived"
    del view
    assert storage_of(buffers.get(1000, torch.float32)) == kept, "a released buffer was not reused"
    assert buffers.get(1000, torch.bfloat16).dtype == torch.bfloat16
    assert buffers.get(500, torch.float32).numel() == 500
