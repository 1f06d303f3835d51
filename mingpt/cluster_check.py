"""plan.py --check: a cluster's run checked before it is queued, rank by rank, on this one machine:
each checked rank in a process of its own, forked from one the check starts afresh (check_ranks).

Each checked rank joins torch's fake process group as rank r of the cluster's world
(planning/check.py says what that group carries and what it cannot) and starts as main.py starts a
rank, through start_up.py: the config's checks, the data prepared and split, the model built on the
meta device, the Trainer (the step's memory checked against the cluster's device, the model placed
and wrapped for ddp, fsdp or hsdp on the mesh the run would build, the optimizer, this rank's
samplers, the snapshot store), then one training step at the configured batch. What the rank holds
and what its step allocates are measured on its tensors, beside the planner's figures; its data
(batches, the samples it starts with, the shard files it reads) and the snapshot files it writes
are read from the objects the run would use. A refusal any rank meets is the run's: one line naming
the key, and the check exits 1.

The snapshots go to a temporary folder of the configured kind (a file, or a folder), never to the
configured path, and the metrics beside them: the check writes nothing a run would read.
"""
import copy
import multiprocessing
import os
import tempfile
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from mingpt.char_dataset import prepare_corpus
from mingpt.common.errors import MinGPTError
from mingpt.distributed.parallel import unwrap
from mingpt.distributed.precision import SHORT_NAMES
from mingpt.planning.check import (
    RankCheck,
    StepMemory,
    Stopwatch,
    describe_mesh,
    fake_world,
    held_by,
    quiet_gradient_sync,
    resident_peak,
    rounds,
    storage_bytes,
    wrap,
)
from mingpt.planning.memory import (
    Placement,
    SimulatedDevice,
    estimate_memory,
    forward_activations,
    gb,
    rank_state,
    simulating,
)
from mingpt.run_config import TrainConfig
from mingpt.start_up import placement_of, start_trainer, train_objects
from mingpt.storage.sharded_store import rank_share
from mingpt.tokens.permutation import BlockOrder
from mingpt.trainer import Trainer

SHOWN_SAMPLES = 3
"""Of a rank's first batch, the samples a check names."""


@dataclass(frozen=True)
class CheckedCluster:
    """The run's world and the device each rank stands for."""

    nodes: int
    ranks_per_node: int
    device: SimulatedDevice

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def check_run(config: TrainConfig, cluster: CheckedCluster, ranks: list[int]) -> list[str]:
    """The check's report: each of `ranks` started and stepped (check_ranks), said rank by rank."""
    watch = Stopwatch()
    checks = check_ranks(config, cluster, ranks)
    return report(config, cluster, checks, watch.seconds())


def check_ranks(config: TrainConfig, cluster: CheckedCluster, ranks: list[int]) -> list[RankCheck]:
    """Start each of `ranks` of the run in turn, each in a process of its own, and measure it; raise
    the first refusal (a MinGPTError, naming the key) any of them meets. The ranks' processes fork
    from one started afresh (spawned) for the check, not from this one: under torch's CUDA builds a
    process that has run a backward pass forks children whose own backward pass fails (autograd's
    threads; seen on 2.14.1), and this one may have (a test, a notebook)."""
    prepare_corpus(config.data_config)  # once, as each machine's local rank 0 would
    with tempfile.TemporaryDirectory(prefix="mingpt-check-") as folder:
        config = into_folder(config, Path(folder))
        return in_a_child(check_each, config, cluster, ranks, start="spawn")


def check_each(config: TrainConfig, cluster: CheckedCluster, ranks: list[int]) -> list[RankCheck]:
    """In the check's own process: each rank in a process forked from it, after one preload."""
    preload()
    return [in_a_child(check_rank, config, cluster, rank) for rank in ranks]


def preload() -> None:
    """Import what every checked rank's start-up imports, once, before the ranks' processes fork
    (each would import it again: seconds apiece)."""
    import torch._dynamo  # noqa: F401  (dispatch modes and DTensor reach it)
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


def in_a_child(function, *args, start: str = "fork"):
    """function(*args) in a child process forked from this one (or started afresh: start="spawn",
    function and args then pickled), its result handed back: each rank
    checked starts from what this process had imported and prepared, and leaves nothing behind (its
    memory, its process group, and torch's caches keyed by device mesh, which compare meshes by shape
    alone and would hand one world's mesh to the next). A refusal comes back as the same line."""
    context = multiprocessing.get_context(start)
    receiving, sending = context.Pipe(duplex=False)
    # A spawned process forks the ranks' own, which a daemon may not.
    child = context.Process(target=_run_and_send, args=(sending, function, args), daemon=start == "fork")
    child.start()
    sending.close()
    try:
        kind, value = receiving.recv()
    except EOFError:
        kind, value = "died", None
    child.join()
    if kind == "result":
        return value
    if kind == "refused":
        line, origin = value
        error = MinGPTError(line)
        error.origin = origin
        raise error
    raise RuntimeError(f"a checked rank's process ended with exit status {child.exitcode}"
                       + (f":\n{value}" if value else " (killed: out of memory?)"))


def _run_and_send(sending, function, args) -> None:
    try:
        sending.send(("result", function(*args)))
    except MinGPTError as error:
        sending.send(("refused", (str(error), error.origin)))
    except BaseException:  # noqa: BLE001  the parent raises it, with this traceback
        sending.send(("failed", traceback.format_exc()))


def into_folder(config: TrainConfig, folder: Path) -> TrainConfig:
    """The config with its snapshots (of the same kind: a .pt file, or a folder) and metrics in folder."""
    name = Path(config.trainer_config.snapshot_path.rstrip("/")).name or "snapshots"
    trainer_config = replace(config.trainer_config, snapshot_path=str(folder / name), metrics_path=None)
    return replace(config, trainer_config=trainer_config)


def check_rank(config: TrainConfig, cluster: CheckedCluster, rank: int) -> RankCheck:
    """Rank `rank` of the run, started in this process on the fake group, and one step of it."""
    if "OMP_NUM_THREADS" not in os.environ:
        # One thread: the step is a probe, not a benchmark, and torch's two threads on a 2-core machine
        # beside other work made it ten times slower (each operation waits for the busier core).
        torch.set_num_threads(1)
    watch, tc = Stopwatch(), config.trainer_config
    with fake_world(rank, cluster.world_size, cluster.ranks_per_node, tc.process_group_timeout_s) as env:
        try:
            with simulating(cluster.device):
                objects = train_objects(config, env)
                trainer, summary = start_trainer(config, env, objects)
        except MinGPTError as error:
            error.origin = f"[rank {rank} of {cluster.world_size}] "
            raise
        check = step_and_measure(config, cluster, trainer, summary, watch)  # no lease: the run takes it
        return replace(check, resident_peak=resident_peak())


def step_and_measure(config: TrainConfig, cluster: CheckedCluster, trainer: Trainer, summary: list[str],
                     watch: Stopwatch) -> RankCheck:
    env, tc = trainer.env, config.trainer_config
    quiet_gradient_sync(trainer.model)
    sampler = trainer.train_loader.sampler
    sampler.set_epoch(1)  # the first epoch, as _start_epoch sets it
    indices = next(iter(sampler))
    inputs, targets = trainer.to_device(trainer.train_loader.dataset[indices])
    before = storage_bytes(trainer.model.parameters())  # and DDP's buckets, below
    memory = StepMemory()
    handles = [memory.watch(trainer.model),
               trainer.model.register_forward_pre_hook(lambda *_: memory.at("forward")),
               trainer.optimizer.register_step_pre_hook(lambda *_: memory.at("optimizer"))]
    with memory:
        memory.at("backward")  # until the forward pass starts: zero_grad, the learning rate
        trainer._run_batch(inputs, targets)
    for handle in handles:
        handle.remove()
    held = held_by(trainer.model, trainer.optimizer)
    # A later step starts with the optimizer's state held: the forward and backward passes' peak
    # carries it, as the planner's does.
    passes = max(memory.peaks.get("forward", 0), memory.peaks.get("backward", 0))
    step_peak = before + max(passes + held.optimizer, memory.peaks.get("optimizer", 0))
    placement = placement_of(tc, env.world_size, env.local_world_size, "cpu", trainer.precision.amp_dtype,
                             config.optimizer_config.name)
    model_config = unwrap(trainer.model).config
    state = rank_state(model_config, placement, env.rank)
    planned_cpu = {"parameters": state.parameters, "gradients": state.gradients, "optimizer": state.optimizer,
                   "activations": forward_activations(model_config, len(inputs), tc.activation_checkpointing,
                                                      placement)}
    cluster_placement = replace(placement, device_type=cluster.device.device_type,
                                compute_dtype=cluster.device.compute_dtype)
    estimate = estimate_memory(model_config, tc.batch_size, tc.activation_checkpointing, cluster_placement)
    planned_cluster = {"peak": estimate.peak, "activations": estimate.activations,
                       "buffers": estimate.buffers, "host": estimate.host}
    world = f"node {env.rank // env.local_world_size}, local rank {env.local_rank}"
    return RankCheck(env.rank, world, watch.seconds(), held, step_peak, memory.end_of_forward or 0,
                     planned_cpu, planned_cluster, str(trainer.precision), describe_mesh(trainer.model),
                     data=data_lines(trainer, indices),
                     snapshots=snapshot_lines(trainer), summary=summary)


def data_lines(trainer: Trainer, first: torch.Tensor) -> list[str]:
    """What this rank reads: its batches per epoch and first samples, the shard files its epoch opens,
    and its evaluation's share."""
    env, sampler, split = trainer.env, trainer.train_loader.sampler, trainer.train_loader.dataset
    shown = ", ".join(f"{int(i):,}" for i in first[:SHOWN_SAMPLES])
    batches = rounds(len(trainer.train_loader), "batch", "batches")
    lines = [f"data: {batches} of {sampler.batch_size:,} per epoch, "
             f"{rounds(sampler.positions_per_rank(0), 'position')} of the epoch's {sampler.pass_length:,} "
             f"(the first batch's samples {shown}, ...)"]
    shards = split.dataset.shards if hasattr(split, "dataset") else None
    if shards is not None:
        reads = shards_read(sampler, split)
        remote = any(shards.shards[index].url for index in reads.opened)
        asked = (f"; asks its node's cache for {len(reads.asked)} shard(s) in turn, {len(set(reads.asked))} "
                 "of them distinct (a shard is fetched once per node, by the first of its ranks to ask)"
                 if remote else "")
        lines.append(f"reads {len(reads.opened)} of the {len(shards.shards)} shard files in an epoch "
                     f"({_ranges(reads.opened)}){asked}")
        wider = step_wider_than_a_group(sampler)
        if wider:
            span = (sampler.batch_size - 1) * env.world_size
            lines.append(f"warning: a rank's batch reaches {span:,} positions of the order past its first, "
                         "more than a group of "
                         f"data_config.shards_at_once={sampler.blocks.at_once} shards: a batch then reads "
                         "shards it did not ask near (remote ones fetched as they are first read); "
                         f"data_config.shards_at_once={wider} or more keeps each step within two groups")
    if trainer.test_loader is not None:
        test = trainer.test_loader.sampler
        evaluated = rounds(len(trainer.test_loader), "batch", "batches")
        lines.append(f"evaluation: {evaluated} of up to {test.batch_size:,} "
                     f"samples, {rounds(test.positions_per_rank(0), 'position')} of "
                     f"{test.pass_length:,} (trainer_config.eval_batches={trainer.config.eval_batches})"
                     + (f"; {env.world_size:,} ranks share {test.pass_length:,} samples: the last round "
                        "repeats some" if test.pass_length < env.world_size else ""))
    return lines


@dataclass(frozen=True)
class ShardReads:
    """What a rank's epoch reads of a set of shards."""

    opened: list[int]
    """The shard files its windows lie in."""
    asked: list[int]
    """The shards its sampler asks to have near, in order, as it enters each group of shards_at_once
    (its group's and the next's: remote ones fetched into the machine's cache unless there)."""
    samples: list[int]
    """The split's samples it reads, in its order."""


def shards_read(sampler, split) -> ShardReads:
    """What a rank's sampler reads in its whole pass (as set), from the sampler's own order: nothing is
    read or fetched (the read-ahead it asks for is recorded instead)."""
    windows, asked = split.dataset, []
    if sampler.blocks is not None:
        sampler = copy.copy(sampler)
        sampler.blocks = replace(sampler.blocks, warm=asked.extend)
    touched, samples = set(), []
    for indices in sampler:
        samples += indices.tolist()
        starts = split.starts(indices).numpy() * windows.stride
        for position in (starts, starts + windows.block_size):  # a window may end in the next file
            touched.update(np.searchsorted(windows.shards.starts, position, side="right") - 1)
    return ShardReads(sorted(int(index) for index in touched), asked, samples)


def step_wider_than_a_group(sampler) -> int:
    """Shards read a few at a time (permutation.BlockOrder) are asked near as a rank's batch enters
    each group, this group's and the next's; a rank's batch reaches (batch_size - 1) x world positions
    past its first. 0 when that is within the smallest whole group (the batch then ends in the next
    group at the latest), else the shards_at_once that would hold it."""
    if sampler.blocks is None:
        return 0
    order = BlockOrder(sampler.blocks, sampler.seed)
    groups = np.diff(order.group_starts)
    smallest = int(groups[:-1].min()) if len(groups) > 1 else int(groups[0])
    span = (sampler.batch_size - 1) * sampler.world_size
    if span <= smallest:
        return 0
    block = min(size for size in sampler.blocks.sizes if size) or 1
    return -(-span // block)


def _ranges(indices: list[int]) -> str:
    """0-3, 7, 9-10."""
    parts, start = [], None
    for index, following in zip(indices, [*indices[1:], None]):
        start = index if start is None else start
        if following != index + 1:
            parts.append(f"{start}" if start == index else f"{start}-{index}")
            start = None
    return ", ".join(parts)


def snapshot_lines(trainer: Trainer) -> list[str]:
    """The files this rank writes at a snapshot, by the store the Checkpointer opened."""
    tc, env = trainer.config, trainer.env
    path = tc.snapshot_path
    if tc.snapshot_format == "sharded":
        model_state = get_model_state_dict(trainer.model)
        tensors = {"model": model_state, "optimizer": get_optimizer_state_dict(trainer.model,
                                                                              trainer.optimizer)["state"]}
        share = rank_share(tensors, env.rank, env.world_size)
        written = sum(part.numel() * part.element_size() for part in _local_leaves(share))
        extra = "; with .metadata (the index of every rank's shards) and info.pt, last" if env.is_main else ""
        return [f"snapshots: writes sharded_<step>/__{env.rank}_0.distcp, {gb(written)} (its shards and its "
                f"share of the tensors every rank holds alike){extra}"]
    if env.is_main:
        return [f"snapshots: writes {Path(path).name}, about {gb(_whole_state_bytes(trainer))} (the whole "
                "state, gathered here in host memory first), and its metrics file"]
    return ["snapshots: writes no file (it sends its part of the state to rank 0, which writes the "
            "single file)"]


def _local_leaves(state: dict):
    for value in state.values():
        if isinstance(value, dict):
            yield from _local_leaves(value)
        elif isinstance(value, torch.Tensor):
            yield value.to_local() if hasattr(value, "to_local") else value


def _whole_state_bytes(trainer: Trainer) -> int:
    """A single file's tensors: the whole model's fp32 parameters and optimizer state."""
    whole = rank_state(unwrap(trainer.model).config, Placement("ddp"))
    return whole.parameters + whole.optimizer


def report(config: TrainConfig, cluster: CheckedCluster, checks: list[RankCheck],
           seconds: float) -> list[str]:
    tc, device = config.trainer_config, cluster.device
    world = cluster.world_size
    lines = [*wrap(f"Check: {world:,} ranks ({cluster.nodes} node(s) x {cluster.ranks_per_node} "
                   f"{device.name}), {tc.distributed_method}, batch_size={tc.batch_size}; ranks "
                   f"{', '.join(str(check.rank) for check in checks)} each started on torch's fake process "
                   "group, as main.py starts a rank, and stepped once"), ""]
    for check in checks:
        lines += [*check.lines(world, device.name, _precision(device), device.memory), ""]
    disagreeing = [check.rank for check in checks if check.disagreements()]
    verdict = (f"the planner disagrees with the measurement on rank(s) {', '.join(map(str, disagreeing))}"
               if disagreeing else "every measurement within the planner's tolerance (2% for the state, 15% "
               "for activations)")
    peaks = [check.resident_peak for check in checks if check.resident_peak]
    resident = f", each rank's process at most {gb(max(peaks))} resident" if peaks else ""
    lines += wrap(f"No rank refused the run ({seconds:.0f} s{resident}); {verdict}. Checked: the config; "
                  "the data, its split and each rank's sampler; the model placed under "
                  f"{tc.distributed_method} on the mesh the run builds, and its memory on the {device.name}; "
                  "the optimizer; one step; the snapshot layout. Not checked: what needs the other ranks' "
                  "values or their time (the fake group moves no data), NCCL, and the GPU's kernels (their "
                  "memory is the planner's): docs/distributed.md#before-you-queue-a-large-run.")
    return lines


def _precision(device: SimulatedDevice) -> str:
    if device.compute_dtype is None:
        return "fp32"
    scaler = " + GradScaler" if device.compute_dtype == torch.float16 else ""
    return f"{SHORT_NAMES[device.compute_dtype]}{scaler}"
