"""The training loop: epochs of training, a snapshot every `save_every` epochs, an eval pass.

The original's trainer.py, its landmarks where they were: TrainerConfig, Snapshot, Trainer with
_prepare_dataloader, _load_snapshot, _run_batch, _run_epoch, _save_snapshot and train; its
upload_to_s3 is storage/snapshot.py's write_snapshot, for any fsspec URL.

The model arrives placed, with its optimizer (start_up.place_model), where the original wrapped it
in DDP here. The Trainer keeps the loop, evaluation and the phases of a step; snapshots are the
Checkpointer's (storage/checkpointer.py), what the run says the RunReport's (reporting/run_report.py),
and the decisions every rank takes at one step (a stop, a divergence, a snapshot timer) the RunGuard's
(distributed/guard.py). A resumed run goes on with the next unseen sample of the epoch's global order.
"""
import signal
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from mingpt.char_dataset import batch_on, in_windows
from mingpt.common.errors import TrainingDiverged, check, check_not_negative, check_positive
from mingpt.distributed import control, parallel
from mingpt.distributed.fault_tolerance import FaultToleranceConfig, plain
from mingpt.distributed.guard import RunGuard, WatchKeys
from mingpt.distributed.parallel import ParallelKeys
from mingpt.distributed.process_group import DistEnv, all_reduce_sum
from mingpt.optimizer import learning_rate_at, set_learning_rate
from mingpt.planning.placement import PlacedModel
from mingpt.reporting import hellaswag_eval
from mingpt.reporting.hellaswag_eval import HellaSwagKeys
from mingpt.reporting.metrics import default_metrics_path, replica_group_metrics_path
from mingpt.reporting.run_report import ReportKeys, ReportSettings, RunReport
from mingpt.reporting.trackers import TrackerConfig
from mingpt.storage.checkpointer import LOWER_LEARNING_RATE, Checkpointer, SnapshotKeys, SnapshotPolicy
from mingpt.storage.lease import SnapshotLease
from mingpt.storage.snapshot import Progress, Snapshot
from mingpt.tokens.data_loader import rank_loader
from mingpt.tokens.sample_order import SampleOrder

__all__ = ["Trainer", "TrainerConfig", "Snapshot"]

MAX_RANKS = 100_000  # spaces per-epoch seeds apart, so no two (epoch, rank) pairs share one


@dataclass
class TrainerConfig(ParallelKeys, SnapshotKeys, WatchKeys, ReportKeys, HellaSwagKeys):
    """trainer_config: the original's keys here; the project's others beside the code that reads them
    (their groups, the bases: parallel.py, checkpointer.py, guard.py, run_report.py, hellaswag_eval.py),
    one flat section all the same (docs/configuration.md)."""

    max_epochs: int = 10
    """Epochs to train, counting those a resumed snapshot has finished already."""
    max_steps: int = 0
    """Stop after this many optimizer steps, across epochs, instead of after max_epochs (0: off).
    The learning-rate schedule's horizon follows it."""
    batch_size: int = 216
    """Samples per micro-batch on each process (global batch: batch_size x grad_accum_steps x world)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; gradients are synchronised on the last one only."""
    data_loader_workers: Optional[int] = None
    """DataLoader worker processes per rank (0: load in the training process). Unset: the original's
    4, capped at the CPU cores each rank can spare (data_loader.usable_workers)."""
    grad_norm_clip: float = 1.0
    """Clip the gradients' global norm to this (the true gradients: fp16's are unscaled first)."""
    snapshot_path: str = "gpt_snapshot.pt"
    """Local path or fsspec URL (s3://...). Ending in .pt: one file; otherwise a folder of them."""
    save_every: int = 3
    """Write a snapshot after every this many epochs."""
    use_amp: bool = True
    """Mixed precision: see amp_dtype, and precision.py for what each device does."""
    seed: int = 1337
    """Seeds the initial weights (each parameter from the seed and its name, so they do not depend on
    the method or the world size), the train/test split, shuffling, and dropout (per rank and epoch)."""
    eval_every_steps: int = 0
    """Evaluate every this many optimizer steps instead of at the end of each epoch (0: at epochs)."""
    eval_batches: int = 100
    """Evaluate on at most this many batches per rank, the same ones every time (0: the whole test split,
    however large), as nanoGPT's eval_iters (tokens/data_loader.py's rank_loader). 100: the default run's
    26 test batches whole; FineWeb's 100M-token val_path in the time of about 33 training steps."""

    def __post_init__(self) -> None:
        super().__post_init__()  # each group's own keys
        check_positive(self, "trainer_config", "max_epochs", "batch_size", "grad_accum_steps", "save_every",
                       "grad_norm_clip")
        check_not_negative(self, "trainer_config", "max_steps", "eval_every_steps", "eval_batches")
        if self.data_loader_workers is not None:
            check_not_negative(self, "trainer_config", "data_loader_workers")
        check(bool(self.snapshot_path), "trainer_config.snapshot_path", "must not be empty")
        check(self.snapshot_format == "single" or not self.snapshot_path.endswith(".pt"),
              "trainer_config.snapshot_path", "sharded snapshots need a folder, not a .pt file")

    def step_samples(self, world_size: int = 1) -> int:
        """The samples of one optimizer step over world_size ranks (one: a rank's; the run's world: the
        global batch), the one place it is counted."""
        return self.batch_size * self.grad_accum_steps * world_size

    def report_settings(self, replicas: FaultToleranceConfig) -> ReportSettings:
        path = self.metrics_path or default_metrics_path(self.snapshot_path)
        if replicas.follows:
            path = replica_group_metrics_path(path, replicas.replica_group)  # each group keeps its own
        return ReportSettings(path,
                              metrics_folder_of_its_own=self.metrics_path is not None,
                              log_every=self.log_every, progress_interval_s=self.progress_interval_s,
                              max_epochs=None if self.max_steps else self.max_epochs)

    def snapshot_policy(self, replicas: FaultToleranceConfig) -> SnapshotPolicy:
        return SnapshotPolicy(path=self.snapshot_path, snapshot_format=self.snapshot_format,
                              keep_last=self.keep_last, async_snapshots=self.async_snapshots,
                              every_epochs=self.save_every, every_steps=self.save_every_steps,
                              every_minutes=self.save_every_minutes,
                              resume_on_other_data=self.resume_on_other_data,
                              leased=not replicas.follows)


class Trainer:
    def __init__(self, config: TrainerConfig, placed: PlacedModel, train_dataset: Dataset,
                 test_dataset: Optional[Dataset], vocab: Sequence[str], env: DistEnv,
                 sample_order: Optional[SampleOrder] = None, lease: Optional[SnapshotLease] = None):
        self.config, self.env, self.vocab, self.placed = config, env, vocab, placed
        self.model, self.optimizer, self.scaler = placed.model, placed.optimizer, placed.scaler
        """The original's three, placed for this rank (start_up.place_model)."""
        self.optimizer_config, self.precision = placed.optimizer_config, placed.precision
        self.replicas = placed.replicas
        """Under fault tolerance, this replica group's part in the run (distributed/fault_tolerance.py)."""
        self.block_size = parallel.unwrap(self.model).config.block_size
        self.test_samples = len(test_dataset) if test_dataset is not None else 0
        """The test split's samples, before eval_batches bounds an evaluation."""
        self.data_env = self.replicas.data_env
        """This rank's place in the global sample order (its group's slot under fault tolerance)."""
        self.train_loader = self._prepare_dataloader(train_dataset, train=True)
        self.test_loader = self._prepare_dataloader(test_dataset, train=False) if test_dataset else None
        self.hellaswag = hellaswag_eval.for_run(config.hellaswag_path, vocab, self.block_size,
                                                config.hellaswag_items)
        fault_tolerance = self.replicas.settings
        self.checkpointer = Checkpointer(config.snapshot_policy(fault_tolerance), env, vocab, sample_order,
                                         lease)
        self.guard = RunGuard(config, env, self.checkpointer.folder, self.checkpointer.kept,
                              compiled=config.compile, scaled=self.scaler.is_enabled(),
                              save_every_minutes=config.save_every_minutes)
        """The hang watchdog, the divergence watch and the step agreement (distributed/guard.py)."""
        self.guard.time_arrivals(parallel.unwrap(self.model).input_parameters())
        self.progress = self._load_snapshot()
        self.replicas.keep(self.model, self.optimizer, self.scaler, self.progress)  # what a joining group heals
        self.steps_per_epoch = len(self.train_loader)
        self.total_steps = config.max_steps or self.progress.step + self.train_loader.sampler.steps_left(
            self.progress.finished_epoch, self.progress.epoch_samples, config.max_epochs)
        """The run's length in optimizer steps: the learning-rate schedule's horizon and the ETA's."""
        self.report = RunReport.open(config.report_settings(fault_tolerance), env,
                                     self.precision.matmul_dtype, parallel.unwrap(self.model).flops_per_token(),
                                     self.total_steps, self.progress.step, self.guard.watch.rank_times)
        self.step_estimate_s = self.report.monitor.step_estimate_s(config.step_samples() * self.block_size)
        """A step's time before any is measured (rank 0's, who warns; 0: unknown)."""
        self.guard.watch.check_timeout(self.step_estimate_s)

    def _prepare_dataloader(self, dataset: Dataset, train: bool) -> DataLoader:
        """The original's _prepare_dataloader: this rank's share of a split, in the global order of
        tokens/data_loader.py (DistributedSampler's dealing, resumable mid-epoch). A training batch
        holds a whole optimizer step: grad_accum_steps micro-batches; evaluation is bounded by
        eval_batches."""
        tc = self.config
        return rank_loader(in_windows(dataset), tc.batch_size, tc.grad_accum_steps if train else None,
                           tc.eval_batches, tc.data_loader_workers, tc.seed, self.data_env if train else self.env,
                           control.handled_signals(tc.stop_signals))

    def _load_snapshot(self) -> Progress:
        """The original's _load_snapshot: the newest snapshot, if any, into the model, optimizer and
        scaler (storage/checkpointer.py); where training stands."""
        return self.checkpointer.resume(self.model, plain(self.optimizer), self.scaler)

    def track(self, config: TrackerConfig, run_config: dict[str, Any], summary: list[str]) -> None:
        """Send the metrics to run trackers too, continuing the tracked runs of a resumed snapshot
        (under fault tolerance, replica group 0's metrics: one tracked run)."""
        if not self.replicas.settings.follows:
            self.report.track(config, self.checkpointer.folder, self.progress, run_config, summary)

    def train(self) -> None:
        """Epochs until the budget (max_epochs, or max_steps) is spent; raises RunStopped when a
        stop signal ended the run early (after its snapshot)."""
        if self._budget_spent():
            self.report.nothing_left(self.config.max_steps, self.config.max_epochs)
            return
        self.report.monitor.forecast(self.total_steps - self.progress.step, self.step_estimate_s)
        failed, finished = self.report.failed_on_error(), self.checkpointer.finished_on_error()
        with failed, self.guard, self.replicas, finished:
            self.guard.stop_at_once_when(self._loses_nothing, self.checkpointer.kept)
            try:
                while not self._budget_spent():
                    epoch = self.progress.finished_epoch + 1
                    self._run_epoch(epoch)
                    if self.progress.finished_epoch == epoch:
                        self._end_epoch(epoch)
                self._end_run()
            except (control.StopRequested, RuntimeError) as error:  # torch.distributed's are RuntimeErrors
                number = self.guard.stop_signal_of(error)
                if not number:
                    raise
                self._stopped_at_once(number)
        self.report.finished(self.progress, self.checkpointer.policy.path)

    def _end_epoch(self, epoch: int) -> None:
        self._snapshot_if_due(epoch_ended=True)
        if self.test_loader is not None and not self.config.eval_every_steps:
            self.evaluate(epoch)

    def _end_run(self) -> None:
        """The run's last snapshot, and an evaluation of its last step if none was made there (a step
        budget's run may end mid-epoch)."""
        self._snapshot_if_due(run_ended=True)
        if self.test_loader is not None and self.report.evaluated_at != self.progress.step:
            self.evaluate(self.progress.epoch)
        self.score_hellaswag(self.progress.epoch, run_ended=True)
        self.checkpointer.finish()

    def _budget_spent(self) -> bool:
        if self.config.max_steps:
            return self.progress.step >= self.config.max_steps
        return self.progress.finished_epoch >= self.config.max_epochs

    def to_device(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        return batch_on(self.env.device, batch)

    def _start_epoch(self, epoch: int) -> int:
        """Set up the sampler and RNG for epoch; return the step it starts at (0 unless resuming).
        Dropout differs per rank and per epoch, yet an epoch replays exactly after a resume."""
        self.train_loader.sampler.set_epoch(epoch, start=self.progress.epoch_samples)
        dropout_seed = self.config.seed + MAX_RANKS * epoch + self.data_env.rank
        if not self.checkpointer.restore_rng(fallback_seed=dropout_seed):
            torch.manual_seed(dropout_seed)  # seeds the CUDA generators too
        return self.progress.epoch_step

    def _run_epoch(self, epoch: int) -> None:
        """Train the rest of epoch, or until the step budget is spent (the epoch then stays open)."""
        self.model.train()
        first_step = self._start_epoch(epoch)
        self.report.pause()
        self.guard.at("data", self.progress.step + 1)
        for iteration, batch in enumerate(self.train_loader, start=first_step):
            source, targets = self.to_device(batch)
            loss, grad_norm = self._run_batch(source, targets)
            samples = len(source) * self.data_env.world_size  # every rank's batch has the same length
            self.progress.advance(samples, tokens=samples * self.block_size)
            self.report.missed(epoch, self.progress, self.replicas.step_taken(len(source)))
            lr = self.optimizer.param_groups[0]["lr"]
            self.report.train_step(epoch, iteration, self.progress, loss, grad_norm, lr)
            self._after_step(epoch, loss, grad_norm)
            if self._budget_spent():
                break
            self.guard.at("data", self.progress.step + 1)
        else:
            self.progress.finish_epoch(epoch)
        self.report.flush()

    def _after_step(self, epoch: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """What every rank agreed on (a diverged run, a failed save, a snapshot due, a clean stop),
        then step-cadence evaluation and HellaSwag."""
        decision = self.guard.step_taken(self.progress.step, loss, grad_norm, self.checkpointer.failed())
        if decision.diverged_since:
            self._stop_diverged(decision.diverged_since)
        self.checkpointer.note_health(self.guard.health())
        if decision.save_failed:
            self.checkpointer.finish()  # raises on every rank
        if decision.stop_signal:
            self._stop(decision)
        self._snapshot_if_due(decision)
        step = self.progress.step
        if self.config.eval_every_steps and step % self.config.eval_every_steps == 0 and self.test_loader:
            self.evaluate(epoch)
        self.score_hellaswag(epoch)

    def _stop_if_asked(self, abandoned: str = "") -> None:
        """Between two steps (each batch of an evaluation, after a snapshot), every rank at the same
        point: when any rank was asked to stop, all stop here, `abandoned` what they were doing."""
        decision = self.guard.stop_asked()
        if decision.stop_signal:
            self._stop(decision, abandoned)

    def _stop(self, decision: control.Decision, abandoned: str = "") -> None:
        """The stop's snapshot of the last step is taken (unless it was already); once it is written,
        every rank raises RunStopped."""
        self.guard.stopping()
        when = self.checkpointer.due(self.progress, decision)
        if when and self.replicas.writes_snapshots():
            self._save_snapshot(when)
        self.checkpointer.finish()  # "saved" below means written
        self.guard.settled()
        writer = None if self.replicas.writes_snapshots() else self.replicas.snapshot_writer()
        self.report.stopped(decision.stop_signal_name, self.progress.step, writer, abandoned)
        raise control.RunStopped(decision.stop_signal)

    def _loses_nothing(self) -> bool:
        """Whether a stop now loses no training: none done yet, or none since the last snapshot."""
        return self.progress.step == 0 or self.progress == self.checkpointer.last_saved

    def _stopped_at_once(self, number: int) -> None:
        """A stop signal that came while it lost nothing (_loses_nothing), wherever the training
        thread was (a step begun, a compilation, a wait for data): this process stops without a
        collective, since its peers may be anywhere; they meet the same condition and stop too."""
        self.checkpointer.finish_alone()  # "saved" below means written
        saved = self.checkpointer.last_saved
        self.report.stopped(signal.Signals(number).name, saved.step if saved else 0)
        raise control.RunStopped(number)

    def _stop_diverged(self, since: int) -> None:
        """Every rank stops at this step, before any snapshot of the ruined weights is taken, and the
        snapshots taken inside the divergence are set aside for the last healthy one."""
        self.checkpointer.finish()  # a save in flight was of finite weights (save() checks them)
        lr = learning_rate_at(since - 1, self.total_steps, self.optimizer_config)
        cause, advice = self.guard.divergence_said(since, lr, self.env.is_main)
        raise TrainingDiverged(f"training diverged: {cause}; stopped, "
                               f"{self.checkpointer.go_back_to_healthy(LOWER_LEARNING_RATE + advice)}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The original's _run_batch: the forward pass in the run's precision, the backward pass
        through the grad scaler, the true gradients clipped, the optimizer's step. Here a batch is
        grad_accum_steps micro-batches, their gradients synchronised on the last; returns the mean
        loss and the gradients' norm before clipping (on the device: nothing waits)."""
        set_learning_rate(self.optimizer, self.progress.step, self.total_steps, self.optimizer_config)
        self.optimizer.zero_grad(set_to_none=True)
        micro_batches = list(zip(source.split(self.config.batch_size), targets.split(self.config.batch_size)))
        total_loss = torch.zeros((), device=source.device)
        for index, (micro_source, micro_targets) in enumerate(micro_batches):
            share = len(micro_source) / len(source)  # an epoch's last batch may be short
            # The forward pass too: DDP decides there whether the backward pass will all-reduce.
            with parallel.gradient_sync(self.model, enabled=index == len(micro_batches) - 1):
                loss = self.compute_loss(micro_source, micro_targets)
                self.backward(loss * share)
            total_loss += loss.detach().float() * share
        return total_loss, self.optimizer_step()

    # The three phases of a step, public so that bench/bench_train.py can time each one. Each tells
    # the guard where training is (the hang watchdog's phases).

    def compute_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The forward pass: the mean loss over a micro-batch, in the run's precision."""
        if self.model.training:
            self.guard.at("forward", self.progress.step + 1)
        with self.placed.autocast():
            _, loss = self.model(inputs, targets)
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of loss; the scaler is a no-op unless fp16 needs it."""
        self.guard.at("backward", self.progress.step + 1)
        self.scaler.scale(loss).backward()

    def optimizer_step(self) -> torch.Tensor:
        """Clip, step and update the scaler; the gradients' norm before clipping (on the device)."""
        self.guard.at("optimizer", self.progress.step + 1)
        self.scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return parallel.full_value(grad_norm)

    @torch.no_grad()
    def evaluate(self, epoch: int) -> float:
        """Mean test loss over all ranks' samples, with dropout off. Logged once, by rank 0.

        DistributedSampler pads the last round with repeated samples so that every rank gets the
        same count: up to world_size - 1 samples are counted twice.
        """
        totals = torch.zeros(2, device=self.env.device)  # sum of sample losses, sample count
        with self._evaluating("evaluation") as at:
            for iteration, batch in enumerate(self.test_loader):
                at(iteration)
                inputs, targets = self.to_device(batch)
                loss = self.compute_loss(inputs, targets)
                totals[0] += loss.float() * len(inputs)
                totals[1] += len(inputs)
                self.report.loss_line("Eval", epoch, iteration, loss)
            loss_sum, count = all_reduce_sum(totals)
        mean_loss = loss_sum / count
        self.report.evaluation(epoch, self.progress, mean_loss, int(count), self.env.world_size)
        return mean_loss.item()

    @torch.no_grad()
    def score_hellaswag(self, epoch: int, run_ended: bool = False) -> None:
        """HellaSwag's accuracy of this step's weights, when due (every hellaswag_every_steps steps, and
        at the run's last step), each rank scoring its share of the items (reporting/hellaswag_eval.py)."""
        if not self.config.hellaswag_due(self.progress.step, self.report.hellaswag_at, run_ended):
            return
        env = self.env
        with self._evaluating("HellaSwag scoring") as at, self.placed.autocast():
            score = self.hellaswag.score(lambda ids: self.model(ids)[0], env.device, env.rank, env.world_size, at)
        self.report.hellaswag(epoch, self.progress, score, env.world_size)

    @contextmanager
    def _evaluating(self, what: str) -> Iterator[Callable[[int], None]]:
        """Dropout off for an evaluation of this step's weights; each of its batches a point where the
        hang watchdog sees it and a stop lands (abandoning `what`). Its time is not training's."""
        self.model.eval()

        def at(batch: int) -> None:
            self.guard.at("evaluation", self.progress.step, batch)
            self._stop_if_asked(what)

        yield at
        self.model.train()
        self.report.pause()

    def _snapshot_if_due(self, decision: control.Decision = control.Decision(), **occasion: bool) -> None:
        when = self.checkpointer.due(self.progress, decision, **occasion)
        if when and self.replicas.writes_snapshots():
            self._save_snapshot(when)
            self._stop_if_asked()  # one that came during the save: nothing more to save

    def _save_snapshot(self, when: str) -> None:
        """Take a snapshot of the training state now (every rank calls it), `when` naming the
        moment in the log line; with async_snapshots, checkpointer.finish() waits for its write."""
        self.report.publish()  # the metrics file holds at least what the snapshot covers
        self.guard.at("snapshot", self.progress.step)
        self.checkpointer.save(when, self.progress, self.model, plain(self.optimizer), self.scaler)
        self.guard.saved()

