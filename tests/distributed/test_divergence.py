"""divergence.py: the DivergenceWatch's verdicts, judged a step late, with and without a GradScaler:
values that are not finite, spikes that settle (a lone one, new data being learned) or do not, slow
rises; and the run's Health. Real runs of each case: tests/end_to_end/test_divergence_runs.py."""
import math

import pytest
import torch

from mingpt.distributed.divergence import RISE_ONSET, DivergenceWatch, Health, SpikeRule


def observe(watch: DivergenceWatch, step: int, loss: float, norm: float = 1.0) -> None:
    watch.observe(step, torch.tensor(loss), torch.tensor(norm))


def observe_all(watch: DivergenceWatch, losses, norms=None, start: int = 1) -> int:
    """Each loss (and gradient norm, 1.0 unless given) as a step from start on; the next step."""
    norms = norms or [1.0] * len(losses)
    for step, (loss, norm) in enumerate(zip(losses, norms), start=start):
        observe(watch, step, loss, norm)
    return start + len(losses)


def test_one_non_finite_step_is_divergence_without_a_scaler_read_a_step_later():
    watch = DivergenceWatch(torch.device("cpu"), scaled=False)
    observe(watch, 1, 2.5)
    observe(watch, 2, 2.4, norm=float("inf"))  # the clip would scale every gradient by inf
    assert watch.diverged_since() == 0  # the verdict of the step before the newest
    observe(watch, 3, float("nan"))
    assert watch.diverged_since() == 2
    divergence = watch.divergence()
    assert (divergence.kind, divergence.loss, divergence.loss_step) == ("not finite", 2.5, 1)
    assert divergence.cause(0.5) == ("the loss is not finite from step 2 (learning rate 0.5; last finite "
                                     "loss 2.5000 at step 1)")


def test_under_a_scaler_overflows_are_skipped_steps_and_only_a_lasting_nan_loss_diverges():
    watch = DivergenceWatch(torch.device("cpu"), scaled=True)
    for step in range(1, 4):
        observe(watch, step, 2.0, norm=float("inf"))  # overflowed gradients: the scaler skips them
    observe(watch, 4, float("nan"))
    observe(watch, 5, float("nan"))
    observe(watch, 6, 2.0)  # a NaN loss that passes is an overflow too
    observe(watch, 7, float("nan"))
    assert watch.diverged_since() == 0
    for step in range(8, 11):
        observe(watch, step, float("inf"))
    assert watch.diverged_since() == 7  # nan at 7, inf at 8 and 9: three in a row


def test_a_lone_spike_is_not_divergence_and_the_snapshot_before_it_is_no_longer_healthy():
    watch = DivergenceWatch(torch.device("cpu"), scaled=False, spike=SpikeRule(2.0, 3))
    observe_all(watch, [4.0, 3.0, 2.0, 2.0, 2.0, 6.0, 2.1, 2.0])  # a lone spike at 6
    assert watch.diverged_since() == 0
    assert watch.health() == Health(as_of=7, last_unhealthy=6)
    assert not watch.health().followed_healthily(5) and watch.health().followed_healthily(6)


def test_a_spike_whose_gradient_norm_stays_high_is_divergence_from_its_first_step():
    """A learning rate too high: the loss jumps and the gradient norm stays many times its usual
    size, though the loss wanders (down at times). After `steps` steps unsettled, the run diverged
    from the spike's first step; the spikes never entered the means."""
    watch = DivergenceWatch(torch.device("cpu"), scaled=False, spike=SpikeRule(2.0, 5))
    following = observe_all(watch, [3.0, 2.5, 2.0, 2.0, 2.0], [1.0, 1.2, 0.8, 1.0, 1.0])
    spike = [40.0, 110.0, 60.0, 30.0, 50.0]  # 30 < 110: coming down, but the norm says otherwise
    observe_all(watch, [*spike, 45.0], [60.0, 20.0, 18.0, 25.0, 19.0, 22.0], start=following)
    divergence = watch.divergence()
    assert watch.diverged_since() == following == 6 and divergence.kind == "spike"
    assert divergence.loss == 110.0 and 2.0 < divergence.reference < 2.6 and divergence.norm == 19.0
    assert 0.9 < divergence.norm_reference < 1.1 and divergence.steps == 5
    assert divergence.cause(3.0).startswith("the loss spiked from step 6 (to 110, ")
    assert "and did not settle in 5 steps (its gradient norm 19, " in divergence.cause(3.0)
    assert watch.health() == Health(as_of=10, last_unhealthy=10)


def test_a_change_of_data_that_the_run_learns_settles_and_the_means_start_again():
    """Easy text learnt down to a loss of 0.05, then harder text: the loss jumps 90 times over and
    comes down, the gradient norm back to its usual size within a few steps (as measured on a real
    run of this kind). The spike settles there; the means start from the new data, so that a later
    spike is measured against the new level, not the old one."""
    watch = DivergenceWatch(torch.device("cpu"), scaled=False, spike=SpikeRule(2.0, 20))
    following = observe_all(watch, [0.06, 0.05, 0.05, 0.06, 0.05] * 4, [0.8] * 20)
    change = [4.4, 7.5, 6.7, 6.1, 5.2, 4.8, 4.4, 4.1, 3.8, 3.7, 3.4, 3.3, 3.3, 3.2]
    norms = [4.6, 7.5, 6.0, 5.3, 5.1, 4.0, 3.3, 2.4, 2.1, 2.0, 1.4, 1.1, 1.0, 0.7]
    following = observe_all(watch, change, norms, start=following)
    assert watch.diverged_since() == 0
    settled = 21 + norms.index(1.4)  # the first norm under 2 x 0.8
    assert watch.health() == Health(as_of=following - 2, last_unhealthy=settled - 1)
    following = observe_all(watch, [3.2, 3.1, 3.1, 3.0, 3.0] * 4, start=following)  # learning on
    spike = [9.0] * 4  # three times the new level, for good, the norm high
    observe_all(watch, [*spike, 9.0], [9.0] * 5, start=following)
    assert watch.diverged_since() == 0  # 4 of 20 steps: not yet
    assert watch.health().last_unhealthy == following + 3


def test_a_slow_rise_is_divergence_from_where_it_began_and_its_steps_are_not_healthy():
    """A loss that climbs 1% a step never spikes (each step is close to the recent mean, which
    follows it), but the recent mean reaches twice the run's best: divergence, from the step it
    passed RISE_ONSET of the way there. The snapshot before that step is the one to go back to."""
    watch = DivergenceWatch(torch.device("cpu"), scaled=False, spike=SpikeRule(2.0, 20))
    losses = [3.0] * 30 + [3.0 * 1.01 ** n for n in range(1, 200)]
    steps = observe_all(watch, losses, [0.5] * len(losses))
    divergence = watch.divergence()
    assert divergence is not None and divergence.kind == "rise", watch.health()
    assert divergence.reference == pytest.approx(3.0) and divergence.loss >= 6.0
    began = divergence.since  # the recent mean lags the loss: the loss had passed the onset, not the end
    assert 3.0 * (1 + RISE_ONSET) < losses[began - 1] < 3.0 * 1.5 < 6.0 <= losses[watch.health().as_of - 1]
    health = watch.health()
    assert health.last_unhealthy == health.as_of < steps - 1
    assert divergence.cause(0.7).startswith(f"the loss rose from step {began} (its 5-step average ")
    assert ", 2.0x the run's best 3.0000 at step " in divergence.cause(0.7)


def test_a_rise_that_turns_back_before_it_diverges_is_healthy_again():
    watch = DivergenceWatch(torch.device("cpu"), scaled=False)
    losses = [3.0] * 30 + [3.0 * 1.01 ** n for n in range(1, 50)] + [4.8 * 0.99 ** n for n in range(1, 80)]
    observe_all(watch, losses)
    assert watch.diverged_since() == 0
    health = watch.health()
    assert 40 < health.last_unhealthy < health.as_of  # it rose past the onset, then came back
    assert health.followed_healthily(health.as_of - 1)


def test_spikes_and_rises_are_not_judged_when_switched_off_but_non_finite_losses_are():
    watch = DivergenceWatch(torch.device("cpu"), scaled=False, spike=SpikeRule(0, 3))
    observe_all(watch, [2.0, 50.0, 60.0, 70.0, 80.0, *[100.0 + n for n in range(40)], math.nan, 1.0])
    divergence = watch.divergence()
    assert watch.diverged_since() == 46 and divergence.kind == "not finite"
    assert (divergence.loss, divergence.loss_step) == (139.0, 45)
