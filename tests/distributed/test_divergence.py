"""divergence.py: the DivergenceWatch's verdicts, read a step late, with and without a GradScaler."""
import torch

from mingpt.distributed.divergence import DivergenceWatch, Health, SpikeRule


def observe(watch: DivergenceWatch, step: int, loss: float, norm: float = 1.0) -> None:
    watch.observe(step, torch.tensor(loss), torch.tensor(norm))


def test_one_non_finite_step_is_divergence_without_a_scaler_read_a_step_later():
    watch = DivergenceWatch(torch.device("cpu"), scaled=False)
    observe(watch, 1, 2.5)
    observe(watch, 2, 2.4, norm=float("inf"))  # the clip would scale every gradient by inf
    assert watch.diverged_since() == 0  # the verdict of the step before the newest
    observe(watch, 3, float("nan"))
    assert watch.diverged_since() == 2 and watch.last_finite_loss() == (2.5, 1)


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


def test_a_loss_spike_that_lasts_is_divergence_and_one_the_run_recovers_from_is_not():
    watch = DivergenceWatch(torch.device("cpu"), scaled=False, spike=SpikeRule(2.0, 3))
    for step, loss in enumerate([4.0, 3.0, 2.0, 2.0, 2.0, 6.0, 2.1, 2.0], start=1):  # a lone spike at 6
        observe(watch, step, loss)
    assert watch.diverged_since() == 0
    assert watch.health() == Health(as_of=7, last_unhealthy=6)
    assert not watch.health().followed_healthily(5) and watch.health().followed_healthily(6)
    for step in (9, 10, 11, 12):
        observe(watch, step, 9.0)  # over 3x the recent mean, for good
    assert watch.diverged_since() == 9 and watch.spiked()
    loss, mean = watch.latest_spike()
    assert loss == 9.0 and 2.0 < mean < 2.7  # the spikes never entered the mean


def test_spikes_are_not_judged_when_switched_off_but_non_finite_losses_are():
    watch = DivergenceWatch(torch.device("cpu"), scaled=False, spike=SpikeRule(0, 3))
    for step, loss in enumerate([2.0, 50.0, 60.0, 70.0, 80.0, float("nan"), 1.0], start=1):
        observe(watch, step, loss)
    assert watch.diverged_since() == 6 and not watch.spiked()
    assert watch.last_finite_loss() == (80.0, 5)
