"""Will a run fit? One model of what each rank holds at the peak of a training step, used alike by
the start-up check (start_up.place_model refuses a run that cannot fit before anything is allocated) and by
the planner (plan.py), so that the two never disagree.

What a step holds comes from the project's own step, traced on tensors without memory
(step_trace.py): activations, gradients as the backward pass makes them, autocast's copies of the
parameters. What the method adds is counted here, at every moment of the traced step that can be
the peak, and the largest sum wins:
- parameters: fp32 master weights (4 bytes each; mixed precision casts for compute and keeps
  these), divided by the ranks that shard them (fsdp: all; hsdp: a node's; ddp: none) as FSDP2
  divides them: each parameter's rows in chunks of ceil(rows / ranks), each rank's chunk padded to
  that size (so rank 0 holds the most, and at hundreds of ranks a parameter of fewer rows than ranks
  costs every rank a whole row: 18% above an even share for gpt2 over 512 ranks);
- AdamW's two moments (8 bytes per parameter, of this rank's rows, unpadded) and a step count per
  parameter (4 bytes), sharded alike;
- gradients: fp32, whole under DDP; under FSDP the block being differentiated (and the embeddings
  and head, reduced last) whole in the compute dtype, the others as fp32 shards;
- buffers: DDP's gradient buckets (a fifth fp32 copy: gradient_as_bucket_view is off); FSDP's
  gathered blocks (the one computing and the one prefetched, in the compute dtype; all of them
  between the forward and the backward pass with reshard_after_forward=False), the root module's
  gathered parameters, and the collectives' buffers (on CPU ranks cpu_collectives.py keeps four
  block-sized buffers and every block's gradient shard for the whole run); the host copy of
  async_snapshots (rank 0's whole state for single-file snapshots, each rank's shards for sharded
  ones), which lives in host memory: on a GPU it is counted against the host, not the device.
Gradient accumulation keeps every gradient, unsharded under FSDP, through the later micro-batches.
Not counted: torch's own working memory outside tensors, and what the memory allocator keeps
cached or fragmented (on the CPU, glibc; on a GPU, the caching allocator's reserve); a compiled
model (compile=True) is estimated as it runs uncompiled. bench/bench_plan.py checks the estimate
against measured peaks, bench/bench_check.py the state per rank against ranks simulated at up to 1,024
(plan.py --check), which run their start-up's memory check against the cluster's device (simulating).
"""
import contextlib
from dataclasses import dataclass, replace
from typing import Iterator, Optional

import torch

from mingpt.common.errors import ConfigError
from mingpt.distributed.process_group import DistEnv, all_gather_objects
from mingpt.model import GPTConfig, meta_model
from mingpt.optimizer import hidden_matrices
from mingpt.planning.step_trace import Point, TraceKey, block_parameters, trace_step

FP32 = 4
ADAMW_MOMENTS = 2
CPU_BLOCK_BUFFERS = 4
"""Block-sized buffers cpu_collectives.HostBuffers keeps (measured: any depth, fp32)."""
CPU_ROOT_BUFFERS = 2
"""The same for the root module's parameters (embeddings, final LayerNorm, head)."""


@dataclass(frozen=True)
class Placement:
    """How a run spreads its training state over ranks and devices."""

    method: str
    """ddp, fsdp or hsdp."""
    world_size: int = 1
    ranks_per_node: int = 1
    device_type: str = "cpu"
    compute_dtype: Optional[torch.dtype] = None
    """The low precision of mixed precision; None: fp32."""
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    grad_accum_steps: int = 1
    snapshot_staging: Optional[str] = None
    """async_snapshots' host copy: None (off), "single" (rank 0's whole state) or "sharded"."""
    optimizer: str = "adamw"
    """adamw (two moments per parameter) or muon (one momentum per hidden matrix's, AdamW's two for
    the rest)."""

    @property
    def shards(self) -> int:
        return {"ddp": 1, "fsdp": self.world_size, "hsdp": self.ranks_per_node}[self.method]

    @property
    def sharded(self) -> bool:
        return self.method != "ddp"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the peak of a training step, by what they are."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    host: int = 0
    """Held in host memory instead of the device's (a GPU's CPU offload and snapshot staging)."""

    @property
    def peak(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers

    def describe(self) -> str:
        parts = (("parameters", self.parameters), ("gradients", self.gradients),
                 ("optimizer state", self.optimizer), ("activations", self.activations),
                 ("buffers", self.buffers))
        return ", ".join(f"{name} {gb(size)}" for name, size in parts)


Shapes = tuple[tuple[int, int], ...]
"""Parameters as (rows, elements per row): what FSDP2 shards (dim 0) and what each row holds."""


@dataclass(frozen=True)
class ModelSizes:
    total: int
    per_block: int
    n_layer: int
    hidden: int = 0
    """Parameters of the blocks' weight matrices (what Muon trains, model.hidden_matrices)."""
    block_shapes: Shapes = ()
    """One block's parameters."""
    root_shapes: Shapes = ()
    """The parameters outside the blocks."""

    @property
    def root(self) -> int:
        """Parameters outside the blocks: the embeddings, the final LayerNorm and the head."""
        return self.total - self.n_layer * self.per_block

    @property
    def tensors(self) -> int:
        """Parameter tensors of the whole model."""
        return self.n_layer * len(self.block_shapes) + len(self.root_shapes)

    @property
    def hidden_tensors(self) -> int:
        """The blocks' weight matrices (what Muon trains): a block's parameters with rows and columns
        (its biases and LayerNorms are vectors)."""
        return self.n_layer * sum(width > 1 for _, width in self.block_shapes)

    def shard_bytes(self, shards: int, index: Optional[int] = None, block: bool = False,
                    hidden: Optional[bool] = None) -> int:
        """fp32 bytes of the shards one rank holds of every parameter (block: of one block's; hidden
        True or False: of the blocks' weight matrices only, or of all the others), as FSDP2 cuts them:
        dim 0 in chunks of ceil(rows / shards). index None: the chunk FSDP2 allocates on every rank
        (padded to the full chunk); else the rows shard `index` holds, unpadded (the last shards are
        shorter, or empty, when the rows do not divide)."""
        def rows_of(rows: int) -> int:
            chunk = -(-rows // shards)
            return chunk if index is None else max(0, min(chunk, rows - chunk * index))

        def counted(width: int, in_block: bool) -> bool:
            return hidden is None or hidden == (in_block and width > 1)

        parts = [(self.block_shapes, 1, True)]
        if not block:
            parts = [(self.block_shapes, self.n_layer, True), (self.root_shapes, 1, False)]
        return FP32 * sum(times * rows_of(rows) * width for shapes, times, in_block in parts
                          for rows, width in shapes if counted(width, in_block))


def shapes_of(parameters) -> Shapes:
    return tuple((p.shape[0], p[0].numel()) if p.dim() else (1, 1) for p in parameters)


def model_sizes(config: GPTConfig) -> ModelSizes:
    model = meta_model(config)
    total = sum(p.numel() for p in model.parameters())
    in_blocks = {id(p) for p in model.blocks.parameters()}
    return ModelSizes(total, block_parameters(config), config.n_layer,
                      hidden=sum(p.numel() for p in hidden_matrices(model)),
                      block_shapes=shapes_of(model.blocks[0].parameters()),
                      root_shapes=shapes_of(p for p in model.parameters() if id(p) not in in_blocks))


def optimizer_state(sizes: ModelSizes, placement: Placement) -> int:
    """Bytes of the optimizer's state of the whole model: AdamW's two fp32 moments per parameter and a
    step count per parameter tensor, or Muon's one momentum per hidden matrix's parameter and AdamW's
    two for the rest."""
    if placement.optimizer == "muon":
        return FP32 * (ADAMW_MOMENTS * (sizes.total - sizes.hidden) + sizes.hidden
                       + sizes.tensors - sizes.hidden_tensors)
    return FP32 * (ADAMW_MOMENTS * sizes.total + sizes.tensors)


def sharded_optimizer_state(sizes: ModelSizes, placement: Placement, index: Optional[int] = None) -> int:
    """Bytes of one rank's optimizer state under fsdp or hsdp (index: as shard_bytes'): AdamW's two
    moments of its rows of every parameter and a step count per tensor, or Muon's one momentum of its
    rows of each hidden matrix (distributed/muon.py keeps it sharded as its matrix) and AdamW's state
    for the rest."""
    shards = placement.shards
    if placement.optimizer == "muon":
        adamw_steps = FP32 * (sizes.tensors - sizes.hidden_tensors)
        return (ADAMW_MOMENTS * sizes.shard_bytes(shards, index, hidden=False)
                + sizes.shard_bytes(shards, index, hidden=True) + adamw_steps)
    return ADAMW_MOMENTS * sizes.shard_bytes(shards, index) + FP32 * sizes.tensors


@dataclass(frozen=True)
class RankState:
    """What one rank holds between steps, by the planner: what plan.py --check measures."""

    parameters: int
    gradients: int
    optimizer: int


def rank_state(config: GPTConfig, placement: Placement, rank: int = 0) -> RankState:
    """The fp32 parameters, fp32 gradients and AdamW state that `rank` holds after a step (rank 0
    holds the most). Sharded: FSDP2's padded chunks of parameters and gradients, the optimizer's
    state of this rank's rows; hsdp shards over a node's ranks, by local rank."""
    sizes = model_sizes(config)
    if not placement.sharded:
        whole = FP32 * sizes.total
        return RankState(whole, whole, optimizer_state(sizes, placement))
    index = rank % placement.ranks_per_node if placement.method == "hsdp" else rank
    own = sizes.shard_bytes(placement.shards)
    return RankState(own, own, sharded_optimizer_state(sizes, placement, index))


def estimate_memory(config: GPTConfig, batch_size: int, checkpointing: str,
                    placement: Placement) -> MemoryEstimate:
    """What one rank holds at the peak of a step of this model (vocab_size and block_size set)."""
    casts_parameters = placement.sharded and placement.compute_dtype is not None  # FSDP's policy
    trace = trace_step(TraceKey(config, placement.device_type, placement.compute_dtype, casts_parameters,
                                checkpointing))
    sizes = model_sizes(config)
    at = _sharded_moment if placement.sharded else _ddp_moment
    moments = (at(point, trace.block_gradient_bytes, sizes, batch_size, placement)
               for point in trace.points(config.n_layer))
    return max(moments, key=lambda estimate: estimate.peak)


def _ddp_moment(point: Point, block_gradients: int, sizes: ModelSizes, batch_size: int,
                placement: Placement) -> MemoryEstimate:
    moment, whole = point.moment, FP32 * sizes.total
    made = moment.other_gradients + moment.block_gradients
    gradients = whole + made if placement.grad_accum_steps > 1 else made + point.blocks_done * block_gradients
    buckets = whole if placement.world_size > 1 else 0
    staging = _staging(placement, whole)
    on_host = placement.device_type == "cpu"
    return MemoryEstimate(parameters=whole + moment.casts, gradients=gradients,
                          optimizer=optimizer_state(sizes, placement), activations=moment.at(batch_size),
                          buffers=buckets + (staging if on_host else 0), host=0 if on_host else staging)


def _sharded_moment(point: Point, block_gradients: int, sizes: ModelSizes, batch_size: int,
                    placement: Placement) -> MemoryEstimate:
    moment, shards = point.moment, placement.shards
    own = sizes.shard_bytes(shards)  # rank 0's fp32 shard of all parameters (FSDP2's padded chunks)
    moments = sharded_optimizer_state(sizes, placement)  # rank 0 holds whole chunks: no padding to drop
    compute = _element_size(placement.compute_dtype)
    made = moment.other_gradients + moment.block_gradients
    done = sizes.n_layer if placement.device_type == "cpu" else point.blocks_done  # CPU: kept in the pool
    shard_gradients = done * sizes.shard_bytes(shards, block=True)
    if placement.grad_accum_steps > 1:  # no_sync keeps the unsharded gradients, in fp32
        made, shard_gradients = FP32 * sizes.total + moment.block_gradients, 0
    state = own + shard_gradients + moments  # offloaded to the host with cpu_offload
    offloaded = placement.cpu_offload and placement.device_type != "cpu"
    staging = _staging(placement, own if placement.snapshot_staging == "sharded" else FP32 * sizes.total)
    on_host = placement.device_type == "cpu"
    buffers = _gathered(point, sizes, compute, placement) + _collective_buffers(sizes, compute, placement)
    return MemoryEstimate(
        parameters=0 if offloaded else own, gradients=made + (0 if offloaded else shard_gradients),
        optimizer=0 if offloaded else moments, activations=moment.at(batch_size),
        buffers=buffers + (staging if on_host else 0),
        host=(state if offloaded else 0) + (0 if on_host else staging))


def _gathered(point: Point, sizes: ModelSizes, compute: int, placement: Placement) -> int:
    """Unsharded parameters: the root module's, and the blocks' gathered for computing."""
    if placement.reshard_after_forward:
        blocks = 2  # the one computing and the one prefetched
    elif point.phase == "forward":
        blocks = (point.block + 1) if point.block is not None else sizes.n_layer
    else:  # kept from the forward pass until each block's backward pass is over
        blocks = sizes.n_layer - point.blocks_done
    return compute * (sizes.root + min(blocks, sizes.n_layer) * sizes.per_block)


def _collective_buffers(sizes: ModelSizes, compute: int, placement: Placement) -> int:
    """The all-gathers' and reduce-scatters' flat buffers."""
    if placement.device_type == "cpu":  # kept for the run by cpu_collectives.HostBuffers
        block = (CPU_BLOCK_BUFFERS // 2) * (compute + FP32) * sizes.per_block  # gathers, and fp32 reductions
        shards = placement.shards
        root_shard = sizes.shard_bytes(shards) - sizes.n_layer * sizes.shard_bytes(shards, block=True)
        return block + CPU_ROOT_BUFFERS * FP32 * sizes.root + root_shard
    return (compute + FP32) * sizes.per_block  # a block's all-gather output and reduce-scatter input


def _staging(placement: Placement, state_parameters_bytes: int) -> int:
    """async_snapshots' host copy: parameters and AdamW's two moments (of the whole model, or of
    this rank's shards), for the worst rank (rank 0, which holds a single-file snapshot's all)."""
    if placement.snapshot_staging is None:
        return 0
    return (1 + ADAMW_MOMENTS) * state_parameters_bytes


def _element_size(dtype: Optional[torch.dtype]) -> int:
    return dtype.itemsize if dtype is not None else FP32


def gb(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.1f} MB"


@dataclass(frozen=True)
class MemoryPlan:
    """A rank's estimate against the memory it will live in, with what to change if it cannot fit."""

    method: str
    estimate: MemoryEstimate
    batch_size: int
    sharers: int
    """Ranks of this machine drawing on the same memory: all of them for host memory, 1 for a GPU."""
    memory: str
    """Where the step lives: "host memory" or a GPU's, such as "cuda:0 memory"."""
    available: Optional[int]
    """Bytes free there now; None where this system does not say."""
    host_available: Optional[int] = None
    """Host memory free, for what a GPU run keeps there (CPU offload, snapshot staging)."""
    host_sharers: int = 1
    advice: str = ""
    """What would fit instead (suggest()), filled in when this does not."""

    @property
    def needed(self) -> int:
        return self.estimate.peak * self.sharers

    @property
    def fits(self) -> bool:
        device = self.available is None or self.needed <= self.available
        host = self.host_available is None or self.estimate.host * self.host_sharers <= self.host_available
        return device and host

    def describe(self) -> str:
        estimate = self.estimate
        machine = (f", {gb(self.needed)} for the {self.sharers} ranks on this machine"
                   if self.sharers > 1 else "")
        host = f", and {gb(estimate.host)} of host memory" if estimate.host else ""
        free = "unknown" if self.available is None else gb(self.available)
        return (f"about {gb(estimate.peak)} per rank at the peak of a step of batch_size={self.batch_size} "
                f"({estimate.describe()}){machine}{host}; {free} of {self.memory} available")


def fits_in(available: Optional[int], sharers: int = 1, host_available: Optional[int] = None,
            host_sharers: int = 1):
    """A test of estimates against this much memory, shared by `sharers` ranks."""
    def fits(estimate: MemoryEstimate) -> bool:
        device = available is None or estimate.peak * sharers <= available
        host = host_available is None or estimate.host * host_sharers <= host_available
        return device and host
    return fits


def suggest(config: GPTConfig, batch_size: int, checkpointing: str, placement: Placement, fits) -> str:
    """What would fit instead, in words a user types: another method or checkpointing (the first of
    these that fits, as shown by estimate_memory), or else the largest batch that fits."""
    changes = []
    candidates = [(placement, "full")]
    if placement.method == "ddp" and placement.world_size > 1:
        sharded = replace(placement, method="fsdp")
        candidates += [(sharded, checkpointing), (sharded, "full")]
    if placement.sharded and placement.device_type != "cpu" and not placement.cpu_offload:
        candidates += [(replace(placement, cpu_offload=True), "full")]
    for option, mode in candidates:
        same = (option, mode) == (placement, checkpointing)
        if not same and fits(estimate_memory(config, batch_size, mode, option)):
            changes.append(_in_words(option, mode, placement, checkpointing))
            break
    largest = largest_batch(config, checkpointing, placement, fits, below=batch_size)
    if largest:
        changes.append(f"batch_size <= {largest}")
    if not changes:
        return "use more ranks (on more machines), or a smaller model"
    return "use " + ", or ".join(changes)


def _in_words(option: Placement, mode: str, current: Placement, current_mode: str) -> str:
    words = []
    if option.method != current.method:
        words.append(f"distributed_method={option.method}")
    if option.cpu_offload != current.cpu_offload:
        words.append("cpu_offload=True")
    if mode != current_mode:
        words.append(f"activation_checkpointing={mode}")
    return " with ".join(words)


def largest_batch(config: GPTConfig, checkpointing: str, placement: Placement, fits, below: int) -> int:
    """The largest batch size under `below` whose step fits (0 if not even 1 does)."""
    low, high = 0, below - 1  # low fits (0 trivially); find the largest that fits up to high
    while low < high:
        middle = (low + high + 1) // 2
        if fits(estimate_memory(config, middle, checkpointing, placement)):
            low = middle
        else:
            high = middle - 1
    return low


@dataclass(frozen=True)
class SimulatedDevice:
    """The device a rank simulated on this machine stands for (plan.py --check): its start-up's
    memory check is of a step on that device, in its precision, against its memory."""

    device_type: str
    compute_dtype: Optional[torch.dtype]
    name: str
    """As the plan names it: "H100", "cpu"."""
    memory: Optional[int]
    """Bytes a rank may use there (a GPU's, less what training cannot use; a CPU rank's share)."""
    host_memory: Optional[int] = None
    """Bytes of a node's host memory, for what a GPU run keeps there (None: not checked)."""


_SIMULATED: list[Optional[SimulatedDevice]] = [None]


@contextlib.contextmanager
def simulating(device: SimulatedDevice) -> Iterator[None]:
    """Plan every rank started in this context as a rank of `device` (planning/check.py's ranks,
    which run on this CPU)."""
    _SIMULATED[0] = device
    try:
        yield
    finally:
        _SIMULATED[0] = None


def plan_memory(config: GPTConfig, placement: Placement, batch_size: int, checkpointing: str,
                env: DistEnv) -> MemoryPlan:
    """This rank's plan for a step of batch_size, before anything is allocated: the step in GPU
    memory, or in host memory shared with the machine's other ranks (CPU ranks)."""
    simulated = _SIMULATED[0]
    if simulated is not None:
        return _simulated_plan(config, placement, batch_size, checkpointing, env, simulated)
    estimate = estimate_memory(config, batch_size, checkpointing, placement)
    if env.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(env.device)
        where = dict(sharers=1, memory=f"{env.device} memory", available=free,
                     host_available=host_memory_available(), host_sharers=env.local_world_size)
    else:
        where = dict(sharers=env.local_world_size, memory="host memory", available=host_memory_available())
    plan = MemoryPlan(placement.method, estimate, batch_size, **where)
    if plan.fits:
        return plan
    fits = fits_in(plan.available, plan.sharers, plan.host_available, plan.host_sharers)
    advice = suggest(config, batch_size, checkpointing, placement, fits)
    return replace(plan, advice=advice)


def _simulated_plan(config: GPTConfig, placement: Placement, batch_size: int, checkpointing: str,
                    env: DistEnv, device: SimulatedDevice) -> MemoryPlan:
    """A simulated rank's plan: the step on the device it stands for, in that device's precision."""
    placement = replace(placement, device_type=device.device_type, compute_dtype=device.compute_dtype)
    estimate = estimate_memory(config, batch_size, checkpointing, placement)
    gpu = device.device_type == "cuda"
    where = dict(sharers=1, memory=f"{device.name} memory", available=device.memory,
                 host_available=device.host_memory if gpu else None, host_sharers=env.local_world_size)
    plan = MemoryPlan(placement.method, estimate, batch_size, **where)
    if plan.fits:
        return plan
    fits = fits_in(plan.available, plan.sharers, plan.host_available, plan.host_sharers)
    return replace(plan, advice=suggest(config, batch_size, checkpointing, placement, fits))


def forward_activations(config: GPTConfig, batch_size: int, checkpointing: str, placement: Placement) -> int:
    """Bytes of activations a step's forward pass leaves for its backward pass (the traced step's at
    the end of its forward pass; autocast's copies of parameters aside): what plan.py --check
    measures of a real step."""
    casts_parameters = placement.sharded and placement.compute_dtype is not None
    trace = trace_step(TraceKey(config, placement.device_type, placement.compute_dtype, casts_parameters,
                                checkpointing))
    return trace.saved_activations(config.n_layer).at(batch_size)


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
                          f"{short.method} needs {short.describe()}; {short.advice}")
