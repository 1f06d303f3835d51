"""Muon under fsdp and hsdp (distributed/muon.py) against one process, on real torchrun ranks (gloo).

tests/workers/muon_probe.py trains a tiny GPT three steps on the same global batches on 2 ranks (ddp,
fsdp, fsdp with CPU offload) and on 4 (ddp, fsdp, hsdp as 2 nodes of 2, hsdp with CPU offload); here
one process trains it alone. The matrices' rows split unevenly over 4 ranks (90 = 23+23+23+21).

How close "the same update" can be: Newton-Schulz computes in bf16, so a gradient that differs in its
last fp32 bit (a sum over 2 ranks' halves of the batch instead of one sum) can round to another bf16
number and move the update by a bf16 step; each later step's gradient then differs by that much,
and Muon, which maps small singular values up, amplifies it: after 3 steps DDP's torch.optim.Muon
itself is 5% from one process on this model. So: the exchange is held bit for bit (each rank's rows
of the whole matrix's orthogonalisation, the same input to both), the first step to bf16 rounding, and
the third step to as close as DDP gets.
"""
from types import SimpleNamespace

import pytest
import torch
from helpers import TORCHRUN, WORKER_SCRIPTS, assert_ok, run
from workers.muon_probe import OPTIMIZER, SEED, TINY, train

from mingpt.distributed.muon import hidden_traffic, ns_cost
from mingpt.model import GPT
from mingpt.optimizer import create_optimizer, hidden_matrices

pytestmark = pytest.mark.slow

CASES = {2: ("ddp", "fsdp", "fsdp_offload"), 4: ("ddp", "fsdp", "hsdp", "hsdp_offload")}
SHARDED = [(ranks, case) for ranks, cases in CASES.items() for case in cases if case != "ddp"]


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict:
    """Each world size's run: {ranks: {case: the gathered state, and each rank's facts}}."""
    import json

    runs = {}
    for ranks, cases in CASES.items():
        out = tmp_path_factory.mktemp(f"muon_{ranks}")
        assert_ok(run([*TORCHRUN, "--standalone", f"--nproc_per_node={ranks}", WORKER_SCRIPTS / "muon_probe.py",
                       out, *cases], timeout=400))
        runs[ranks] = {case: SimpleNamespace(
            state=torch.load(out / f"{case}.pt", weights_only=True),
            ranks=[json.loads((out / f"{case}_rank{rank}.json").read_text()) for rank in range(ranks)])
            for case in cases}
    return runs


@pytest.fixture(scope="module")
def one_process(one_torch_thread) -> SimpleNamespace:
    model = GPT(TINY, seed=SEED)
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer = create_optimizer(model, OPTIMIZER)
    steps = []
    train(model, optimizer, 0, 1, after_step=lambda: steps.append(
        {name: value.clone() for name, value in model.state_dict().items()}))
    names = {id(p): name for name, p in model.named_parameters()}
    return SimpleNamespace(initial=initial, steps=steps, hidden=[names[id(p)] for p in hidden_matrices(model)],
                           momentum={names[id(p)]: optimizer.state[p]["momentum_buffer"]
                                     for p in hidden_matrices(model)})


def update_error(weights: dict, reference: dict, initial: dict, name: str) -> float:
    """How far an update of a matrix lies from the reference's, relative to the reference's."""
    expected = reference[name] - initial[name]
    return ((weights[name] - initial[name] - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("ranks, case", SHARDED)
def test_each_rank_gets_its_rows_of_the_whole_matrix_orthogonalised_bit_for_bit(probed, ranks, case):
    for rank, facts in enumerate(probed[ranks][case].ranks):
        assert facts["muon_class"] == "ShardedMuon"
        assert facts["exchange_exact"] == [True] * 8, f"rank {rank}"
    assert {facts["muon_class"] for facts in probed[ranks]["ddp"].ranks} == {"Muon"}


@pytest.mark.parametrize("ranks, case", SHARDED)
def test_each_matrix_is_orthogonalised_whole_once_a_step_and_the_work_is_spread_evenly(probed, ranks, case,
                                                                                       one_process):
    """Per node (hsdp: each node's ranks do their copy's work), every matrix once a step, whole, on one
    rank; the busiest rank does at most 1.25x an even share of the Newton-Schulz work; each rank sends
    about what distributed.muon.hidden_traffic says (the uneven rows' padding aside)."""
    shapes = sorted(list(one_process.initial[name].shape) for name in one_process.hidden)
    per_node = ranks // 2 if case.startswith("hsdp") else ranks
    facts = probed[ranks][case].ranks
    for node in range(ranks // per_node):
        mine = [facts[rank]["orthogonalised"] for rank in range(node * per_node, (node + 1) * per_node)]
        assert sorted(shape for rank in mine for shape in rank) == sorted(shapes * 3)  # 3 steps
        work = [sum(ns_cost(shape) for shape in rank) for rank in mine]
        assert max(work) <= 1.25 * sum(work) / per_node, work
    hidden = sum(torch.Size(shape).numel() for shape in shapes)
    for rank, rank_facts in enumerate(facts):
        sent = [sum(sizes) - sizes[rank % per_node] for sizes in rank_facts["sent"]]  # not to itself
        assert len(sent) == 6  # two exchanges a step
        assert sum(sent) / 3 == pytest.approx(hidden_traffic(hidden, per_node), rel=0.35)
    mean = sum(sum(sizes) - sizes[r % per_node] for r, f in enumerate(facts) for sizes in f["sent"]) / 3 / ranks
    assert mean == pytest.approx(hidden_traffic(hidden, per_node), rel=0.1)


@pytest.mark.parametrize("ranks, case", SHARDED)
def test_sharded_muon_makes_the_updates_of_one_process(probed, ranks, case, one_process):
    """The first step within bf16 rounding of one process's (most matrices bit for bit); the third as
    close to it as DDP's torch.optim.Muon on the same ranks gets; the momentum buffers and AdamW's
    part alike."""
    run, ddp = probed[ranks][case].state, probed[ranks]["ddp"].state
    initial, reference = one_process.initial, one_process.steps
    for name in one_process.hidden:
        assert update_error(run["steps"][0], reference[0], initial, name) <= 1e-2, name
        ddp_error = update_error(ddp["steps"][-1], reference[-1], initial, name)
        assert update_error(run["steps"][-1], reference[-1], initial, name) <= 1.5 * ddp_error + 1e-2, name
        momentum = run["optimizer"]["state"][name]["momentum_buffer"]
        expected = one_process.momentum[name]
        assert ((momentum - expected).norm() / expected.norm()).item() <= 1e-2, name
    for name, value in reference[-1].items():
        if name not in one_process.hidden:
            torch.testing.assert_close(run["model"][name], value, rtol=0, atol=1e-4, msg=name)
