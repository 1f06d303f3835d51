"""The training loop: epochs of training, a snapshot every `save_every` epochs, an eval pass.

The model arrives unwrapped; the Trainer puts it on this rank's device, wraps it for the configured
distributed method, and only then builds the optimizer (built earlier, FSDP would never update the
sharded parameters).
"""
import contextlib
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from errors import SnapshotError, check, check_positive
from logger import log
from metrics import MetricsLog, default_metrics_path
from model import OptimizerConfig, create_optimizer
from parallel import (
    METHODS,
    Parallelism,
    computes_in_precision,
    gather_full_state,
    grad_scaler,
    parallelize,
    restore_full_state,
    unwrap,
)
from precision import AMP_DTYPES, resolve_precision
from process_group import DistEnv, all_reduce_sum
from snapshot import Snapshot, load_snapshot, save_snapshot
from storage import check_writable, short_reason

__all__ = ["Trainer", "TrainerConfig", "Snapshot"]

MAX_RANKS = 100_000  # spaces per-epoch seeds apart, so no two (epoch, rank) pairs share one


@dataclass
class TrainerConfig:
    max_epochs: int = 10
    batch_size: int = 216
    """Samples per step on each process (the global batch is batch_size x world size)."""
    data_loader_workers: int = 4
    """DataLoader worker processes per rank; 0 loads in the training process."""
    grad_norm_clip: float = 1.0
    snapshot_path: str = "gpt_snapshot.pt"
    """Local path or fsspec URL; resumed from when it exists."""
    save_every: int = 3
    """Write a snapshot after every this many epochs."""
    use_amp: bool = True
    """Mixed precision: see amp_dtype, and precision.py for what each device does."""
    amp_dtype: str = "float16"
    """On CUDA: float16 (with a GradScaler, the original's) or bfloat16. CPUs use bfloat16."""
    distributed_method: str = "ddp"
    """ddp or fsdp."""
    cpu_offload: bool = False
    """FSDP only: keep parameters (and optimizer state) in CPU memory."""
    seed: int = 1337
    """Seeds model init, the train/test split, shuffling, and dropout (per rank and epoch)."""
    log_every: int = 100
    """Log the loss every this many iterations."""
    metrics_path: Optional[str] = None
    """JSON-lines metrics file (any fsspec path); default: beside the snapshot, *.metrics.jsonl."""

    def __post_init__(self) -> None:
        check_positive(self, "trainer_config", "max_epochs", "batch_size", "save_every",
                       "grad_norm_clip", "log_every")
        check(self.data_loader_workers >= 0, "trainer_config.data_loader_workers",
              f"must not be negative, got {self.data_loader_workers}")
        check(bool(self.snapshot_path), "trainer_config.snapshot_path", "must not be empty")
        check(self.distributed_method in METHODS, "trainer_config.distributed_method",
              f"must be one of {', '.join(METHODS)}, got {self.distributed_method!r}")
        check(not self.cpu_offload or self.distributed_method == "fsdp", "trainer_config.cpu_offload",
              "offloads FSDP shards; set trainer_config.distributed_method=fsdp or cpu_offload=False")
        check(self.amp_dtype in AMP_DTYPES, "trainer_config.amp_dtype",
              f"must be one of {', '.join(AMP_DTYPES)}, got {self.amp_dtype!r}")


class Trainer:
    def __init__(
        self,
        config: TrainerConfig,
        model: nn.Module,
        optimizer_config: OptimizerConfig,
        train_dataset: Dataset,
        test_dataset: Optional[Dataset],
        vocab: list[str],
        env: DistEnv,
    ):
        self.config = config
        self.env = env
        self.vocab = vocab
        self.block_size = unwrap(model).config.block_size
        self.precision = resolve_precision(config.use_amp, config.amp_dtype, env.device)
        self.model = parallelize(model, Parallelism(config.distributed_method, config.cpu_offload),
                                 self.precision, env)
        self.optimizer = create_optimizer(self.model, optimizer_config)
        self.scaler = grad_scaler(self.model, self.precision, env)
        # FSDP casts parameters itself; autocast on top would only add casts.
        self.autocast = contextlib.nullcontext if computes_in_precision(self.model) else self.precision.autocast
        self.train_loader = self._dataloader(train_dataset, shuffle=True)
        self.test_loader = self._dataloader(test_dataset, shuffle=False) if test_dataset else None
        metrics_path = config.metrics_path or default_metrics_path(config.snapshot_path)
        if env.is_main:
            check_writable(config.snapshot_path, "trainer_config.snapshot_path")
            check_writable(metrics_path, "trainer_config.metrics_path")
        self.metrics = MetricsLog(metrics_path, active=env.is_main)
        self.epochs_run = self._load_snapshot()
        self.metrics.start(resumed_epoch=self.epochs_run)

    def train(self) -> None:
        for epoch in range(self.epochs_run + 1, self.config.max_epochs + 1):
            self._train_epoch(epoch)
            if epoch % self.config.save_every == 0:
                self._save_snapshot(epoch)
            if self.test_loader is not None:
                self.evaluate(epoch)

    def _dataloader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        workers = self.config.data_loader_workers
        sampler = DistributedSampler(dataset, num_replicas=self.env.world_size, rank=self.env.rank,
                                     shuffle=shuffle, seed=self.config.seed)
        return DataLoader(
            dataset,
            batch_size=self.config.batch_size,
            sampler=sampler,
            num_workers=workers,
            persistent_workers=workers > 0,  # forking new workers every epoch costs seconds
            pin_memory=self.env.device.type == "cuda",
        )

    def _to_device(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.to(self.env.device, non_blocking=True) for t in batch]

    def _log_loss(self, kind: str, epoch: int, iteration: int, loss: torch.Tensor) -> None:
        if iteration % self.config.log_every == 0:
            # .item() waits for the device: do it only when printing.
            log.info(f"[GPU{self.env.rank}] Epoch {epoch} | Iter {iteration} | {kind} Loss {loss.item():.5f}")
            self.metrics.flush()

    def _train_epoch(self, epoch: int) -> None:
        self.model.train()
        sampler = self.train_loader.sampler
        sampler.set_epoch(epoch)
        # Dropout differs per rank and per epoch, yet an epoch replays exactly after a resume.
        torch.manual_seed(self.config.seed + MAX_RANKS * epoch + self.env.rank)
        first_step = (epoch - 1) * len(self.train_loader)
        for iteration, batch in enumerate(self.train_loader):
            loss = self.train_step(*self._to_device(batch))
            samples_seen = (epoch - 1) * sampler.total_size + min(
                (iteration + 1) * self.config.batch_size, sampler.num_samples) * self.env.world_size
            self.metrics.record("train", loss, epoch=epoch, iter=iteration, step=first_step + iteration + 1,
                                tokens=samples_seen * self.block_size, lr=self.optimizer.param_groups[0]["lr"])
            self._log_loss("Train", epoch, iteration, loss)
        self.metrics.flush()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One optimizer step. The scaler is a no-op unless fp16 needs it."""
        with self.autocast():
            _, loss = self.model(inputs, targets)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones
        nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, epoch: int) -> float:
        """Mean test loss over all ranks' samples, with dropout off. Logged once, by rank 0.

        DistributedSampler pads the last round with repeated samples so that every rank gets the
        same count: up to world_size - 1 samples are counted twice.
        """
        self.model.eval()
        totals = torch.zeros(2, device=self.env.device)  # sum of sample losses, sample count
        for iteration, batch in enumerate(self.test_loader):
            inputs, targets = self._to_device(batch)
            with self.autocast():
                _, loss = self.model(inputs, targets)
            totals[0] += loss.float() * len(inputs)
            totals[1] += len(inputs)
            self._log_loss("Eval", epoch, iteration, loss)
        loss_sum, count = all_reduce_sum(totals)
        mean_loss = loss_sum / count
        tokens = epoch * self.train_loader.sampler.total_size * self.block_size  # trained on so far
        self.metrics.record("eval", mean_loss, epoch=epoch, tokens=tokens, samples=int(count))
        self.metrics.flush()
        log.info(f"[GPU{self.env.rank}] Epoch {epoch} | Eval Loss {mean_loss.item():.5f} "
                 f"(mean over {int(count)} samples on {self.env.world_size} ranks)")
        self.model.train()
        return mean_loss.item()

    def _save_snapshot(self, epoch: int) -> None:
        model_state, optimizer_state = gather_full_state(self.model, self.optimizer)
        if self.env.is_main:
            snapshot = Snapshot(
                model_state=model_state,
                optimizer_state=optimizer_state,
                finished_epoch=epoch,
                scaler_state=self.scaler.state_dict(),
                vocab=self.vocab,
                model_config=asdict(unwrap(self.model).config),
            )
            save_snapshot(snapshot, self.config.snapshot_path)
            log.info(f"Snapshot saved at epoch {epoch}")

    def _load_snapshot(self) -> int:
        """Restore the snapshot if there is one; return the epoch it finished (0 if none)."""
        path = self.config.snapshot_path
        snapshot = load_snapshot(path)
        if snapshot is None:
            log.info("Snapshot not found. Training model from scratch")
            return 0
        snapshot.check_matches(asdict(unwrap(self.model).config), self.vocab, path)
        try:
            restore_full_state(self.model, self.optimizer, snapshot.model_state, snapshot.optimizer_state)
            if snapshot.scaler_state and self.scaler.is_enabled():
                self.scaler.load_state_dict(snapshot.scaler_state)
        except (RuntimeError, KeyError, ValueError) as e:
            raise SnapshotError(f"snapshot {path} does not fit this model and optimizer "
                                f"({short_reason(e)}); "
                                "set trainer_config.snapshot_path to a new file") from None
        log.info(f"Resuming training from snapshot at Epoch {snapshot.finished_epoch}")
        return snapshot.finished_epoch
