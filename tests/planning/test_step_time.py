"""planning/step_time.py: the alpha-beta model of ring collectives, what each method moves per step
(ddp's one all-reduce of the fp32 gradients, fsdp's gathers per micro-batch, hsdp's gradient shards
across nodes), and what overlap leaves exposed. plan.py's advice from it: test_advice.py."""
from dataclasses import replace

import pytest

from mingpt.planning.memory import ModelSizes
from mingpt.planning.step_time import Cluster, StepWork, Traffic, accumulation_for, collective, step_time

GB = 1e9
P = 124_000_000  # GPT-2's parameters
WORK = StepWork(ModelSizes(total=P, per_block=7_000_000, n_layer=12), flops_per_token=6 * P,
                recompute_flops_per_token=0, tokens_per_micro_batch=16 * 1024, compute_bytes=2)


def cluster(nodes: int, per_node: int, **links) -> Cluster:
    return Cluster(nodes, per_node, memory=80 * 2**30, peak_flops=1e15, utilization=0.5,
                   **{"intra_bandwidth": 100 * GB, "inter_bandwidth": 50 * GB, **links})


def test_a_ring_all_reduce_moves_twice_what_an_all_gather_moves_in_twice_the_steps():
    """Within a node of 8: 2 (n - 1) / n x S bytes each way in 2 (n - 1) latencies; half for a gather."""
    c, size = cluster(1, 8), 4 * GB
    reduced = collective(size, c, 8, 1, all_reduce=True)
    gathered = collective(size, c, 8, 1, all_reduce=False)
    assert reduced.intra_bytes == pytest.approx(2 * 7 / 8 * size) and reduced.inter_bytes == 0
    assert reduced.seconds == pytest.approx(2 * 7 * c.intra_latency + 2 * 7 / 8 * size / c.intra_bandwidth)
    assert gathered.intra_bytes == pytest.approx(reduced.intra_bytes / 2)
    assert gathered.seconds == pytest.approx(reduced.seconds / 2)


def test_across_nodes_the_network_part_adds_and_a_node_s_ranks_share_its_links():
    c, size = cluster(4, 8), 4 * GB
    reduced = collective(size, c, 8, 4, all_reduce=True)
    across = 2 * 3 / 4 * size  # what a node sends through its links
    assert reduced.inter_bytes == pytest.approx(across / 8)  # each rank's share
    within = 2 * 7 * c.intra_latency + 2 * 7 / 8 * size / c.intra_bandwidth
    assert reduced.seconds == pytest.approx(within + 2 * 3 * c.inter_latency + across / c.inter_bandwidth)


@pytest.mark.parametrize("method", ["ddp", "fsdp", "hsdp"])
def test_one_rank_moves_nothing_and_loses_nothing(method):
    timing = step_time(method, WORK, cluster(1, 1))
    assert timing.traffic == Traffic() and timing.exposed == 0 and timing.efficiency == 1.0


def test_ddp_all_reduces_the_fp32_gradients_once_per_optimizer_step_whatever_the_accumulation():
    c = cluster(2, 8)
    one, four = step_time("ddp", WORK, c), step_time("ddp", replace(WORK, grad_accum_steps=4), c)
    assert one.traffic == four.traffic == collective(4 * P, c, 8, 2, all_reduce=True)
    assert four.compute == pytest.approx(4 * one.compute) and four.efficiency > one.efficiency


@pytest.mark.parametrize("reshard, gathers", [(True, 2), (False, 1)])
def test_fsdp_gathers_the_parameters_per_micro_batch_and_scatters_the_gradients_once(reshard, gathers):
    """One all-gather of the bf16 parameters in the forward pass and, resharded after it, another in
    the backward pass, per micro-batch; one reduce-scatter of the fp32 gradients per step."""
    c, work = cluster(2, 8), replace(WORK, grad_accum_steps=3)
    units = WORK.sizes.n_layer + 1
    gather = collective(2 * P, c, 8, 2, all_reduce=False, messages=units)
    scatter = collective(4 * P, c, 8, 2, all_reduce=False, messages=units)
    moved = step_time("fsdp", work, c, reshard_after_forward=reshard).traffic
    assert moved.intra_bytes == pytest.approx(3 * gathers * gather.intra_bytes + scatter.intra_bytes)
    assert moved.inter_bytes == pytest.approx(3 * gathers * gather.inter_bytes + scatter.inter_bytes)


def test_hsdp_shards_within_a_node_and_all_reduces_each_rank_s_gradient_shard_across_nodes():
    c = cluster(4, 8)
    hsdp = step_time("hsdp", WORK, c).traffic
    within_node = step_time("fsdp", WORK, cluster(1, 8)).traffic  # the same shards, one node
    assert hsdp.intra_bytes == pytest.approx(within_node.intra_bytes)
    assert hsdp.inter_bytes == pytest.approx(2 * 3 / 4 * 4 * P / 8)


def test_a_slower_network_exposes_more_and_enough_micro_batches_bring_the_efficiency_back():
    fast, slow = cluster(8, 8), cluster(8, 8, inter_bandwidth=10 * GB)
    assert step_time("ddp", WORK, slow).efficiency < step_time("ddp", WORK, fast).efficiency < 0.9
    needed = {name: accumulation_for(0.9, "ddp", WORK, c) for name, c in (("fast", fast), ("slow", slow))}
    assert 1 < needed["fast"] < needed["slow"]
    steps = needed["slow"]
    assert step_time("ddp", replace(WORK, grad_accum_steps=steps), slow).efficiency >= 0.9
    assert step_time("ddp", replace(WORK, grad_accum_steps=steps - 1), slow).efficiency < 0.9
