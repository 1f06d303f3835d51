"""planning/check.py: the parts of plan.py --check that need no more than the layers below it: the
ranks checked by default, what a rank holds and what a step allocates, measured on real tensors, and
the tolerances the report judges the planner by. The check of whole ranks: tests/test_cluster_check.py."""
import torch

from mingpt.planning.check import Held, RankCheck, StepMemory, checked_ranks, held_by, storage_bytes


def test_the_ranks_checked_by_default_are_the_first_a_middle_one_and_the_last():
    assert checked_ranks(512) == [0, 256, 511]
    assert checked_ranks(1) == [0]
    assert checked_ranks(64, "63,0,0") == [0, 63]


def test_what_a_rank_holds_is_its_storages_each_counted_once():
    """held_by reads the storages behind the tensors: a view (GPT's tied weights, a shard's padding) is
    counted once, and the optimizer's state only once it exists (after the first step)."""
    model = torch.nn.Linear(8, 4)
    model.register_parameter("tied", model.weight)  # the same storage under a second name
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # one buffer a parameter
    before = held_by(model, optimizer)
    assert (before.parameters, before.gradients, before.optimizer) == (4 * (32 + 4), 0, 0)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    after = held_by(model, optimizer)
    assert after.gradients == after.parameters == 4 * 36
    assert after.optimizer == after.parameters  # a momentum buffer of each parameter's size
    assert storage_bytes([model.weight, model.weight.view(-1), model.weight[1:]]) == 4 * 32


def test_a_step_s_memory_is_followed_phase_by_phase_until_freed():
    """StepMemory keeps each phase's largest total of live storages made while it records; what is
    freed stops counting (a tensor of 4,000 bytes and one of 2,000: 6,000 at the peak, 2,000 after)."""
    with StepMemory() as memory:
        memory.at("forward")
        first = torch.zeros(1000)
        second = torch.zeros(500)
        del first
        memory.at("backward")
        third = torch.zeros(250)
    assert memory.peaks == {"forward": 6000, "backward": 3000}
    assert memory.live() == 3000
    del second, third
    assert memory.live() == 0


def test_the_report_judges_the_planner_within_its_tolerances():
    """2% for what a rank holds (both exact), 15% for activations (the planner's are traced on fake
    tensors): a disagreement is named with both figures."""
    mb = 10**6
    planned = {"parameters": 100 * mb, "gradients": 100 * mb, "optimizer": 200 * mb, "activations": 100 * mb}

    def judged(held: Held, activations: int) -> list[str]:
        return RankCheck(0, "node 0, local rank 0", 1.0, held, 0, activations, planned, {}).disagreements()

    assert judged(Held(101.9 * mb, 100 * mb, 200 * mb), 114.9 * mb) == []
    assert judged(Held(102.1 * mb, 100 * mb, 200 * mb), 100 * mb) == [
        "parameters: measured 102.1 MB, planned 100.0 MB"]
    assert judged(Held(100 * mb, 100 * mb, 195 * mb), 85.1 * mb) == [
        "optimizer: measured 195.0 MB, planned 200.0 MB"]
    assert judged(Held(100 * mb, 100 * mb, 200 * mb), 84.9 * mb) == [
        "activations: measured 84.9 MB, planned 100.0 MB"]
