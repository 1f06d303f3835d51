"""process_group.py: the backends a rank joins with, its device, and the collective timeout."""
import pytest
import torch
import torch.distributed as dist

from mingpt.distributed import process_group
from mingpt.reporting.errors import MinGPTError


def test_cuda_ranks_get_a_cpu_backend_beside_nccl():
    """FSDP's CPU offload all-reduces CPU tensors (gradient norms for clipping): a plain "nccl"
    group has no backend for them."""
    backends = dict(part.split(":") for part in process_group.backend_for(torch.device("cuda")).split(","))
    assert backends == {"cuda": "nccl", "cpu": "gloo"}
    assert process_group.backend_for(torch.device("cpu")) == "gloo"


def test_more_ranks_than_gpus_is_refused_up_front(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(MinGPTError, match=r"2 processes on this machine but 1 GPU\(s\) visible.*"
                                          r"--nproc_per_node=1"):
        process_group._pick_device(local_rank=1, local_world_size=2)


def test_the_collective_timeout_comes_from_the_caller():
    env = process_group.init_distributed(timeout_s=123)
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout.total_seconds() == 123
        assert env.world_size == 1 and env.backend == ("nccl" if torch.cuda.is_available() else "gloo")
    finally:
        dist.destroy_process_group()
