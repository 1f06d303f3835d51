"""How the model is spread over the ranks, and how its full state is gathered and restored.

Full state dicts go through torch.distributed.checkpoint's state_dict API for every method, so a
snapshot holds the same thing whoever wrote it: unprefixed parameter names, and optimizer state
keyed by parameter name rather than by position.
"""
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from process_group import DistEnv

METHODS = ("ddp", "fsdp")

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_RESTORE = StateDictOptions(full_state_dict=True)


def parallelize(model: nn.Module, method: str, env: DistEnv) -> nn.Module:
    """Move the model to this rank's device and wrap it for data-parallel training.

    A world of one needs no wrapper: DDP would only add bucket copies to every step.
    """
    model = model.to(env.device)
    if method != "ddp":
        raise NotImplementedError(f"distributed_method={method}")
    if env.world_size == 1:
        return model
    return DDP(model, device_ids=[env.device] if env.device.type == "cuda" else None)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside whatever wrapper parallelize() put around it."""
    return model.module if isinstance(model, DDP) else model


def gather_full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full model and optimizer state as CPU tensors. Every rank must call; rank 0's is complete."""
    return get_state_dict(model, optimizer, options=_GATHER)


def restore_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict
) -> None:
    """Load full state (as gathered above) into this rank's part of the model and optimizer."""
    set_model_state_dict(model, model_state, options=_RESTORE)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=_RESTORE)
