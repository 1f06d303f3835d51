"""Sharded snapshots across sizes (issue 56, item 3): a world of 64 ranks saves a sharded snapshot, one
simulated rank at a time on torch's fake process group, into a temporary folder; the files a real run of
64 ranks leaves are checked (their names and count, and the index rank 0 writes); then ranks of a world
of 32 under fsdp, and of 4 nodes of 8 under hsdp, resume from it, each reading what it needs.

What the fake group cannot carry, this test carries itself: torch.distributed.checkpoint (DCP) plans a
save collectively (every rank's local plan gathered to rank 0, which makes the global plan and the
index, then scattered back; every rank's write results gathered to rank 0 again), and the fake group's
object collectives hand back nothing. Here each simulated rank runs DCP's own steps (the planner's and
the writer's, as dcp.save's local_step, global_step, write_data and finish_checkpoint run them) and this
process passes the plans and results between them. A load's planning needs no other rank: each rank
loads with no_dist. Each rank runs in a process of its own (planning.check's fake world, forked), the
model and optimizer built and sharded by the project's own code (parallel.parallelize,
optimizer.create_optimizer), its share of the state as the sharded store writes it (sharded_store's
_sharded_state and rank_share).
"""
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)

from mingpt.cluster_check import in_a_child, preload
from mingpt.distributed.parallel import Parallelism, parallelize, restore_optimizer_state
from mingpt.distributed.precision import Precision
from mingpt.model import GPT, GPTConfig
from mingpt.optimizer import OptimizerConfig, create_optimizer
from mingpt.planning.check import fake_world
from mingpt.storage.sharded_store import SafeReader, _sharded_state, rank_share

pytestmark = [pytest.mark.slow,
              pytest.mark.timeout(1500)]  # 134 processes, each a simulated rank: minutes on a busy 2-core CPU

TINY = GPTConfig(n_layer=1, n_head=2, n_embd=64, vocab_size=65, block_size=16)
"""Rows of 64 to 256 (and 128 of the padded vocabulary): over 64 ranks a chunk of 1 to 4 rows each."""
SAVED_WORLD = 64


@dataclass(frozen=True)
class World:
    method: str
    size: int
    per_node: int


def rank_state(world: World, rank: int, env):
    """Rank `rank`'s model and optimizer after one step whose gradients are the weights themselves:
    every element of the state depends on that element's initial value alone, so any rank of any world
    can say what it should hold."""
    with torch.device("meta"):
        model = GPT(TINY, seed=1)
    model = parallelize(model, Parallelism(world.method), Precision("cpu", None), env)
    optimizer = create_optimizer(model, OptimizerConfig())
    for parameter in model.parameters():
        parameter.grad = parameter.detach().clone()
    optimizer.step()
    return model, optimizer


def planned_share(world: World, rank: int, folder: str, central=None):
    """Rank `rank`'s part of a save. Without central: dcp.save's local_step (its planner's and writer's
    plan of its share, as the sharded store deals it). With the plan rank 0 made for it: its
    write_data, which writes its file and returns what it wrote."""
    torch.set_num_threads(1)  # as plan.py --check's ranks (two threads beside other work: ten times slower)
    with fake_world(rank, world.size, world.per_node, 60) as env:
        model, optimizer = rank_state(world, rank, env)
        tensors, _ = _sharded_state(model, optimizer)
        planner, writer = DefaultSavePlanner(), FileSystemWriter(folder)
        planner.set_up_planner(rank_share(tensors, rank, world.size), storage_meta=writer.storage_meta(),
                               is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        plan = writer.prepare_local_plan(planner.create_local_plan())
        if central is None:
            return plan
        writes = writer.write_data(planner.finish_plan(central), planner)
        writes.wait()
        return writes.value()


def save_as_a_world(world: World, folder: Path) -> None:
    """What dcp.save does on every rank of `world` (local_step, rank 0's global_step, write_data, rank
    0's finish_checkpoint), with the collectives between them carried by this process."""
    plans = [in_a_child(planned_share, world, rank, str(folder)) for rank in range(world.size)]
    planner, writer = DefaultSavePlanner(), FileSystemWriter(str(folder))
    planner.set_up_planner({}, storage_meta=writer.storage_meta(), is_coordinator=True)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    central, metadata = planner.create_global_plan(plans)
    central = writer.prepare_global_plan(central)
    results = [in_a_child(planned_share, world, rank, str(folder), central[rank])
               for rank in range(world.size)]
    writer.finish(metadata=metadata, results=results)


def resumed(world: World, rank: int, folder: str) -> tuple[list[str], bool]:
    """Rank `rank` of `world` loads the snapshot as the sharded store restores one (DCP resharding it);
    the files it read, and whether it then holds what a run of this world would: its rows (FSDP2's
    chunks of ceil(rows / shards)) of the whole model's state after the same step, made here without
    any sharding."""
    torch.set_num_threads(1)
    whole = whole_state()
    with fake_world(rank, world.size, world.per_node, 60) as env:
        with torch.device("meta"):
            model = GPT(TINY, seed=2)  # other initial weights: the load must replace them
        model = parallelize(model, Parallelism(world.method), Precision("cpu", None), env)
        optimizer = create_optimizer(model, OptimizerConfig())
        tensors, param_groups = _sharded_state(model, optimizer)
        reader, read = SafeReader(folder), []
        opened = reader.fs.create_stream

        def recorded(path, mode):
            read.append(Path(path).name)
            return opened(path, mode)

        reader.fs.create_stream = recorded
        dcp.load(tensors, storage_reader=reader, no_dist=True)
        set_model_state_dict(model, tensors["model"])
        restore_optimizer_state(model, optimizer, {"state": tensors["optimizer"],
                                                   "param_groups": param_groups})
        hsdp = world.method == "hsdp"
        index, shards = (rank % world.per_node, world.per_node) if hsdp else (rank, world.size)
        held = _sharded_state(model, optimizer)[0]
        mine = {("model", fqn): value for fqn, value in held["model"].items()}
        mine.update({(fqn, key): value for fqn, state in held["optimizer"].items()
                     for key, value in state.items()})
        same = mine.keys() == whole.keys() and all(
            torch.equal(local(value), whole[key][rows(whole[key], index, shards)])
            for key, value in mine.items())
        return sorted(set(read)), same


def whole_state() -> dict:
    """The model's and AdamW's state after the step rank_state takes, on one process, unsharded."""
    model = GPT(TINY, seed=1)
    optimizer = create_optimizer(model, OptimizerConfig())
    for parameter in model.parameters():
        parameter.grad = parameter.detach().clone()
    optimizer.step()
    state = get_optimizer_state_dict(model, optimizer)["state"]
    whole = {("model", fqn): value.detach() for fqn, value in get_model_state_dict(model).items()}
    whole.update({(fqn, key): value for fqn, values in state.items() for key, value in values.items()})
    return whole


def rows(tensor: torch.Tensor, index: int, shards: int):
    """The rows shard `index` of `shards` holds, as FSDP2 cuts them (a step count: all of it)."""
    if tensor.dim() == 0:
        return ()
    chunk = -(-tensor.shape[0] // shards)
    return slice(min(index * chunk, tensor.shape[0]), min((index + 1) * chunk, tensor.shape[0]))


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    preload()
    folder = tmp_path_factory.mktemp("sharded") / "sharded_000000001"
    save_as_a_world(World("fsdp", SAVED_WORLD, 8), folder)
    return folder


def test_a_world_of_64_leaves_a_file_per_rank_and_rank_0_s_index(snapshot):
    """64 ranks leave 64 shard files, __0_0.distcp to __63_0.distcp, and the index (.metadata): every
    parameter and AdamW moment cut as FSDP2 cuts it (chunks of ceil(rows / 64) rows, one per rank that
    holds rows), each chunk in the file of the rank that holds it, and every file holding some."""
    names = sorted(path.name for path in snapshot.iterdir())
    files = [f"__{rank}_0.distcp" for rank in range(SAVED_WORLD)]
    assert names == sorted([".metadata", *files])
    metadata = SafeReader(str(snapshot)).read_metadata()
    sharded = {fqn: entry for fqn, entry in metadata.state_dict_metadata.items() if entry.size}
    assert {fqn.split(".")[0] for fqn in sharded} == {"model", "optimizer"}
    for fqn, entry in sharded.items():
        rows = entry.size[0]
        per_rank = -(-rows // SAVED_WORLD)
        held = sorted(chunk.offsets[0] for chunk in entry.chunks if chunk.sizes[0])
        assert held == list(range(0, rows, per_rank)), fqn
        for chunk in entry.chunks:
            if chunk.sizes[0]:
                where = metadata.storage_data[MetadataIndex(fqn, chunk.offsets)].relative_path
                assert where == f"__{chunk.offsets[0] // per_rank}_0.distcp", (fqn, chunk)
    assert {info.relative_path for info in metadata.storage_data.values()} == set(files)


@pytest.mark.parametrize("world", [World("fsdp", 32, 8), World("hsdp", 32, 8)], ids=["fsdp-32", "hsdp-4x8"])
def test_a_smaller_world_resumes_it_reading_only_what_it_needs(snapshot, world):
    """fsdp at 32 ranks: rank r holds about the rows of saved ranks 2r and 2r + 1; hsdp on 4 nodes of
    8: local rank k holds an eighth of each parameter, about saved ranks 8k to 8k + 7's. Each reads the
    index, the files holding the saved chunks its own rows overlap, and the files holding the step
    counts (whole tensors, which the sharded store deals out one to a rank, so that at 64 ranks a
    model of 15 tensors spreads them over 15 files, each read by every rank that resumes), and no
    other file; it then holds exactly what a run of its own world holds after the same step."""
    metadata = SafeReader(str(snapshot)).read_metadata()
    steps = {info.relative_path for index, info in metadata.storage_data.items()
             if index.fqn.endswith(".step")}
    shards = world.size if world.method == "fsdp" else world.per_node
    for rank in (0, world.size // 2 + 1, world.size - 1):
        read, same = in_a_child(resumed, world, rank, str(snapshot))
        assert same, (world, rank)
        needed = files_of_rows(metadata, rank % shards if world.method == "hsdp" else rank, shards)
        assert set(read) == {".metadata"} | steps | needed, (world, rank, read)
        assert len(needed) < SAVED_WORLD // 2, (world, rank, needed)  # a few of the 64 files


def files_of_rows(metadata, index: int, shards: int) -> set[str]:
    """The files of the saved chunks (of every sharded tensor) that the rows shard `index` of `shards`
    holds overlap, as FSDP2 cuts rows: chunks of ceil(rows / shards)."""
    found = set()
    for fqn, entry in metadata.state_dict_metadata.items():
        if fqn.endswith(".step") or not entry.size:
            continue
        rows = entry.size[0]
        chunk = -(-rows // shards)
        first, last = min(index * chunk, rows), min((index + 1) * chunk, rows)
        for saved in entry.chunks:
            if saved.sizes[0] and saved.offsets[0] < last and first < saved.offsets[0] + saved.sizes[0]:
                found.add(metadata.storage_data[MetadataIndex(fqn, saved.offsets)].relative_path)
    return found
