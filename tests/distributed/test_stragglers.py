"""stragglers.py: each rank's time before it arrives at the gradient synchronisation, and the rank
that holds the others back named with its phase (the real 2-rank runs:
tests/end_to_end/test_fault_tolerance.py)."""
import torch
import torch.nn as nn

from mingpt.distributed.stragglers import StepClock, StepTimes, StragglerWatch

HOSTS = {0: "node1", 1: "node2", 2: "node3"}


def totals(per_step: dict[int, tuple[float, float]], steps: int) -> dict[int, StepTimes]:
    """Running totals after `steps` steps of (data, compute) seconds per step for each rank."""
    return {rank: StepTimes(steps, data * steps, compute * steps)
            for rank, (data, compute) in per_step.items()}


def judged(watch: StragglerWatch, per_step: dict[int, tuple[float, float]], windows: int) -> list[str]:
    """The slow-rank sentence of each of `windows` windows of 10 steps."""
    return [watch.window(10 * (i + 1), totals(per_step, 10 * (i + 1)), HOSTS).slow
            for i in range(windows)]


def test_a_rank_slow_at_loading_data_is_named_from_its_second_slow_window():
    watch = StragglerWatch()
    assert watch.window(0, totals({0: (0, 0), 1: (0, 0), 2: (0, 0)}, 0), HOSTS) is None  # the baseline
    said = judged(watch, {0: (0.01, 0.10), 1: (0.01, 0.10), 2: (0.05, 0.10)}, windows=3)
    assert said == ["", *["rank 2 (node3) is 1.4x the others' median step: data loading"] * 2]


def test_a_rank_slow_at_computing_is_named_with_its_phase_and_every_rank_figures_in_the_window():
    watch = StragglerWatch()
    watch.window(0, totals({0: (0, 0), 1: (0, 0)}, 0), HOSTS)
    said = judged(watch, {0: (0.01, 0.10), 1: (0.01, 0.30)}, windows=2)
    assert said == ["", "rank 1 (node2) is 2.8x the others' median step: computation"]
    window = watch.window(30, totals({0: (0.01, 0.10), 1: (0.01, 0.30)}, 30), HOSTS)
    assert window.metrics() == {"step": 30, "data_ms": [10.0, 10.0], "compute_ms": [100.0, 300.0],
                                "slow": "rank 1 (node2) is 2.8x the others' median step: computation"}


def test_a_healthy_run_and_a_single_slow_window_name_nobody():
    watch = StragglerWatch()
    watch.window(0, totals({0: (0, 0), 1: (0, 0)}, 0), HOSTS)
    assert judged(watch, {0: (0.010, 0.100), 1: (0.012, 0.110)}, windows=4) == [""] * 4
    # One slow window (a page fault, a neighbour's burst), then healthy again.
    blip = watch.window(50, {0: StepTimes(50, 0.5, 5.0), 1: StepTimes(50, 0.6, 9.0)}, HOSTS)
    assert blip.slow == ""
    assert watch.window(60, {0: StepTimes(60, 0.6, 6.0), 1: StepTimes(60, 0.7, 10.1)}, HOSTS).slow == ""


def test_a_window_waits_until_every_rank_has_taken_a_step():
    watch = StragglerWatch()
    watch.window(0, {0: StepTimes(), 1: StepTimes()}, HOSTS)
    # Rank 1's post is not read yet: the window stays open, then covers both ranks' steps.
    assert watch.window(5, {0: StepTimes(5, 0.05, 0.5), 1: StepTimes()}, HOSTS) is None
    window = watch.window(10, {0: StepTimes(10, 0.1, 1.0), 1: StepTimes(10, 0.1, 1.0)}, HOSTS)
    assert window.compute_ms == [100.0, 100.0]
    alone = StragglerWatch()
    assert alone.window(0, {0: StepTimes(3, 1.0, 1.0)}, HOSTS) is None  # one rank: none to compare


def test_the_clock_times_data_then_compute_up_to_the_last_gradients_of_a_real_backward_pass():
    embedding, head = nn.Embedding(11, 8), nn.Linear(8, 11)
    clock = StepClock(torch.device("cpu"))
    clock.time_arrival_at([embedding.weight])
    marks = {}
    head.weight.register_post_accumulate_grad_hook(lambda _: marks.setdefault("head", clock._arrival))
    for _ in range(2):
        clock.waiting_for_data()
        clock.computing()
        head(embedding(torch.tensor([1, 2, 3]))).sum().backward()
        arrival = clock._arrival
        clock.step_done()
    assert marks["head"] is None  # the head's gradient comes before the embedding's: not yet arrived
    assert arrival is not None
    assert clock.times.steps == 2 and clock.times.data_s >= 0 and clock.times.compute_s > 0
    clock.step_done()  # a step end without its start (after an evaluation) adds nothing
    assert clock.times.steps == 2


def test_a_run_alone_times_no_step():
    """Alone (or without a launcher) nobody reads the step times: the hot path does not keep them."""
    from mingpt.distributed.watchdog import RunWatchdog

    watch = RunWatchdog(0, 1, 60.0, "/tmp", lambda: "", StepClock(torch.device("cpu")))
    for phase in ("data", "forward", "backward", "optimizer"):
        watch.at(phase, 1)
    assert not watch.active and watch.clock.times == StepTimes()
