"""The process group: who this process is, which device it drives, and a clean exit.

Under torchrun (RANK, WORLD_SIZE, ... in the environment) every rank joins through the env://
rendezvous. Without it (`python main.py`) the process is a world of one, with an in-memory store,
so the rest of the code runs the same collectives either way.
"""
import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, computed once."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only rank that logs progress and writes snapshots."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: does once-per-machine work such as fetching data."""
        return self.local_rank == 0

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed() -> DistEnv:
    """Join the process group: NCCL when CUDA is available, else gloo; one device per rank."""
    launched = launched_by_torchrun()
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    device = _pick_device(local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if launched:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
        device=device,
        backend=backend,
    )


@contextmanager
def distributed_session() -> Iterator[DistEnv]:
    """Init the process group, and on the way out wait for every rank then tear it down.

    On an error the barrier is skipped (the other ranks may never reach it; torchrun stops them),
    so a failing rank exits at once instead of hanging.
    """
    env = init_distributed()
    try:
        yield env
        dist.barrier()
    finally:
        # Free what the session built (FSDP keeps tensors referenced by gloo's pending work) while
        # the process group and the interpreter are alive: freed later, at interpreter shutdown,
        # they can abort the process ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


def barrier() -> None:
    dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks, in place, and return it."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_objects(obj: object) -> list:
    """Every rank's obj, in rank order, on every rank."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
