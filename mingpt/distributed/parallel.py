"""How the model is spread over the ranks, and how its full state is gathered and restored.

- ddp: every rank holds the whole model; DDP all-reduces gradients during the backward pass.
- fsdp: FSDP2 (`fully_shard`) on each transformer block, then on the root: each rank holds
  1/world of every parameter, gradient and optimizer state, and gathers a block's parameters only
  while it computes with them. Mixed precision is FSDP's own policy (parameters cast for compute,
  gradients reduced in fp32), so no autocast is needed around the forward pass.
- hsdp: the same, on a 2-D mesh (nodes x ranks per node): each node holds one sharded copy, so
  a rank holds 1/ranks-per-node; the all-gathers and reduce-scatters stay within a node, and only
  an all-reduce of each gradient shard crosses nodes. Everything else is as for fsdp: the sharded
  methods (SHARDED_METHODS, is_sharded) share one code path.

The model may arrive on the meta device (main.py builds it there: shapes, no memory). Under FSDP
it is then sharded while still empty and only each rank's shards are allocated and filled, one
parameter at a time from the model's own initial_value: no rank ever holds the whole model. Under
DDP every rank fills a whole copy with the same values. Either way the initial weights depend only
on the seed, not on the method or the world size.

Full state dicts go through torch.distributed.checkpoint's state_dict API for every method, so a
snapshot holds the same thing whoever wrote it: unprefixed parameter names, and optimizer state
keyed by parameter name rather than by position. That is what lets DDP resume FSDP's snapshots,
and any world size resume any other's.
"""
import contextlib
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt.common.errors import KeyGroup, check, check_choice
from mingpt.distributed.activation_checkpointing import CHECKPOINTING_MODES
from mingpt.distributed.cpu_collectives import overlap_and_reuse
from mingpt.distributed.precision import AMP_DTYPES, Precision
from mingpt.distributed.process_group import DistEnv, all_gather_objects, grid_groups

METHODS = ("ddp", "fsdp", "hsdp")
SHARDED_METHODS = ("fsdp", "hsdp")
"""The methods that shard parameters, gradients and optimizer state with FSDP2 (fully_shard)."""


def check_sharding_options(method: str, cpu_offload: bool, reshard_after_forward: bool) -> None:
    """The options of sharded methods are refused under DDP (they would silently do nothing)."""
    sharded = method in SHARDED_METHODS
    check(not cpu_offload or sharded, "trainer_config.cpu_offload",
          "offloads shards; set trainer_config.distributed_method=fsdp or hsdp, or cpu_offload=False")
    check(reshard_after_forward or sharded, "trainer_config.reshard_after_forward",
          "applies to sharded methods; set trainer_config.distributed_method=fsdp or hsdp, or leave it True")


@dataclass
class ParallelKeys(KeyGroup):
    """TrainerConfig's keys of how the model is placed and computed, beyond the original's use_amp
    (trainer.py)."""

    distributed_method: str = "ddp"
    """ddp (a whole model per rank), fsdp (sharded over all ranks) or hsdp (sharded within each
    node, replicated across nodes; needs 2 or more nodes with as many ranks each)."""
    cpu_offload: bool = False
    """fsdp or hsdp only: keep parameters (and optimizer state) in CPU memory."""
    amp_dtype: str = "float16"
    """On CUDA: float16 (with a GradScaler, the original's) or bfloat16. CPUs use bfloat16."""
    reshard_after_forward: bool = True
    """fsdp or hsdp only: free each block's gathered parameters after its forward pass (the least
    memory); False keeps them until the backward pass, one all-gather fewer per block and step."""
    activation_checkpointing: str = "none"
    """none, or full: keep only each transformer block's input for the backward pass and recompute
    the block's activations there (about a third more compute for much less activation memory)."""
    compile: bool = False
    """torch.compile the model (a large speed-up on recent GPUs; first steps wait for compilation). Off by
    default: on a CPU it measured 0.94x to 1.06x of eager with 12 to 24 s of compiling
    (docs/performance.md, torch.compile on a CPU)."""

    def __post_init__(self) -> None:
        check_choice(self, "trainer_config", "distributed_method", METHODS)
        check_sharding_options(self.distributed_method, self.cpu_offload, self.reshard_after_forward)
        check_choice(self, "trainer_config", "amp_dtype", AMP_DTYPES)
        check_choice(self, "trainer_config", "activation_checkpointing", CHECKPOINTING_MODES)
        super().__post_init__()  # the next group's checks (TrainerConfig's bases)
HSDP_MESH_DIMS = ("replicate", "shard")  # across nodes, within a node

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_RESTORE = StateDictOptions(full_state_dict=True)


@dataclass(frozen=True)
class Parallelism:
    method: str
    """ddp, fsdp or hsdp."""
    cpu_offload: bool = False
    """Sharded methods only: parameters, gradients and optimizer state live in CPU memory."""
    reshard_after_forward: bool = True
    """Sharded methods only: free each block's gathered parameters after its forward pass and
    gather them again for its backward pass (the least memory), or keep them until then."""
    cpu_collectives: bool = False
    """Sharded methods only: the CPU's own collectives (cpu_collectives.py), for gloo on CPU ranks;
    the Trainer sets it where the device is the CPU. GPUs run FSDP2 as torch does."""


def parallelize(model: nn.Module, parallelism: Parallelism, precision: Precision, env: DistEnv,
                compile: bool = False, comm_hook: Optional[Callable[[nn.Module], None]] = None) -> nn.Module:
    """Put the model on this rank's device and wrap it for data-parallel training.

    model: built on the meta device, to be materialised here (each rank only its part under FSDP),
    or already initialised (tests and benchmarks build it so), to be moved or sharded as it is.
    compile: torch.compile in place (parameter names, and so snapshots, stay as they are), on the
    module the wrapper will hold, as torch's documentation advises: the whole model under DDP; each
    transformer block under FSDP, before it is sharded, so that FSDP's all-gather and reduce-scatter
    hooks run around compiled blocks rather than inside one compiled graph.
    comm_hook: makes the wrapped model average its gradients across replica groups too (fault
    tolerance's: fault_tolerance.py), DDP's communication hook or FSDP's all-reduce hook. With one, a
    world of one rank is wrapped in DDP too.
    """
    if parallelism.method in SHARDED_METHODS:
        if compile:
            for block in model.blocks:
                block.compile()
        sharded = _shard(model, parallelism, precision, env)
        if comm_hook is not None:
            comm_hook(sharded)
        return sharded
    if compile:
        model.compile()
    if on_meta(model):
        materialize(model, env.device)
    else:
        model = model.to(env.device)
    if env.world_size == 1 and comm_hook is None:
        return model  # nothing to synchronise: DDP would only add bucket copies to every step
    ddp = DDP(model, device_ids=[env.device] if env.device.type == "cuda" else None)
    if comm_hook is not None:
        comm_hook(ddp)
    return ddp


def _shard(model: nn.Module, parallelism: Parallelism, precision: Precision, env: DistEnv) -> nn.Module:
    mesh = sharding_mesh(parallelism.method, env)
    mixed_precision = MixedPrecisionPolicy(param_dtype=precision.amp_dtype, reduce_dtype=torch.float32)
    # Pinned host memory needs an accelerator; on a CPU-only machine plain memory is the only kind.
    cpu_offload = parallelism.cpu_offload
    offload = CPUOffloadPolicy(pin_memory=env.device.type == "cuda") if cpu_offload else OffloadPolicy()
    empty = on_meta(model)
    if not cpu_offload and not empty:
        model = model.to(env.device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mixed_precision, offload_policy=offload,
                    reshard_after_forward=parallelism.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mixed_precision, offload_policy=offload)
    allow_a_view_of_the_logits(model)
    if empty:
        materialize(model, torch.device("cpu") if cpu_offload else env.device)
    if parallelism.cpu_collectives:
        overlap_and_reuse(model)
    return model


def allow_a_view_of_the_logits(model: FSDPModule) -> None:
    """Silence FSDP2's warning that the sharded GPT returns a view, on every rank of every run.
    GPT.forward cuts the vocabulary's padding off its logits as a view, logits[..., :vocab_size],
    since a copy would take B x T x V more memory. FSDP2 warns of any view a module returns because an
    in-place op on it (`logits += ...`) would drop the pre-backward hook it puts on it; nothing
    modifies the returned logits in place (the Trainer takes the loss alone, computed from the whole
    logits, and backward starts from it). The filter matches this model's warning only: the same
    warning of another module, or any other warning, is still said."""
    warnings.filterwarnings("ignore", category=UserWarning, message=re.escape(
        f"FSDP2-wrapped module ({type(model).__name__}) returned a view tensor"))


def sharding_mesh(method: str, env: DistEnv) -> DeviceMesh:
    """The ranks fully_shard spreads the model over. fsdp: all of them, in one dimension (the
    default group). hsdp: one row per node (torchrun numbers each node's ranks consecutively);
    given a 2-D mesh, fully_shard shards along each row and replicates down the columns. The
    groups come from process_group, with the run's timeout (init_device_mesh would give its own
    groups torch's default)."""
    if method == "fsdp":
        return DeviceMesh.from_group(dist.group.WORLD, env.device.type)
    # Every rank learns every node's size (one small all-gather), so that all refuse alike.
    check_nodes_for_hsdp(all_gather_objects(env.local_world_size))
    return hsdp_mesh(env, env.num_nodes, env.local_world_size)


def hsdp_mesh(env: DistEnv, nodes: int, ranks_per_node: int) -> DeviceMesh:
    node, across_nodes = grid_groups(env, nodes, ranks_per_node)
    return DeviceMesh.from_group([across_nodes, node], env.device.type,
                                 mesh=torch.arange(env.world_size).view(nodes, ranks_per_node),
                                 mesh_dim_names=HSDP_MESH_DIMS)


def check_nodes_for_hsdp(ranks_per_node: list[int]) -> None:
    """HSDP needs two or more nodes with as many ranks each: a rectangle of ranks.

    ranks_per_node: for each rank, the number of ranks on its node (its LOCAL_WORLD_SIZE)."""
    key = "trainer_config.distributed_method"
    sizes = sorted(set(ranks_per_node))
    check(len(sizes) == 1, key, f"hsdp needs the same number of ranks on every node, got nodes of "
          f"{' and '.join(map(str, sizes))} ranks; start as many on each (torchrun --nproc_per_node)")
    check(len(ranks_per_node) > sizes[0], key, "hsdp shards within a node and replicates across nodes, "
          "and this run has one node; on one node use fsdp")


def is_sharded(model: nn.Module) -> bool:
    """Whether parallelize() sharded the model with FSDP2: fsdp and hsdp alike."""
    return isinstance(model, FSDPModule)


def on_meta(model: nn.Module) -> bool:
    """True for a model built on the meta device: shapes without memory, to be materialised."""
    return any(param.is_meta for param in model.parameters())


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate a meta-built model's parameters on device and fill each with its initial value
    (model.initial_value), one parameter at a time.

    A sharded parameter (FSDP's DTensor) gets this rank's shard only: the rows it holds
    (local_rows) are asked for, so a rank's peak is its shards plus one parameter (a random one
    is drawn whole, then cut; a pretrained model's rows are read alone). Parameters only: to_empty
    would leave buffers uninitialised, and the GPT has none.
    """
    if any(True for _ in model.buffers()):
        raise ValueError("materialize() fills parameters only, and this model has buffers")
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            param.to_local().copy_(model.initial_value(name, local_rows(param)))
        else:
            param.copy_(model.initial_value(name))


def local_rows(param: DTensor) -> slice:
    """The rows (dim 0) of the full parameter this rank's shard holds. FSDP2 shards dim 0 as
    torch.chunk does (chunks of ceil(rows / ranks), the last ones shorter or empty), over one mesh
    dimension (fsdp) or the shard dimension of a 2-D mesh (hsdp, replicated along the other)."""
    first, length = 0, param.shape[0]
    for dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if not (placement.is_shard() and placement.dim == 0):
            raise ValueError(f"materialize() fills shards of dim 0 only, not {placement}")
        chunk = -(-length // param.device_mesh.size(dim))
        skipped = min(chunk * param.device_mesh.get_local_rank(dim), length)
        first, length = first + skipped, min(chunk, length - skipped)
    if length != param.to_local().shape[0]:
        raise ValueError(f"a shard of {length} rows where FSDP holds {param.to_local().shape[0]}")
    return slice(first, first + length)


def computes_in_precision(model: nn.Module) -> bool:
    """True when the wrapper casts for compute itself (FSDP's policy), so autocast must stay off."""
    return is_sharded(model)


def grad_scaler(model: nn.Module, precision: Precision, env: DistEnv) -> torch.amp.GradScaler:
    """A loss scaler that is a no-op unless fp16 needs it.

    Under FSDP (and HSDP) each rank sees only its shard of the gradients, so an overflow on one rank
    must skip the step on all of them: ShardedGradScaler all-reduces the overflow flag over the world.
    """
    if is_sharded(model) and precision.needs_grad_scaler:
        return FusedShardedGradScaler(env.device.type, process_group=dist.group.WORLD)
    return torch.amp.GradScaler(env.device.type, enabled=precision.needs_grad_scaler)


class FusedShardedGradScaler(ShardedGradScaler):
    """ShardedGradScaler whose overflow flag the fused AdamW takes, so that a step never waits for
    the host. Without the fused kernel GradScaler reads the flag with .item() to decide whether to
    step: a host sync at every step. The fused kernel needs the flag as GradScaler makes it, and
    ShardedGradScaler's is not: it has shape (1,), which the kernel refuses (it subtracts the flag
    from the 0-d step counts), and unscale_ all-reduces it as a sum over the ranks, so it holds the
    number of ranks whose shard overflowed, while the kernel skips the step only on exactly 1 (on 2
    it applies the inf gradients and the weights turn to NaN). After unscale_ each flag is 0 or 1,
    a 0-d view.
    """

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {device: found_inf.clamp_(max=1.0).reshape(())
                                         for device, found_inf in state["found_inf_per_device"].items()}


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce (DDP), reduce-scatter (FSDP) or both (HSDP) on accumulation
    micro-batches: gradients are then only synchronised once, on the last micro-batch of a step."""
    if enabled:
        return contextlib.nullcontext()
    if isinstance(model, DDP):
        return model.no_sync()
    if is_sharded(model):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside whatever wrapper parallelize() put around it."""
    return model.module if isinstance(model, DDP) else model


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a value a sharded method keeps as a DTensor (clip_grad_norm_'s norm)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a tensor: a sharded (FSDP, HSDP) DTensor's local shard, or itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_bytes(tensors) -> int:
    """Bytes of the tensors this rank holds: a sharded (FSDP, HSDP) tensor counts its local shard only."""
    return sum(local_part(t).numel() * local_part(t).element_size() for t in tensors)


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds: the whole model under DDP, its shards under FSDP
    (1/world) and HSDP (1/ranks per node)."""
    return local_bytes(model.parameters())


def gather_full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full model and optimizer state as CPU tensors. Every rank must call; rank 0's is complete."""
    return get_state_dict(model, optimizer, options=_GATHER)


def restore_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict
) -> None:
    """Load full state (as gathered above, present on every rank) into this rank's part."""
    set_model_state_dict(model, model_state, options=_RESTORE)
    restore_optimizer_state(model, optimizer, optimizer_state, options=_RESTORE)


OPTIMIZER_BUILD_FLAGS = ("fused", "foreach", "capturable", "differentiable")
"""How an optimizer computes its step, chosen for the run that builds it (optimizer.create_optimizer)."""


def restore_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict,
                            options: Optional[StateDictOptions] = None) -> None:
    """Load optimizer state, keeping this run's build flags. Loading restores param_groups whole,
    so a snapshot of an unfused AdamW (CPU offload's mixed devices, or FSDP with fp16 before
    FusedShardedGradScaler) would make a fused run's AdamW unfused while its GradScaler, seeing an
    optimizer built fused, hands it the scale, and the step fails. The flags
    are set before loading: they also decide where loading puts the step counts (on the GPU for
    the fused kernel, on the CPU otherwise)."""
    own = [{key: group[key] for key in OPTIMIZER_BUILD_FLAGS if key in group} for group in optimizer.param_groups]
    groups = [{**group, **flags} for group, flags in zip(state["param_groups"], own)]
    set_optimizer_state_dict(model, optimizer, {**state, "param_groups": groups}, options=options)
