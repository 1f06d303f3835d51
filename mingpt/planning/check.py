"""A cluster's run checked on one machine: chosen ranks of it started in this process, one after
another, through the run's own start-up (plan.py --check), on torch's fake process group.

torch ships a process group whose collectives move no data (the "fake" backend, the one torchtitan
dry-runs topologies with): a process joins it as rank r of a world of N, and every collective
returns at once, leaving its output as this rank's own (an all-gather hands every slot this rank's
input, an all-reduce leaves the tensor as it was). So rank r runs the start-up a real rank r would:
the mesh fully_shard shards over, the rows of each parameter it holds, its sampler's share of the
epoch, its memory check, the optimizer, one training step; and what it holds is measured, not
computed. This module holds the parts that need no more than the layers below it: the fake world
(fake_world), DDP's gradient all-reduce made a no-op there (quiet_gradient_sync), what a rank holds
(held_by), what a step allocates (StepMemory), the ranks checked by default (checked_ranks) and the
report's lines (RankCheck). plan.py drives them through start_up.py, as main.py starts a run.

What the fake group cannot carry, and so what a check cannot prove:
- values: every other rank is taken to hold what this one holds (an all-gather of objects hands back
  this rank's object N times), so rank-to-rank agreement (a checksum, a refusal met on one rank only)
  is not checked, and the step's loss and gradients are not those of the run;
- torch.distributed.checkpoint's planning, which gathers and scatters objects: a sharded snapshot's
  save fails on the fake group, so the check lists the files each rank writes (tests/planning/
  test_sharded_at_size.py writes a 64-rank snapshot with DCP's own planner, its collectives carried
  in-process, and resumes it at 32 ranks and under hsdp);
- time: no communication happens, and the step runs on this machine's CPU;
- the GPU: a CPU-only torch makes no CUDA tensors. The step runs on the CPU in the CPU's precision
  (bf16 where the CPU has it natively, else fp32) with its attention and dropout kernels; what a GPU
  differs in (fp16 or bf16 activations, flash attention's O(T) saves, one-byte dropout masks, the
  caching allocator's reserve, NCCL's buffers and the CUDA context) is the planner's
  (planning/memory.py, traced with the GPU's kernels emulated), and the memory check runs against
  the GPU's memory (memory.simulating).
"""
import contextlib
import textwrap
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mingpt.common.errors import check
from mingpt.distributed.process_group import DistEnv
from mingpt.planning.memory import gb

FAKE_BACKEND = "fake"
STATE_TOLERANCE = 0.02
"""How far a rank's measured parameters, gradients and optimizer state may lie from the planner's."""
ACTIVATION_TOLERANCE = 0.15
"""The same for the activations a step leaves for its backward pass."""
WIDTH = 110
"""The report's lines wrap here (the project's line length)."""


def checked_ranks(world_size: int, asked: Optional[str] = None) -> list[int]:
    """The ranks to check: those asked for (a comma-separated list), or rank 0 (it alone writes the
    single-file snapshots and holds the largest shards), one between, and the last rank (the smallest
    shards, the last share of every epoch)."""
    if not asked:
        return sorted({0, world_size // 2, world_size - 1})
    try:
        ranks = sorted({int(text) for text in asked.split(",")})
    except ValueError:
        check(False, "--ranks", f"is a comma-separated list of ranks, got {asked!r}")
    check(0 <= ranks[0] and ranks[-1] < world_size, "--ranks",
          f"ranks of this world are 0 to {world_size - 1}, got {asked}")
    return ranks


@contextlib.contextmanager
def fake_world(rank: int, world_size: int, ranks_per_node: int, timeout_s: float) -> Iterator[DistEnv]:
    """This process as rank `rank` of a world of world_size, ranks_per_node to a node, on the CPU,
    until the context ends. Its DistEnv's backend is "fake": the Trainer then wraps the model as a GPU
    run does (FSDP2's own collectives, not cpu_collectives.py's)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the backend

    check(not dist.is_initialized(), "--check", "this process is already in a process group; run the "
          "check in a process of its own (python mingpt/plan.py --check)")
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(FAKE_BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size,
                            timeout=timeout)
    try:
        yield DistEnv(rank=rank, local_rank=rank % ranks_per_node, world_size=world_size,
                      local_world_size=ranks_per_node, device=torch.device("cpu"), backend=FAKE_BACKEND,
                      timeout=timeout)
    finally:
        # No gc.collect() first, as distributed_session has: each rank is checked in a process of its
        # own that ends at once (multiprocessing's os._exit), never at an interpreter's shutdown.
        dist.destroy_process_group()


def quiet_gradient_sync(model: nn.Module) -> None:
    """DDP's all-reduce on the fake group hands back no tensor, which DDP's reducer refuses: a
    communication hook that hands each bucket back as it is (this rank's gradients) stands for it.
    FSDP's collectives run as they are."""
    def as_it_is(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    if isinstance(model, DDP):
        model.register_comm_hook(None, as_it_is)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind the tensors (a sharded tensor's local shard): what they
    hold in memory, FSDP's padding of uneven shards included, views counted once."""
    seen = {}
    for tensor in tensors:
        storage = local_part(tensor).untyped_storage()
        seen[storage.data_ptr(), storage.nbytes()] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class Held:
    """Bytes a rank holds between steps, measured from its tensors' storages."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def held_by(model: nn.Module, optimizer: torch.optim.Optimizer) -> Held:
    """What the model's parameters, their gradients and the optimizer's state hold on this rank now."""
    parameters = list(model.parameters())
    state = [value for values in optimizer.state.values() for value in values.values()
             if isinstance(value, torch.Tensor)]
    return Held(storage_bytes(parameters), storage_bytes(p.grad for p in parameters if p.grad is not None),
                storage_bytes(state))


class StepMemory(TorchDispatchMode):
    """The bytes a training step allocates, measured on its real tensors: every storage an operation
    hands back is followed until it is freed, at its size at each moment (FSDP resizes the storages
    of gathered parameters in place), and the largest total is kept, as torch.cuda's allocator
    statistics keep max_memory_allocated. Marks (`at`) name the step's phases: the peak is kept per
    phase. end_of_forward (a forward hook on the model) takes what the forward pass leaves for the
    backward pass: everything made so far that is not a parameter (FSDP's gathered ones) or
    autocast's copy of one.

    Not seen: what a sharded tensor's operation makes inside it besides its result (the optimizer
    step's temporaries over DTensors), and what torch allocates outside tensors."""

    def __init__(self):
        super().__init__()
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self.end_of_forward: Optional[int] = None
        self._live: dict[int, tuple[weakref.ref, bool]] = {}  # id(storage) -> (its ref, is a cast)

    def at(self, phase: str) -> None:
        self.phase = phase

    def live(self, casts: bool = True) -> int:
        """Bytes of the storages made while recording that are alive now."""
        total = 0
        for ref, is_cast in list(self._live.values()):
            storage = ref()
            if storage is not None and (casts or not is_cast):
                total += storage.nbytes()
        return total

    def watch(self, model: nn.Module) -> torch.utils.hooks.RemovableHandle:
        """Take the moment the model's forward pass ends (its loss is made)."""
        def ended(module, args, output) -> None:
            if self.end_of_forward is None:
                parameters = {id(local_part(p).untyped_storage()) for p in module.parameters()}
                self.end_of_forward = sum(ref().nbytes() for key, (ref, is_cast) in list(self._live.items())
                                          if ref() is not None and not is_cast and key not in parameters)
        return model.register_forward_hook(ended)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        is_cast = func is torch.ops.aten._to_copy.default and isinstance(args[0], nn.Parameter)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                self._follow(local_part(tensor).untyped_storage(), is_cast)
        now = self.live()
        if now > self.peaks.get(self.phase, -1):
            self.peaks[self.phase] = now
        return out

    def _follow(self, storage: torch.UntypedStorage, is_cast: bool) -> None:
        key = id(storage)
        if key not in self._live:
            self._live[key] = (weakref.ref(storage, lambda _, key=key: self._live.pop(key, None)), is_cast)


def describe_mesh(model: nn.Module) -> str:
    """The device mesh the model's parameters are sharded over, and this rank's place in it, as
    fully_shard built them: "mesh replicate 64 x shard 8, this rank at (63, 7)"; "" when not sharded."""
    sharded = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    if sharded is None:
        return ""
    mesh = sharded.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{dim}" for dim in range(mesh.ndim))
    shape = " x ".join(f"{name} {size}" for name, size in zip(names, mesh.shape))
    return f"mesh {shape}, this rank at ({', '.join(map(str, mesh.get_coordinate()))})"


def rounds(count: int, word: str, plural: str = "") -> str:
    """3 batches, 1 batch."""
    return f"{count:,} {word if count == 1 else plural or word + 's'}"


@dataclass
class RankCheck:
    """What one simulated rank did and held, for the report."""

    rank: int
    world: str
    """Where the rank is: "node 3, local rank 2"."""
    seconds: float
    held: Held
    step_peak: int
    """Bytes at the step's peak on this CPU: what was held when it started (parameters, DDP's buckets)
    plus what it allocated, with the optimizer's state from the start as in every later step."""
    activations: int
    """Bytes the forward pass left for the backward pass (measured), at the step's batch."""
    planned_cpu: dict[str, int]
    """The planner's figures for this step on this CPU: parameters, gradients, optimizer, activations
    (at the end of the forward pass), peak."""
    planned_cluster: dict[str, int]
    """The planner's figures on the cluster's device, in its precision."""
    precision: str = ""
    """The CPU step's precision, as the World line says it."""
    mesh: str = ""
    """The device mesh the rank's parameters are sharded over (describe_mesh)."""
    resident_peak: Optional[int] = None
    """The high-water mark of the rank's process's resident memory (torch's code included); None
    where the system does not say (resident_peak)."""
    data: list[str] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)

    def disagreements(self) -> list[str]:
        """Where the measurement and the planner differ by more than they may: 2% for what the rank
        holds (both are exact), 15% for activations (the planner's are traced on fake tensors)."""
        measured = {"parameters": self.held.parameters, "gradients": self.held.gradients,
                    "optimizer": self.held.optimizer, "activations": self.activations}
        found = []
        for name, value in measured.items():
            planned = self.planned_cpu[name]
            tolerance = ACTIVATION_TOLERANCE if name == "activations" else STATE_TOLERANCE
            if abs(value - planned) > tolerance * max(planned, 1):
                found.append(f"{name}: measured {gb(value)}, planned {gb(planned)}")
        return found

    def lines(self, world_size: int, device: str, cluster_precision: str, memory: Optional[int]) -> list[str]:
        planned, ours, cluster = self.planned_cpu, self.held, self.planned_cluster
        usable = f" of {gb(memory)}" if memory else ""
        host = f", and {gb(cluster['host'])} of host memory" if cluster.get("host") else ""
        out = [f"rank {self.rank} of {world_size:,} ({self.world}): started and stepped in "
               f"{self.seconds:.1f} s",
               *([f"  {self.mesh}"] if self.mesh else []),
               f"  holds {gb(ours.total)} between steps: parameters {gb(ours.parameters)}, gradients "
               f"{gb(ours.gradients)}, optimizer state {gb(ours.optimizer)} (measured; the planner's "
               f"{gb(planned['parameters'])}, {gb(planned['gradients'])}, {gb(planned['optimizer'])})",
               f"  its step on this CPU ({self.precision}): {gb(self.step_peak)} at the peak, "
               f"{gb(self.activations)} of activations left for the backward pass (measured; the planner's "
               f"{gb(planned['activations'])})",
               f"  on the {device} ({cluster_precision}), the planner's: {gb(cluster['peak'])}{usable} at "
               f"the peak (activations {gb(cluster['activations'])}, buffers {gb(cluster['buffers'])})"
               f"{host}, the allocator's reserve on top"]
        out += [f"  {line}" for line in self.data + self.snapshots]
        out += [f"  the planner disagrees, {line}" for line in self.disagreements()]
        return [wrapped for line in out for wrapped in wrap(line)]


def wrap(line: str) -> list[str]:
    """A report line cut at WIDTH, its continuation indented under its text."""
    indent = len(line) - len(line.lstrip()) + 2
    return textwrap.wrap(line, width=WIDTH, subsequent_indent=" " * indent, break_on_hyphens=False) or [line]


def resident_peak() -> Optional[int]:
    """This process's peak resident memory so far (VmHWM, Linux), in bytes."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    return None


class Stopwatch:
    def __init__(self):
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start
