"""What a training run tells its user as it goes, in one place: the original's loss lines, live
progress (tokens/s, MFU, ETA), the metrics file (JSON lines) and the run trackers (trackers.py).

Every rank calls it; global rank 0 speaks and writes (the others' MetricsLog and monitor are
inactive, and they have no trackers). A new run tracker joins trackers.py; MetricsLog's flush hands
it each line with its numbers on the host, in one device sync.
"""
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from mingpt.common.errors import KeyGroup, check_positive
from mingpt.common.logger import clear_status, log
from mingpt.distributed.process_group import DistEnv
from mingpt.distributed.stragglers import StepTimes, StragglerWatch
from mingpt.reporting.flops import peak_above, peak_flops
from mingpt.reporting.hellaswag_eval import Score
from mingpt.reporting.metrics import MetricsLog, open_run_metrics
from mingpt.reporting.monitor import TrainingMonitor, format_eta
from mingpt.reporting.trackers import FAILED, FINISHED, STOPPED, TrackerConfig, open_trackers
from mingpt.storage.snapshot import Progress


@dataclass
class ReportKeys(KeyGroup):
    """TrainerConfig's keys of what a run tells its user as it trains."""

    log_every: int = 100
    """Log the loss every this many iterations."""
    metrics_path: Optional[str] = None
    """JSON-lines metrics file (any fsspec path); default: beside the snapshot. Run trackers
    (TensorBoard, W&B, MLflow) get the same values: tracker_config."""
    progress_interval_s: float = 30.0
    """Seconds between progress lines (tokens/s, MFU, ETA); a terminal gets a live bar instead."""

    def __post_init__(self) -> None:
        check_positive(self, "trainer_config", "log_every", "progress_interval_s")
        super().__post_init__()  # the next group's checks (TrainerConfig's bases)


@dataclass(frozen=True)
class ReportSettings:
    """What a run's report needs of its config (TrainerConfig.report_settings)."""

    metrics_path: str
    """Where the metrics go: the configured path, or beside the snapshots."""
    metrics_folder_of_its_own: bool
    """The metrics path was configured: its folder is checked for writing at start-up (the
    snapshots' folder is their store's to check)."""
    log_every: int
    progress_interval_s: float
    max_epochs: Optional[int]
    """The epoch budget; None under a step budget (max_steps)."""


def stopped_before_training(signal_name: str) -> str:
    return f"Stopping on {signal_name} before the first step: nothing to save"


def command_beside(script: str) -> str:
    """The command of another of the project's scripts, as the user named main.py (mingpt/main.py,
    main.py, an absolute path)."""
    return f"python {Path(sys.argv[0]).with_name(script)}"


RankTimes = Callable[[], tuple[dict[int, StepTimes], dict[int, str]]]
"""Every rank's running step times and host, as the watchdog last read them (RunWatchdog.rank_times)."""


class RunReport:
    def __init__(self, metrics: MetricsLog, monitor: TrainingMonitor, rank: int, log_every: int,
                 rank_times: RankTimes):
        self.metrics = metrics
        self.monitor = monitor
        monitor.ranks_note = self._ranks_note
        self.rank_times = rank_times
        self.stragglers = StragglerWatch()
        self.slow = ""
        """The slow rank named in the latest window of every rank's step times, or ""."""
        self.rank = rank
        self.log_every = log_every
        self.started = time.monotonic()
        self.first_step: Optional[int] = None
        """The step this session started from."""
        self.last_train_loss: Optional[torch.Tensor] = None
        """The last step's loss, on the device until the run's closing lines read it."""
        self.eval_loss: Optional[float] = None
        self.evaluated_at: Optional[int] = None
        """The step of the last evaluation."""
        self.hellaswag_at: Optional[int] = None
        """The step HellaSwag was last scored at."""

    @classmethod
    def open(cls, settings: ReportSettings, env: DistEnv, matmul_dtype: str, flops_per_token: int,
             total_steps: int, resumed_step: int, rank_times: RankTimes) -> "RunReport":
        """The report of a run starting (or resuming) at resumed_step; rank 0's speaks and writes."""
        metrics = open_run_metrics(settings.metrics_path, check_folder=settings.metrics_folder_of_its_own,
                                   active=env.is_main)
        metrics.start(resumed_step)
        monitor = TrainingMonitor(
            flops_per_token=flops_per_token,
            peak_flops=peak_flops(env.device, matmul_dtype) if env.is_main else None,
            world_size=env.world_size, total_steps=total_steps, max_epochs=settings.max_epochs,
            interval_s=settings.progress_interval_s, active=env.is_main,
            peak_above=lambda achieved: peak_above(env.device, matmul_dtype, achieved),
            long_run_hint=f"for a run of minutes on a CPU: {command_beside('main.py')} --config-name laptop"
            if env.device.type == "cpu" else "")
        return cls(metrics, monitor, env.rank, settings.log_every, rank_times)

    def track(self, config: TrackerConfig, snapshot_folder: str, progress: Progress,
              run_config: dict[str, Any], summary: list[str]) -> None:
        """Open the run trackers (global rank 0), continuing the tracked runs of progress (from the
        snapshot resumed); their ids go into progress, and so into every snapshot from here on."""
        if not (self.metrics.active and config.trackers):
            return
        trackers = open_trackers(config, snapshot_folder, progress.tracked_runs, run_config, summary)
        self.metrics.trackers, progress.tracked_runs = trackers, trackers.run_ids

    def train_step(self, epoch: int, iteration: int, progress: Progress, loss: torch.Tensor,
                   grad_norm: torch.Tensor, lr: float) -> None:
        """A step's loss and gradient norm into progress and the metrics (on the device until the
        next flush), and the original's line every log_every iterations."""
        self.monitor.update(epoch, progress.step, progress.tokens, loss)
        if self.first_step is None:
            self.first_step = progress.step - 1
        self.last_train_loss = loss
        self.metrics.record("train", loss, epoch=epoch, iter=iteration, step=progress.step,
                            tokens=progress.tokens, lr=lr, tokens_per_s=self.monitor.tokens_per_s,
                            mfu=self.monitor.mfu, grad_norm=grad_norm.detach())
        self.loss_line("Train", epoch, iteration, loss)

    def missed(self, epoch: int, progress: Progress, samples: int) -> None:
        """Under fault tolerance, a step's samples of the global order that nobody trained (a lost
        replica group's share, or a whole step not committed): a "missed" line, when there are any."""
        if samples:
            self.metrics.record("missed", epoch=epoch, step=progress.step, samples=samples)

    def _ranks_note(self, step: int) -> str:
        """At a progress line: every rank's step times since the last window into the metrics, and
        the slow rank, if one is, for the line."""
        window = self.stragglers.window(step, *self.rank_times())
        if window is not None:
            self.metrics.record("ranks", **window.metrics())
            self.slow = window.slow
        return self.slow

    def loss_line(self, kind: str, epoch: int, iteration: int, loss: torch.Tensor) -> None:
        if iteration % self.log_every == 0:
            # .item() waits for the device: only when printing.
            log.info(f"[RANK{self.rank}] Epoch {epoch} | Iter {iteration} | {kind} Loss {loss.item():.5f}")
            self.metrics.flush()

    def evaluation(self, epoch: int, progress: Progress, mean_loss: torch.Tensor, samples: int,
                   world_size: int) -> None:
        self.metrics.record("eval", mean_loss, epoch=epoch, step=progress.step, tokens=progress.tokens,
                            samples=samples)
        self.metrics.flush()
        self.eval_loss, self.evaluated_at = mean_loss.item(), progress.step
        log.info(f"[RANK{self.rank}] Epoch {epoch} | Step {progress.step} | Eval Loss {self.eval_loss:.5f} "
                 f"(mean over {samples} samples on {world_size} ranks)")

    def hellaswag(self, epoch: int, progress: Progress, score: Score, world_size: int) -> None:
        """HellaSwag's accuracy into the metrics (a "hellaswag" line: trackers get hellaswag/accuracy)
        and one line like the eval loss's."""
        self.metrics.record("hellaswag", epoch=epoch, step=progress.step, tokens=progress.tokens,
                            accuracy=score.accuracy, correct=score.correct, items=score.items)
        self.metrics.flush()
        self.hellaswag_at = progress.step
        log.info(f"[RANK{self.rank}] Epoch {epoch} | Step {progress.step} | HellaSwag {score.accuracy:.4f} "
                 f"({score.correct} of {score.items} items right, acc_norm, on {world_size} ranks)")

    def pause(self) -> None:
        """Something that is not training ran (an eval, a snapshot): measure throughput afresh."""
        self.monitor.restart_window()

    def flush(self) -> None:
        self.metrics.flush()

    def publish(self) -> None:
        """The metrics file, wherever it is, holds every step so far (a snapshot is being taken)."""
        self.metrics.publish()

    def close(self, last_words: Optional[str] = None, stopped: bool = False) -> None:
        """The run ended (or stopped with its snapshot, resumable): said, published, trackers ended."""
        clear_status()
        if last_words:
            log.info(last_words)
        self.metrics.close(STOPPED if stopped else FINISHED)

    def stopped(self, signal_name: str, saved_step: int, writer: Optional[int] = None, abandoned: str = "") -> None:
        """A stop signal ended the run, resumable: with the snapshot of saved_step written (0: before the
        first step, nothing to save), or, in a replica group that writes none, at that step with the
        group that does named; `abandoned`, the phase the stop cut short."""
        if writer is not None:  # that group may train on a step or two alone before it stops
            said = f"Stopping on {signal_name} at step {saved_step}; replica group {writer} writes the snapshots"
        elif saved_step:
            said = f"Stopping on {signal_name}: snapshot saved at step {saved_step}"
        else:
            said = stopped_before_training(signal_name)
        if abandoned:
            said += f" (the {abandoned} under way was abandoned)"
        self.close(said, stopped=True)

    def nothing_left(self, max_steps: int, max_epochs: int) -> None:
        """The resumed snapshot already holds the end of the run's budget."""
        budget = f"max_steps={max_steps}" if max_steps else f"max_epochs={max_epochs}"
        self.close(f"Nothing left to do: the snapshot holds the end of this run (trainer_config.{budget}); "
                   "raise it to train on, or set another trainer_config.snapshot_path to start afresh")

    def finished(self, progress: Progress, snapshot_path: str) -> None:
        """The run reached its budget: close it with what it did and what to do next."""
        losses = [f"train loss {self.last_train_loss.item():.4f}"] if self.last_train_loss is not None else []
        if self.eval_loss is not None:
            losses.append(f"eval loss {self.eval_loss:.4f}")
        steps = progress.step - (self.first_step or 0)
        self.close(f"Finished: epoch {progress.epoch}, step {progress.step:,}, {progress.tokens:,} tokens "
                   f"({steps:,} steps in {format_eta(time.monotonic() - self.started)} in this run); "
                   f"{', '.join(losses)}\n"
                   f"Sample from its snapshot: {command_beside('generate.py')} --snapshot {snapshot_path}")

    @contextlib.contextmanager
    def failed_on_error(self) -> Iterator[None]:
        """A run that fails ends its tracked runs as failed (after a stop they are ended already)."""
        try:
            yield
        except BaseException:
            if self.metrics.trackers is not None:
                self.metrics.trackers.close(FAILED)
            raise
