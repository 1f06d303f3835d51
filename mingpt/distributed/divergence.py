"""Whether a run has diverged: a loss or gradient norm that is not finite, or a loss that spikes
and stays up, judged on the device at every step without waiting for it (DivergenceWatch). The
host reads the verdict a step later and posts it to control.py's StepAgreement, so that every rank
stops at the same step, before any snapshot of the ruined weights; what the watch knows of the
run's health (Health) tells the Checkpointer which snapshot healthy steps followed.
"""
from dataclasses import dataclass
from typing import Optional

import torch

SCALED_PATIENCE = 3
"""Under a GradScaler (fp16), steps in a row whose loss is not finite before the run is taken to
have diverged: the scaler skips an overflowed step and lowers its scale, and training goes on."""
LOSS_HISTORY_STEPS = 20
"""The loss a spike is measured against: the running mean of the healthy losses so far, then (once
there are this many) their exponential moving average over about this many steps."""


@dataclass(frozen=True)
class SpikeRule:
    """A loss spike: a step's loss above `ratio` times the recent mean of healthy losses
    (LOSS_HISTORY_STEPS), for `steps` steps in a row, is divergence (ratio 0: spikes are not judged;
    non-finite values still are)."""

    ratio: float = 2.0
    steps: int = 3


@dataclass(frozen=True)
class Health:
    """What the host knows of a run's health, as of one observed step."""

    as_of: int
    """The step this verdict is of (0: none observed yet)."""
    last_unhealthy: int
    """The last step, up to as_of, whose loss was not healthy (not finite, or a spike); 0: none."""

    def followed_healthily(self, step: int) -> bool:
        """Whether the weights of `step` (a snapshot's) were followed by healthy steps only, at least one."""
        return self.as_of > step >= self.last_unhealthy


# The watch's state, one float64 tensor on the device: its fields' places.
(_STREAK, _NON_FINITE_STREAK, _SINCE, _LAST_LOSS, _LAST_STEP, _MEAN, _HEALTHY_COUNT, _LAST_UNHEALTHY,
 _AS_OF, _SPIKE_LOSS, _NON_FINITE_SINCE) = range(11)


class DivergenceWatch:
    """Whether a run has diverged, judged on the device at every step and read by the host one
    step later (the step before the one just queued, long finished), so that no step waits for the
    device to judge it.

    A step is unhealthy when its loss is not finite (or, without a GradScaler, its gradient norm),
    or when its loss spikes (SpikeRule). Without a GradScaler, one non-finite loss or gradient norm
    has already ruined the weights (the clip scales every gradient by that norm): the run has
    diverged at that step. With one, inf or NaN gradients are an overflow the scaler skips; only a
    loss that stays non-finite for SCALED_PATIENCE steps is divergence. A spike is divergence once
    it has lasted `spike.steps` steps. The host also learns the last unhealthy step (`health`): a
    snapshot followed by healthy steps only is one a diverged run can go back to (checkpointer.py).
    """

    def __init__(self, device: torch.device, scaled: bool, spike: SpikeRule = SpikeRule()):
        self.patience = SCALED_PATIENCE if scaled else 1
        self.watch_norm = not scaled
        self.spike = spike
        start = torch.zeros(11, dtype=torch.float64)
        start[_LAST_LOSS] = start[_SPIKE_LOSS] = float("nan")
        self._state = start.to(device)
        # Two host copies: the newest step's, being made, and the one before, which is read.
        self._copies = [start.pin_memory() if device.type == "cuda" else start.clone() for _ in range(2)]
        self._copied: list[Optional[torch.cuda.Event]] = [None, None]
        self._newest = 0

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """A step's loss and gradient norm (device tensors), judged in operations queued on the
        device: nothing waits."""
        state = self._state
        loss = loss.detach().double()
        finite = torch.isfinite(loss)
        if self.watch_norm:
            finite = finite & torch.isfinite(grad_norm)
        spiked = torch.zeros((), dtype=torch.bool, device=loss.device)
        if self.spike.ratio:
            spiked = finite & (state[_HEALTHY_COUNT] > 0) & (loss > self.spike.ratio * state[_MEAN])
        healthy = finite & ~spiked
        streak = torch.where(healthy, 0.0, state[_STREAK] + 1)
        non_finite_streak = torch.where(finite, 0.0, state[_NON_FINITE_STREAK] + 1)
        count = state[_HEALTHY_COUNT] + healthy.double()
        weight = torch.clamp(1.0 / count.clamp(min=1.0), min=1.0 / LOSS_HISTORY_STEPS)
        mean = torch.where(healthy, state[_MEAN] + weight * (torch.nan_to_num(loss) - state[_MEAN]),
                           state[_MEAN])
        self._state = torch.stack([
            streak, non_finite_streak, torch.where(streak == 1, float(step), state[_SINCE]),
            torch.where(finite, loss, state[_LAST_LOSS]), torch.where(finite, float(step), state[_LAST_STEP]),
            mean, count, torch.where(healthy, state[_LAST_UNHEALTHY], float(step)),
            torch.full_like(mean, float(step)), torch.where(spiked, loss, state[_SPIKE_LOSS]),
            torch.where(non_finite_streak == 1, float(step), state[_NON_FINITE_SINCE]),
        ])
        self._newest = 1 - self._newest
        self._copies[self._newest].copy_(self._state, non_blocking=True)
        if loss.is_cuda:
            self._copied[self._newest] = torch.cuda.Event()
            self._copied[self._newest].record()

    def _previous(self) -> list[float]:
        """The verdict as of the step before the newest one observed."""
        older = 1 - self._newest
        if self._copied[older] is not None:
            self._copied[older].synchronize()
        return self._copies[older].tolist()

    def diverged_since(self) -> int:
        """The step the run diverged at (0: it had not, as of the step before the newest)."""
        state = self._previous()
        if state[_NON_FINITE_STREAK] >= self.patience:
            return int(state[_NON_FINITE_SINCE])
        return int(state[_SINCE]) if self.spike.ratio and state[_STREAK] >= self.spike.steps else 0

    def spiked(self) -> bool:
        """Whether the divergence is a spike of finite losses (not a non-finite value)."""
        state = self._previous()
        return bool(self.spike.ratio) and state[_STREAK] >= self.spike.steps \
            and state[_NON_FINITE_STREAK] < self.patience

    def health(self) -> Health:
        state = self._previous()
        return Health(as_of=int(state[_AS_OF]), last_unhealthy=int(state[_LAST_UNHEALTHY]))

    def last_finite_loss(self) -> tuple[float, int]:
        """The last finite loss seen before the step before the newest, and its step (nan, 0: none)."""
        state = self._previous()
        return state[_LAST_LOSS], int(state[_LAST_STEP])

    def latest_spike(self) -> tuple[float, float]:
        """The latest spiking loss and the recent mean it was measured against (nan: none)."""
        state = self._previous()
        return state[_SPIKE_LOSS], state[_MEAN]
