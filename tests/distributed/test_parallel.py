"""FSDP against DDP with real 2-process torchrun runs on the CPU (gloo), fp32.

Runs share one schedule: a tiny model, 2 epochs of about 90 steps, a snapshot after each epoch.
(An FSDP rank killed mid-epoch and restarted: tests/end_to_end/test_exact_resume.py; FSDP with fp16
and its sharded grad scaler: tests/distributed/test_precision.py.)
"""
import json
import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_ok, run_main, run_main_in_process, tiny_overrides
from state_equality import assert_same_state
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import Replicate, Shard
from workers.init_probe import FULL_STATE, PLACEMENTS, SEED, TINY, placed

from mingpt.common.errors import ConfigError
from mingpt.distributed.parallel import check_nodes_for_hsdp, local_rows
from mingpt.distributed.process_group import DistEnv
from mingpt.model import GPT
from mingpt.reporting.metrics import default_metrics_path, read_metrics


@pytest.fixture(scope="module")
def fsdp_probe(probes):
    """Facts from each of 2 ranks after one FSDP step, an eval pass and a snapshot."""
    return probes["fsdp"]


def test_fsdp_step_changes_the_parameters(fsdp_probe):
    gathered = fsdp_probe[0]  # the full state is gathered on rank 0
    assert gathered["digest_after"] != gathered["digest_before"]


def test_fsdp_rank_holds_its_share_of_the_parameters(fsdp_probe):
    for rank in fsdp_probe:
        assert rank["local_parameter_bytes"] == pytest.approx(rank["parameter_bytes"] / 2, rel=0.05)


def test_fsdp_eval_and_snapshot_follow_ddp_rules(fsdp_probe):
    modes = fsdp_probe[0]["eval_modes"] + fsdp_probe[1]["eval_modes"]
    assert fsdp_probe[0]["eval_modes"] and fsdp_probe[1]["eval_modes"], "the eval pass ran no forward"
    assert not any(modes)
    assert [p["wrote_snapshot"] for p in fsdp_probe] == [True, False]


@pytest.mark.parametrize("ranks_per_node, problem", [
    ([2, 1, 2], "hsdp needs the same number of ranks on every node, got nodes of 1 and 2 ranks; start"),
    ([2, 2], "hsdp shards within a node and replicates across nodes, and this run has one node; on one"),
])
def test_hsdp_refuses_nodes_that_are_not_a_rectangle_of_ranks(ranks_per_node, problem):
    """ranks_per_node: each rank's LOCAL_WORLD_SIZE, as every rank gathers them (the two-host test
    runs HSDP; one process alone is refused in test_main.py)."""
    with pytest.raises(ConfigError) as refused:
        check_nodes_for_hsdp(ranks_per_node)
    assert refused.value.key == "trainer_config.distributed_method"
    assert str(refused.value).startswith(f"trainer_config.distributed_method: {problem}")


def test_hsdp_accepts_two_or_more_nodes_of_equal_size():
    check_nodes_for_hsdp([2, 2, 2, 2])
    check_nodes_for_hsdp([1, 1])


def step_losses(snapshot, epoch=None, value="loss"):
    """Train losses (or another value of the train lines) of the run that wrote snapshot (a file of
    a snapshot folder: the folder's run)."""
    in_folder = snapshot.name.startswith("snapshot_")
    metrics = snapshot.parent / "metrics.jsonl" if in_folder else default_metrics_path(str(snapshot))
    lines = read_metrics(str(metrics), "train")
    return [line[value] for line in lines if epoch is None or line["epoch"] == epoch]


@pytest.fixture(scope="module")
def runs(fsdp_two_epochs, ddp_two_epochs):
    """Snapshots and losses of the suite's two-epoch runs, FSDP's and DDP's, each into a snapshot
    folder whose first epoch's snapshot is also a one-epoch run's (the learning rate is constant)."""
    fsdp1, fsdp2 = fsdp_two_epochs.snapshots
    return {"fsdp1": fsdp1, "fsdp2": fsdp2, "ddp1": ddp_two_epochs.snapshots[0]}


def test_fsdp_losses_and_gradient_norms_match_ddp_step_by_step(runs):
    fsdp, ddp = step_losses(runs["fsdp1"], epoch=1), step_losses(runs["ddp1"], epoch=1)
    assert len(fsdp) == len(ddp) > 50
    assert fsdp[:20] == pytest.approx(ddp[:20], rel=1e-5)
    assert fsdp[-1] < fsdp[0] - 0.5, "FSDP did not train"
    # The norm of the whole gradient, not of this rank's shard of it
    fsdp_norms, ddp_norms = (step_losses(runs[run], epoch=1, value="grad_norm")[:20]
                             for run in ("fsdp1", "ddp1"))
    assert fsdp_norms == pytest.approx(ddp_norms, rel=1e-4) and min(ddp_norms) > 0


def resume(runs, source, text_file, tmp_path, method, nproc, capsys, **extra):
    """Continue a one-epoch snapshot into a second epoch: on 2 ranks to its end, in one process (this
    one) for five steps; return the run's output and that epoch's losses."""
    snapshot = tmp_path / "resumed.pt"
    shutil.copy(runs[source], snapshot)
    if nproc == 1:
        extra["trainer_config__max_steps"] = torch.load(snapshot, weights_only=True)["step"] + 5
    overrides = tiny_overrides(text_file, snapshot, trainer_config__distributed_method=method,
                               trainer_config__max_epochs=2, **extra)
    result = run_main_in_process(overrides, capsys) if nproc == 1 else run_main(overrides, nproc=nproc)
    assert_ok(result)
    assert "Resuming training from snapshot at Epoch 1" in result.stdout
    return result.stdout, step_losses(snapshot, epoch=2)


@pytest.mark.parametrize("source, method, nproc, offload", [
    # DDP -> FSDP with parameters, gradients and AdamW state in host memory (CPU offload)
    ("ddp1", "fsdp", 2, True),
    ("fsdp1", "ddp", 1, False),   # FSDP -> DDP, 2 ranks -> 1 (2 -> 2 and HSDP's hops: test_cluster.py)
])
def test_snapshots_resume_across_methods_and_world_sizes(runs, text_file, tmp_path, capsys, one_torch_thread,
                                                         source, method, nproc, offload):
    output, resumed = resume(runs, source, text_file, tmp_path, method, nproc, capsys,
                             trainer_config__cpu_offload=offload)
    assert ("with CPU offload" in output) == offload
    unbroken = step_losses(runs["fsdp2"], epoch=2)
    if nproc == 2:  # same data per step: the losses follow the unbroken run's (without offload) closely
        assert resumed == pytest.approx(unbroken, rel=1e-3)
    first_loss = step_losses(runs["fsdp1"], epoch=1)[0]
    assert resumed and max(resumed) < first_loss - 0.5, "resumed from untrained weights"


@pytest.fixture(scope="module")
def grad_sync(probe_runs):
    """tests/workers/grad_sync_probe.py on 2 ranks: one step of 32 samples per rank, whole and as 2 x 16."""
    return probe_runs / "grad_sync"


@pytest.mark.parametrize("method", ["ddp", "fsdp"])
def test_accumulation_synchronises_gradients_on_the_last_micro_batch_only(grad_sync, method):
    for rank in range(2):
        syncs = json.loads((grad_sync / f"syncs_rank{rank}.json").read_text())[method]
        whole, = syncs["1"]  # collectives of the one backward pass of a step without accumulation
        assert whole > 0
        assert syncs["2"] == [0, whole], "the first micro-batch communicated, or the last did not"


def relative_difference(tensor, expected) -> float:
    """Largest difference over expected's largest element (an elementwise one fails on zeros)."""
    return ((tensor - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("method", ["ddp", "fsdp"])
def test_accumulated_micro_batches_equal_one_large_batch(grad_sync, method):
    """After one AdamW step, exp_avg is 0.1 x the synchronised gradient: the gradients match to
    float rounding. The weights moved by about the learning rate (3e-3) each, by Adam's g / |g|;
    where a gradient is as small as Adam's eps (1e-8), rounding moves that a little (up to 3e-6)."""
    whole, split = (torch.load(grad_sync / f"{method}_accum{n}.pt", weights_only=True) for n in (1, 2))
    assert whole["model"].keys() == split["model"].keys()
    for name, weight in whole["model"].items():
        off = (split["model"][name] - weight).abs().max().item()
        assert off <= 1e-5, f"{name}: off by {off:.2g}"
    moments = whole["optimizer"]["state"]
    assert moments.keys() == split["optimizer"]["state"].keys()
    for name, state in moments.items():
        assert state["exp_avg"].abs().max() > 0, f"{name}: the step saw no gradient"
        for moment in ("exp_avg", "exp_avg_sq"):
            off = relative_difference(split["optimizer"]["state"][name][moment], state[moment])
            assert off <= 1e-5, f"{name} {moment}: off by {off:.2g} of its largest element"


def test_fsdp_keeping_gathered_parameters_until_backward_changes_no_bit(grad_sync):
    """reshard_after_forward=False skips the backward pass's all-gathers; the step is the same."""
    kept, resharded = (torch.load(grad_sync / f"fsdp_dropout_{name}.pt", weights_only=True)
                       for name in ("kept_after_forward", "none"))
    assert_same_state(kept, resharded)


@pytest.mark.parametrize("method", ["ddp", "fsdp"])
def test_activation_checkpointing_gives_the_same_step_from_fewer_saved_bytes(grad_sync, method):
    """With dropout on, 2 micro-batches: weights and AdamW state after the step are bitwise those
    without checkpointing (under FSDP the recomputation runs on the block's parameters as gathered
    for its backward pass), and each forward pass held far fewer activation bytes on every rank."""
    plain, checkpointed = (torch.load(grad_sync / f"{method}_dropout_{mode}.pt", weights_only=True)
                           for mode in ("none", "full"))
    assert_same_state(checkpointed, plain)
    assert any(state["exp_avg"].abs().max() > 0 for state in plain["optimizer"]["state"].values())
    for rank in range(2):
        saved = json.loads((grad_sync / f"activations_rank{rank}.json").read_text())[method]
        assert all(0 < full < none / 3 for full, none in zip(saved["full"], saved["none"])), saved


@pytest.fixture(scope="module")
def init_probe(probe_runs):
    """tests/workers/init_probe.py on 2 ranks: meta-built models placed by each method, and a peak."""
    return probe_runs / "init"


def test_initial_weights_are_the_same_for_every_method_and_world_size(init_probe, world_of_one):
    """Bit for bit: a model built whole (no parallelism), and built on the meta device then placed
    by DDP, FSDP and FSDP with CPU offload, on 1 rank and on 2 (uneven shards included)."""
    expected = GPT(TINY, seed=SEED).state_dict()
    one_rank = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                       backend="gloo")
    placements = {f"{name} on 1 rank": get_model_state_dict(placed(TINY, parallelism, one_rank),
                                                            options=FULL_STATE)
                  for name, parallelism in PLACEMENTS.items()}
    placements.update({f"{name} on 2 ranks": torch.load(init_probe / f"{name}.pt", weights_only=True)
                       for name in PLACEMENTS})
    for placement, state in placements.items():
        assert state.keys() == expected.keys(), placement
        different = [name for name, value in expected.items() if not torch.equal(state[name], value)]
        assert not different, f"{placement}: {different} differ"


def test_fsdp_start_up_never_holds_the_whole_model(init_probe):
    """A rank's resident memory, while a 101 MB model is built on the meta device and sharded over
    2 ranks, peaks near its half (its shards) plus one parameter at a time (4 MB at most), never
    near the whole model, as it would if the model were materialised before being sharded."""
    for rank in range(2):
        facts = json.loads((init_probe / f"peak_rank{rank}.json").read_text())
        model = facts["model_bytes"]
        assert model > 20 * facts["largest_parameter_bytes"]
        assert 0.45 * model < facts["peak_rise"] < 0.75 * model, f"rank {rank}: {facts}"


class ShardOf:
    """What local_rows reads of an FSDP2 parameter: its full shape, placements, mesh, local shard."""

    def __init__(self, rows: int, placements: list, mesh_sizes: list[int], coordinates: list[int],
                 local: int):
        self.shape, self.placements = (rows, 3), placements
        self.device_mesh = SimpleNamespace(size=lambda dim: mesh_sizes[dim],
                                           get_local_rank=lambda dim: coordinates[dim])
        self.local = torch.empty(local, 3)

    def to_local(self) -> torch.Tensor:
        return self.local


@pytest.mark.parametrize("rows, ranks", [(10, 4), (2, 4), (8, 2), (1, 3)])
def test_a_shard_holds_the_rows_torch_chunk_gives_its_rank(rows, ranks):
    """fsdp (one mesh dimension) and hsdp (replicated across 2 nodes, sharded within each): the rows
    materialize asks the initial values for, uneven and empty shards included."""
    chunks = list(torch.arange(rows).chunk(ranks)) + [torch.arange(0)] * ranks
    for rank in range(ranks):
        expected = chunks[rank].tolist()
        layouts = [([Shard(0)], [ranks], [rank]), ([Replicate(), Shard(0)], [2, ranks], [1, rank])]
        for placements, sizes, coordinates in layouts:
            found = local_rows(ShardOf(rows, placements, sizes, coordinates, len(expected)))
            assert list(range(rows))[found] == expected


@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_decides_what_a_block_holds_after_its_forward_pass(world_of_one, reshard):
    """After a forward pass a block's parameters are its shards again (DTensors), or, with
    reshard_after_forward=False, still the gathered ones, kept for the backward pass."""
    from mingpt.distributed.parallel import Parallelism, parallelize
    from mingpt.distributed.precision import Precision
    from mingpt.model import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=2, n_head=1, n_embd=8, vocab_size=5, block_size=4))
    method = Parallelism("fsdp", reshard_after_forward=reshard, cpu_collectives=True)
    model = parallelize(model, method, Precision("cpu", None), world_of_one)
    model(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    sharded = {hasattr(param, "to_local") for block in model.blocks for param in block.parameters()}
    assert sharded == {reshard}


VIEW_WARNING = "returned a view tensor"


def test_fsdp_says_no_view_warning_of_the_logits_and_hides_no_other(world_of_one):
    """GPT.forward returns its logits as a view (the vocabulary's padding cut off, not copied), and
    FSDP2 warned of it on every rank of every FSDP run; that warning is silenced for the sharded GPT's
    logits alone, the same warning of another module still said."""
    from mingpt.distributed.parallel import Parallelism, parallelize
    from mingpt.distributed.precision import Precision
    from mingpt.model import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=5, block_size=4))
    assert model.config.padded_vocab_size > 5  # so the logits returned are a view
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        method = Parallelism("fsdp", cpu_collectives=True)
        model = parallelize(model, method, Precision("cpu", None), world_of_one)
        logits, loss = model(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
        loss.backward()
        warnings.warn(f"FSDP2-wrapped module (FSDPBlock) {VIEW_WARNING}.", UserWarning)
    assert logits._base is not None  # still the view, no copy of B x T x V
    assert [str(w.message) for w in said if VIEW_WARNING in str(w.message)] == [
        f"FSDP2-wrapped module (FSDPBlock) {VIEW_WARNING}."]


def test_an_fsdp_run_says_no_view_warning(fsdp_two_epochs):
    assert VIEW_WARNING not in fsdp_two_epochs.stderr
