"""Will the training state fit? Estimated before anything is allocated, and refused in one line
rather than killed by the system half-way through start-up.

The estimate covers what a rank holds for the whole run: parameters, gradients and AdamW's two
moments, each a copy of the parameters in their dtype (fp32 here: 16 bytes per parameter; mixed
precision casts for compute and keeps these in fp32). DDP with more than one rank adds its
gradient buckets, a fifth copy (DistributedDataParallel's gradient_as_bucket_view documents that
its buckets hold as much as the gradients). FSDP divides all of it by the ranks that shard it.
Activations, the blocks FSDP gathers while computing them, and torch's own working memory are
not counted: they depend on the batch, and the check is meant to refuse only what cannot fit
even before them.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch

from mingpt.distributed.process_group import DistEnv, all_gather_objects
from mingpt.reporting.errors import ConfigError

ADAMW_COPIES = 4
"""Parameters, gradients, exp_avg and exp_avg_sq."""


def state_bytes_per_rank(parameter_bytes: int, method: str, world_size: int, local_world_size: int) -> int:
    """Bytes of parameters, gradients and AdamW state one rank holds under method."""
    copies = ADAMW_COPIES + (1 if method == "ddp" and world_size > 1 else 0)  # DDP's buckets
    shards = {"ddp": 1, "fsdp": world_size, "hsdp": local_world_size}[method]  # hsdp: within a node
    return math.ceil(parameter_bytes * copies / shards)


@dataclass(frozen=True)
class MemoryPlan:
    """What this rank's training state needs, against what the memory it lives in has free."""

    method: str
    per_rank: int
    """Bytes of training state per rank (state_bytes_per_rank)."""
    sharers: int
    """Ranks of this machine drawing on the same memory: all of them for host memory, 1 for a GPU."""
    memory: str
    """Where the state lives: "host memory" or a GPU's, such as "cuda:0 memory"."""
    available: Optional[int]
    """Bytes free there now; None where this system does not say (no /proc/meminfo)."""

    @property
    def needed(self) -> int:
        return self.per_rank * self.sharers

    @property
    def fits(self) -> bool:
        return self.available is None or self.needed <= self.available

    def describe(self) -> str:
        machine = f", {gb(self.needed)} for the {self.sharers} ranks on this machine"
        share = machine if self.sharers > 1 else ""
        free = "unknown" if self.available is None else gb(self.available)
        return (f"about {gb(self.per_rank)} per rank for parameters, gradients and AdamW state{share} "
                f"(before activations); {free} of {self.memory} available")


def gb(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.1f} MB"


def plan_memory(parameter_bytes: int, method: str, cpu_offload: bool, env: DistEnv) -> MemoryPlan:
    """The plan for this rank: its state in GPU memory, or in host memory shared with the other
    ranks of this machine (on a CPU-only machine, or with FSDP's CPU offload)."""
    per_rank = state_bytes_per_rank(parameter_bytes, method, env.world_size, env.local_world_size)
    if env.device.type == "cuda" and not cpu_offload:
        free, _ = torch.cuda.mem_get_info(env.device)
        return MemoryPlan(method, per_rank, 1, f"{env.device} memory", free)
    return MemoryPlan(method, per_rank, env.local_world_size, "host memory", host_memory_available())


def host_memory_available() -> Optional[int]:
    """MemAvailable from /proc/meminfo (Linux): what can be allocated without swapping."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def check_memory(plan: MemoryPlan, env: DistEnv) -> None:
    """Refuse to start if this rank's plan, or any other rank's, cannot fit: the plans are gathered
    so that every rank stops with the same line, rather than some waiting for the ones that did."""
    check_fits(all_gather_objects(plan) if env.world_size > 1 else [plan])


def check_fits(plans: list[MemoryPlan]) -> None:
    """A ConfigError naming the distributed method for the first plan that does not fit."""
    short = next((plan for plan in plans if not plan.fits), None)
    if short is not None:
        raise ConfigError("trainer_config.distributed_method",
                          f"{short.method} needs {short.describe()}; {advice(short)}")


def advice(plan: MemoryPlan) -> str:
    if plan.method == "ddp":
        return "use distributed_method=fsdp, more ranks, or a smaller model"
    if plan.memory != "host memory":
        return "use more ranks, cpu_offload=True, or a smaller model"
    return "use more ranks (on more machines) or a smaller model"
