"""A rank's training state placed for its run: what the Trainer trains, from the model that main.py
built on the meta device (start_up.place_model reads the keys).

The plan comes first: the step this rank will take is traced and its peak held against the device's
memory (memory.py), so that a run that cannot fit is refused before anything is allocated. Then the
model is wrapped for its method (parallel.py: each rank fills in only its shards under FSDP), its
optimizer built for the wrapped parameters (AdamW, or Muon: distributed/muon.py), and the grad scaler
and autocast that the run's precision needs. Under fault tolerance the replica group decides how its
own ranks hold the model and adds its gradient averaging and commit (distributed/fault_tolerance.py).
"""
import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from mingpt.distributed import parallel
from mingpt.distributed.activation_checkpointing import checkpoint_blocks
from mingpt.distributed.fault_tolerance import Replicas
from mingpt.distributed.muon import optimizer_for
from mingpt.distributed.parallel import ParallelKeys, Parallelism
from mingpt.distributed.precision import Precision
from mingpt.distributed.process_group import DistEnv
from mingpt.optimizer import OptimizerConfig
from mingpt.planning.memory import MemoryPlan, Placement, check_memory, plan_memory


@dataclass
class PlacedModel:
    """What one rank trains, and how its steps compute."""

    model: nn.Module
    """Wrapped for the method (DDP, FSDP2), holding this rank's part of the parameters."""
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    """fp16's loss scaling; a scaler that does nothing otherwise."""
    precision: Precision
    autocast: Callable[[], contextlib.AbstractContextManager]
    """The forward pass's precision: none where FSDP's mixed precision casts already."""
    memory: MemoryPlan
    """The step's planned peak, checked against the device at start-up."""
    parallelism: Parallelism
    """How this rank's model is wrapped (under fault tolerance, how its replica group holds it)."""
    optimizer_config: OptimizerConfig
    """What the optimizer was built from, with the learning-rate schedule the Trainer follows."""
    replicas: Replicas
    """Under fault tolerance, this replica group's part in the run (its gradients averaged with the
    other groups', its optimizer's steps committed); alone, a part that changes nothing."""


def place(model: nn.Module, placement: Placement, precision: Precision, keys: ParallelKeys, batch_size: int,
          optimizer_config: OptimizerConfig, env: DistEnv, replicas: Replicas) -> PlacedModel:
    """Check that the training state of `placement` fits at batch_size, then place the meta-device
    model, its optimizer and its grad scaler on this rank."""
    precision.configure_matmuls()
    checkpoint_blocks(model, keys.activation_checkpointing)  # before wrapping: FSDP's hooks go outside
    memory = plan_memory(model.config, placement, batch_size, keys.activation_checkpointing, env)  # traced
    check_memory(memory, env)  # before anything is allocated
    parallelism = Parallelism(replicas.method_within_group(placement.method), placement.cpu_offload,
                              placement.reshard_after_forward, cpu_collectives=env.backend == "gloo")
    wrapped = parallel.parallelize(model, parallelism, precision, env, compile=keys.compile,
                                   comm_hook=replicas.comm_hook)
    optimizer = replicas.committing(optimizer_for(wrapped, optimizer_config))
    fsdp_casts = parallel.computes_in_precision(wrapped)  # then autocast would only add casts
    return PlacedModel(wrapped, optimizer, parallel.grad_scaler(wrapped, precision, env), precision,
                       contextlib.nullcontext if fsdp_casts else precision.autocast, memory, parallelism,
                       optimizer_config, replicas)
