"""What watches a run while it trains, behind the one object the Trainer holds: where this rank is
in its step, for the hang watchdog (watchdog.py); whether the run has diverged (divergence.py's
DivergenceWatch); and the decisions every rank takes at the same step (control.py's StepAgreement:
stop signals, the snapshot timer, a failed save, divergence). The Trainer's step reads as the
original's _run_batch; it tells the guard where it is, and after each step asks it what to do.
"""
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from mingpt.common.errors import KeyGroup, check, check_not_negative, check_positive
from mingpt.distributed.control import Decision, StepAgreement, StopRequested, check_signal_names
from mingpt.distributed.divergence import DivergenceWatch, Health, SpikeRule
from mingpt.distributed.process_group import DEFAULT_TIMEOUT_S, DistEnv, first_said, peer_failure
from mingpt.distributed.stragglers import StepClock
from mingpt.distributed.watchdog import RunWatchdog


@dataclass
class WatchKeys(KeyGroup):
    """TrainerConfig's keys of what watches a run: its stop signals, the hang watchdog, the divergence
    watch and the collectives' timeout."""

    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that stop the run cleanly, wherever they land: the snapshot of its last step is written
    (docs/snapshots.md), and it exits 75."""
    hang_timeout_s: float = 300.0
    """A rank not heard from for this long, or not moving while the others wait for it, ends the run
    with one line naming it and a report beside the snapshots (distributed/watchdog.py); long
    enough for the slowest step, a compilation or an evaluation batch, well under the collective
    timeout below. A rank writing a snapshot is never taken for hung."""
    loss_spike_ratio: float = 2.0
    """The divergence watch's measure (docs/snapshots.md#the-divergence-watch): a step's loss above this
    many times the recent mean (an exponential moving average over about 20 steps) is a spike, which
    must settle within loss_spike_steps; the loss's trend (over about 5 steps) at this many times the
    run's best is a slow rise. Either stops the run as diverged, like a value that is not finite
    (always judged), and sends it back to the newest snapshot that healthy steps followed. 0: spikes
    and rises are not judged."""
    loss_spike_steps: int = 20
    """Steps a spike has to settle: its loss back under loss_spike_ratio times the recent mean (a lone
    spike), or its gradient norm back under loss_spike_ratio times its mean before the spike with the
    loss coming down (new data being learned). 1: every spike is divergence."""
    process_group_timeout_s: float = DEFAULT_TIMEOUT_S
    """How long a collective waits for the slowest rank before failing the run; it must cover rank
    0 writing a single-file snapshot alone (to S3, minutes for a large model) while the rest wait."""

    def __post_init__(self) -> None:
        check_positive(self, "trainer_config", "hang_timeout_s", "process_group_timeout_s", "loss_spike_steps")
        check_not_negative(self, "trainer_config", "loss_spike_ratio")
        check(self.loss_spike_ratio == 0 or self.loss_spike_ratio > 1, "trainer_config.loss_spike_ratio",
              f"must be more than 1 (or 0: off), got {self.loss_spike_ratio}")
        check_signal_names(self.stop_signals, "trainer_config.stop_signals")
        super().__post_init__()  # the next group's checks (TrainerConfig's bases)


class RunGuard:
    """One rank's watch over its run (a context: the watchdog's thread and the signal handlers live
    inside it, from train()'s start to its end)."""

    def __init__(self, keys: WatchKeys, env: DistEnv, report_folder: str, kept, compiled: bool, scaled: bool,
                 save_every_minutes: float):
        self.watch = RunWatchdog(env.rank, env.world_size, keys.hang_timeout_s, report_folder, kept,
                                 StepClock(env.device), compiled=compiled)
        """Where this rank is and how long its steps take, for the others to see."""
        spike = SpikeRule(keys.loss_spike_ratio, keys.loss_spike_steps)
        self.divergence = DivergenceWatch(env.device, scaled=scaled, spike=spike)
        self._agreement_settings = (keys.stop_signals, save_every_minutes, env)
        self._collective_timeout_s = keys.process_group_timeout_s
        self.agreement: Optional[StepAgreement] = None
        """Stop signals and the snapshot timer, while training (closed when it ends)."""
        self._micro_step, self._micro_batch = 0, 0

    def at(self, phase: str, step: int, item: Optional[int] = None) -> None:
        """Where the training thread is: phase of step (an attribute set; nothing waits). A forward
        pass, and the backward pass after it, are of the step's next micro-batch, counted here."""
        if phase == "forward":
            self._micro_batch = self._micro_batch + 1 if self._micro_step == step else 0
            self._micro_step = step
        if item is None:
            item = self._micro_batch if phase in ("forward", "backward") else 0
        self.watch.at(phase, step, item)

    def time_arrivals(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Time each step to when these parameters' gradients arrive (stragglers.py), when there are
        ranks to compare it with."""
        if self.watch.active:
            self.watch.clock.time_arrival_at(parameters)

    def step_taken(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, save_failed: bool) -> Decision:
        """A step's loss and gradient norm judged (on the device), and what every rank agreed on at
        this step's end (control.py; the divergence verdict is a step late, so that nobody waits for
        the device)."""
        self.divergence.observe(step, loss, grad_norm)
        return self.agreement.after_step(save_failed=save_failed,
                                         diverged_since=self.divergence.diverged_since())

    def health(self) -> Health:
        return self.divergence.health()

    def divergence_said(self, since: int, lr: float, is_main: bool) -> tuple[str, str]:
        """Every rank's copy of what rank 0's watch saw of a divergence from step `since` (at learning
        rate lr), and what to change if it was no divergence (empty when another rank's verdict)."""
        said = None
        if is_main:
            divergence = self.divergence.divergence()
            said = (f"{divergence.cause(lr)}\n{divergence.advice()}" if divergence is not None
                    else f"the loss of another rank diverged from step {since} (learning rate {lr:.3g})\n")
        cause, advice = first_said(said).split("\n")
        return cause, advice

    def saved(self) -> None:
        """A snapshot was taken: the snapshot timer starts again."""
        if self.agreement is not None:
            self.agreement.saved()

    def stop_asked(self) -> Decision:
        """Between two steps, at the same point on every rank: whether any rank was asked to stop
        (never, outside training: an evaluation of its own takes no stop signals)."""
        return self.agreement.stop_asked() if self.agreement is not None else Decision()

    def stop_at_once_when(self, loses_nothing: Callable[[], bool], kept: Callable[[], str]) -> None:
        """While training: a stop signal stops this process at once when loses_nothing() (nothing
        trained since the last snapshot written); kept() says what a second Ctrl-C leaves."""
        signals = self.agreement.signals
        signals.at_once, signals.kept = loses_nothing, kept

    def stop_signal_of(self, error: BaseException) -> int:
        """The stop signal (0: none) that ended training with error: a stop at once (StopRequested), or
        a failed collective it explains: this rank was asked to stop, but had a step under way, while
        a peer asked at the same time had none (at_once) and left. The peer lost nothing and neither
        does this rank: both stop from the last snapshot written."""
        if isinstance(error, StopRequested):
            return error.number
        requested = self.agreement.signals.requested if self.agreement is not None else 0
        if requested and peer_failure(error, self._collective_timeout_s) is not None:
            return requested
        return 0

    def stopping(self) -> None:
        """The stop is being carried out: no signal stops it at once any more."""
        self.agreement.signals.at_once = lambda: False

    def settled(self) -> None:
        """The stop's snapshot is written: a second Ctrl-C changes nothing now."""
        self.agreement.signals.settled = True

    def __enter__(self) -> "RunGuard":
        self.agreement = StepAgreement(*self._agreement_settings)
        self.watch.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self.watch.__exit__(*exc_info)
        # Training is over: a signal now is only noted, and the process's signals (main.run's, which
        # outlive the Trainer) let go of it, so that it and its DataLoader workers go with their last
        # reference (a worker ignores the stop signals: one left would hold the process's exit).
        self.stopping()
        self.agreement.close(failed=exc_info[0] is not None)
        self.agreement = None
