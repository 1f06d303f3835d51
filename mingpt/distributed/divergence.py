"""Whether a run has diverged, told apart from a run that is learning something new, and which of
its snapshots healthy steps followed.

DivergenceWatch sees every step's loss and gradient norm. The device only copies the two numbers
to the host (queued, no wait); the host judges a step at the next one, when its copy has long
arrived, so that no step waits for the device. The Trainer posts the verdict to control.py's
StepAgreement, so that every rank stops at the same step, before any snapshot of ruined weights;
what the watch knows of the run's health (Health) tells the Checkpointer which snapshot healthy
steps followed, the one a diverged run goes back to.

What the watch takes for divergence, and what for learning (docs/snapshots.md#the-divergence-watch):

- **A value that is not finite**: a loss, or (without a GradScaler) a gradient norm: the clip has
  already scaled every gradient by it. Under a GradScaler an overflow is a step the scaler skips;
  SCALED_PATIENCE non-finite losses in a row are divergence.
- **A spike that does not settle**: a loss above `ratio` times the recent mean opens a spike, which
  has `steps` steps to settle. It settles when the loss is back under `ratio` times that mean (a lone
  spike), or when the gradient norm is back under `ratio` times its mean before the spike while the
  loss is below the spike's peak: the optimizer takes steps of its usual size again and the loss is
  coming down, which is new data being learned (text of another kind in the middle of an epoch), not
  weights thrown about; the means then start again from the new data. A high learning rate keeps
  the gradient norm many times its usual size: the spike does not settle, and the run has diverged
  from the step the spike began. A spike that comes during a rise (below) can only settle as a lone
  one: the rise has already inflated the gradient norm's mean it would be measured against.
- **A slow rise**: the recent mean of the loss (an exponential moving average over about
  LOSS_HISTORY_STEPS steps) climbs with it and never sees a spike, so it is also held against the
  run's best recent mean, a reference that never drifts up (only a spike that settled, new data,
  starts it again). Past RISE_ONSET of the way to `ratio` times the best, the run is rising: its
  steps are not healthy, so no snapshot written from then on counts as one to go back to. At `ratio`
  times the best, the run has diverged from the step the rise began.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch

SCALED_PATIENCE = 3
"""Under a GradScaler (fp16), steps in a row whose loss is not finite before the run is taken to
have diverged: the scaler skips an overflowed step and lowers its scale, and training goes on."""
LOSS_HISTORY_STEPS = 20
"""The recent means (of the loss and of the gradient norm): the running mean of the healthy steps so
far, then (once there are this many) their exponential moving average over about this many steps."""
RISE_HISTORY_STEPS = 5
"""The loss's trend, which a rise is judged on: its exponential moving average over about this many
healthy steps (the recent mean's 20 would lag a rise's start by a dozen steps)."""
RISE_ONSET = 0.25
"""Where a rise begins: the recent mean this share of the way from the run's best to `ratio` times
it (1.25x the best at ratio 2; the default runs measured stayed within 1.01x of it)."""


@dataclass(frozen=True)
class SpikeRule:
    """The loss's rules (trainer_config.loss_spike_ratio and loss_spike_steps): a loss above `ratio`
    times the recent mean is a spike, which must settle within `steps` steps; a recent mean at `ratio`
    times the run's best is a rise (ratio 0: neither is judged; values that are not finite still are)."""

    ratio: float = 2.0
    steps: int = 20


@dataclass(frozen=True)
class Health:
    """What the host knows of a run's health, as of one judged step."""

    as_of: int
    """The step this verdict is of (0: none judged yet)."""
    last_unhealthy: int
    """The last step, up to as_of, that was not healthy (a value not finite, a spike, a rise); 0: none."""

    def followed_healthily(self, step: int) -> bool:
        """Whether the weights of `step` (a snapshot's) were followed by healthy steps only, at least one."""
        return self.as_of > step >= self.last_unhealthy


@dataclass(frozen=True)
class Divergence:
    """Why and since when a run has diverged, in figures."""

    kind: str
    """"not finite", "spike" or "rise"."""
    since: int
    """The step the divergence began: the first value not finite, the spike's first step, or the step
    the rise began."""
    loss: float
    """not finite: the last finite loss (nan: none); spike: its peak; rise: the loss's trend."""
    loss_step: int = 0
    """not finite: the step of the last finite loss (0: none)."""
    reference: float = math.nan
    """spike: the recent mean before it; rise: the run's best trend."""
    reference_step: int = 0
    """rise: the step of the run's best."""
    norm: float = math.nan
    """spike: its last gradient norm."""
    norm_reference: float = math.nan
    """spike: the recent mean of the gradient norm before it."""
    steps: int = 0
    """spike: the steps it had to settle."""
    spike_start: int = 0
    """spike during a rise (since: the rise's first step): the spike's first step."""

    def cause(self, learning_rate: float) -> str:
        """What happened, in a phrase: "the loss spiked from step 171 (...)"."""
        lr = f"learning rate {learning_rate:.3g}"
        if self.kind == "spike":
            rose = f"rose from step {self.since}, then " if self.spike_start else ""
            return (f"the loss {rose}spiked from step {self.spike_start or self.since} (to {self.loss:.4g}, "
                    f"{self.loss / self.reference:.1f}x its recent mean {self.reference:.4f}) and did not "
                    f"settle in {self.steps} steps (its gradient norm {self.norm:.3g}, "
                    f"{self.norm / self.norm_reference:.1f}x its mean {self.norm_reference:.3g} before the "
                    f"spike; {lr})")
        if self.kind == "rise":
            return (f"the loss rose from step {self.since} (its {RISE_HISTORY_STEPS}-step average "
                    f"{self.loss:.4f}, {self.loss / self.reference:.1f}x the run's best {self.reference:.4f} "
                    f"at step {self.reference_step}; {lr})")
        last = (f"last finite loss {self.loss:.4f} at step {self.loss_step}" if self.loss_step
                else "no finite loss before it")
        return f"the loss is not finite from step {self.since} ({lr}; {last})"

    def advice(self) -> str:
        """What to change when the watch took learning for divergence (empty: it cannot have)."""
        if self.kind == "spike":
            return ("; new data that was still being learned: raise trainer_config.loss_spike_steps (the "
                    "steps a spike has to settle) or trainer_config.loss_spike_ratio (0: off)")
        if self.kind == "rise":
            return "; data that grew harder: raise trainer_config.loss_spike_ratio (0: off)"
        return ""


@dataclass
class _Spike:
    """A spike being judged: where it began and what it is measured against."""

    start: int
    mean: float
    norm_mean: float
    peak: float
    norm: float
    rising_since: int
    """The step the rise it came in began (0: none)."""


class _RecentMean:
    """The running mean of the values so far, then their exponential moving average over about
    `steps` values."""

    def __init__(self, steps: int = LOSS_HISTORY_STEPS) -> None:
        self.steps = steps
        self.value, self.count = 0.0, 0

    def add(self, value: float) -> None:
        self.count += 1
        self.value += max(1.0 / self.count, 1.0 / self.steps) * (value - self.value)


class DivergenceWatch:
    """Whether a run has diverged (module docstring: a value not finite, a spike that does not settle,
    a slow rise), judged on the host a step late, so that no step waits for the device: each step
    queues a copy of its loss and gradient norm, and the step before it, long arrived, is judged.
    `health` says the last unhealthy step, so that the snapshot a diverged run goes back to is one
    that healthy steps followed (checkpointer.py)."""

    def __init__(self, device: torch.device, scaled: bool, spike: SpikeRule = SpikeRule()):
        self.patience = SCALED_PATIENCE if scaled else 1
        self.watch_norm = not scaled
        self.spike = spike
        # Two host copies of (loss, gradient norm): the newest step's, being made, and the one before,
        # which is judged; each with its step and the event that marks it made (on a GPU).
        self._pinned = device.type == "cuda"
        self._copies = [torch.zeros(2, dtype=torch.float64) for _ in range(2)]
        if self._pinned:
            self._copies = [copy.pin_memory() for copy in self._copies]
        self._copied: list[Optional[torch.cuda.Event]] = [None, None]
        self._steps: list[Optional[int]] = [None, None]
        self._newest = 0
        # What the judged steps have shown.
        self._health = Health(as_of=0, last_unhealthy=0)
        self._divergence: Optional[Divergence] = None
        self._start_means()
        self._best_step = 0
        self._spike: Optional[_Spike] = None
        self._non_finite, self._non_finite_since = 0, 0
        self._last_finite, self._last_finite_step = math.nan, 0

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """A step's loss and gradient norm (device tensors): their copy to the host is queued (nothing
        waits), and the step before, whose copy has long arrived, is judged."""
        newest, older = 1 - self._newest, self._newest
        copy = self._copies[newest]
        copy[0].copy_(loss.detach(), non_blocking=True)
        copy[1].copy_(grad_norm.detach(), non_blocking=True)
        self._copied[newest] = torch.cuda.Event() if self._pinned else None
        if self._pinned:
            self._copied[newest].record()
        self._steps[newest], self._newest = step, newest
        if self._steps[older] is not None:
            if self._copied[older] is not None:
                self._copied[older].synchronize()  # recorded a step ago: long reached
            self._judge(self._steps[older], *self._copies[older].tolist())

    def diverged_since(self) -> int:
        """The step the run diverged at (0: it had not, as of the step before the newest)."""
        return self._divergence.since if self._divergence is not None else 0

    def divergence(self) -> Optional[Divergence]:
        """Why the run diverged (None: it had not, as of the step before the newest)."""
        return self._divergence

    def health(self) -> Health:
        return self._health

    def _start_means(self) -> None:
        """The recent means (loss, gradient norm), the loss's trend and the run's best, from nothing:
        at the start, and from new data (a spike that settled)."""
        self._loss, self._norm, self._trend = _RecentMean(), _RecentMean(), _RecentMean(RISE_HISTORY_STEPS)
        self._best, self._rising_since = math.inf, 0

    def _judge(self, step: int, loss: float, norm: float) -> None:
        healthy = self._finite(step, loss, norm) and (not self.spike.ratio or self._usual(step, loss, norm))
        self._health = Health(as_of=step, last_unhealthy=self._health.last_unhealthy if healthy else step)

    def _finite(self, step: int, loss: float, norm: float) -> bool:
        """Whether the step's values are finite (the gradient norm only without a GradScaler)."""
        if math.isfinite(loss) and (math.isfinite(norm) or not self.watch_norm):
            self._non_finite = 0
            self._last_finite, self._last_finite_step = loss, step
            return True
        self._non_finite += 1
        if self._non_finite == 1:
            self._non_finite_since = step
        if self._non_finite >= self.patience:
            self._diverged(Divergence("not finite", self._non_finite_since, self._last_finite,
                                      self._last_finite_step))
        return False

    def _usual(self, step: int, loss: float, norm: float) -> bool:
        """Whether a step with finite values is healthy: neither in a spike nor in a rise."""
        ratio, spike = self.spike.ratio, self._spike
        if spike is None and self._loss.count and loss > ratio * self._loss.value:
            spike = _Spike(step, self._loss.value, self._norm.value, loss, norm, self._rising_since)
            self._spike = spike
        if spike is not None:
            spike.peak, spike.norm = max(spike.peak, loss), norm
            if loss <= ratio * spike.mean:  # a lone spike: the run is back to its usual loss
                self._spike = None
            elif not spike.rising_since and norm <= ratio * spike.norm_mean and loss < spike.peak:
                self._spike = None  # new data, being learned (a norm that is not finite is not back)
                self._start_means()
            else:
                if step - spike.start + 1 >= self.spike.steps:  # a rise's spike: diverged with the rise
                    self._diverged(Divergence("spike", spike.rising_since or spike.start, spike.peak,
                                              reference=spike.mean, norm=spike.norm,
                                              norm_reference=spike.norm_mean, steps=self.spike.steps,
                                              spike_start=spike.start if spike.rising_since else 0))
                return False
        return self._not_rising(step, loss, norm)

    def _not_rising(self, step: int, loss: float, norm: float) -> bool:
        """The step enters the recent means; whether the loss's is still near the run's best."""
        self._loss.add(loss)
        self._trend.add(loss)
        if math.isfinite(norm):  # under a GradScaler, an overflowed step's norm is not
            self._norm.add(norm)
        mean, ratio = self._trend.value, self.spike.ratio
        if mean < self._best:
            self._best, self._best_step = mean, step
        if mean <= self._best * (1 + RISE_ONSET * (ratio - 1)):
            self._rising_since = 0
            return True
        self._rising_since = self._rising_since or step
        if mean >= ratio * self._best:
            self._diverged(Divergence("rise", self._rising_since, mean, reference=self._best,
                                      reference_step=self._best_step))
        return False

    def _diverged(self, divergence: Divergence) -> None:
        """The first divergence is the run's (the run stops at it)."""
        if self._divergence is None:
            self._divergence = divergence
