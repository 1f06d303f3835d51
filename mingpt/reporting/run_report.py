"""What a training run tells its user as it goes, in one place: the original's loss lines, live
progress (tokens/s, MFU, ETA) and the metrics file (JSON lines, TensorBoard scalars).

Every rank calls it; global rank 0 speaks and writes (the others' MetricsLog and monitor are
inactive). A new metric sink (a run tracker) joins MetricsLog's flush, which already holds each
step's numbers on the host in one device sync.
"""
from typing import Optional

import torch

from mingpt.reporting.logger import clear_status, log
from mingpt.reporting.metrics import MetricsLog
from mingpt.reporting.monitor import TrainingMonitor
from mingpt.storage.snapshot import Progress


class RunReport:
    def __init__(self, metrics: MetricsLog, monitor: TrainingMonitor, rank: int, log_every: int):
        self.metrics = metrics
        self.monitor = monitor
        self.rank = rank
        self.log_every = log_every

    def train_step(self, epoch: int, iteration: int, progress: Progress, loss: torch.Tensor,
                   lr: float) -> None:
        """A step's loss into progress and the metrics (on the device until the next flush), and the
        original's line every log_every iterations."""
        self.monitor.update(epoch, progress.step, progress.tokens, loss)
        self.metrics.record("train", loss, epoch=epoch, iter=iteration, step=progress.step,
                            tokens=progress.tokens, lr=lr, tokens_per_s=self.monitor.tokens_per_s,
                            mfu=self.monitor.mfu)
        self.loss_line("Train", epoch, iteration, loss)

    def loss_line(self, kind: str, epoch: int, iteration: int, loss: torch.Tensor) -> None:
        if iteration % self.log_every == 0:
            # .item() waits for the device: only when printing.
            log.info(f"[GPU{self.rank}] Epoch {epoch} | Iter {iteration} | {kind} Loss {loss.item():.5f}")
            self.metrics.flush()

    def evaluation(self, epoch: int, progress: Progress, mean_loss: torch.Tensor, samples: int,
                   world_size: int) -> None:
        self.metrics.record("eval", mean_loss, epoch=epoch, step=progress.step, tokens=progress.tokens,
                            samples=samples)
        self.metrics.flush()
        log.info(f"[GPU{self.rank}] Epoch {epoch} | Eval Loss {mean_loss.item():.5f} "
                 f"(mean over {samples} samples on {world_size} ranks)")

    def pause(self) -> None:
        """Something that is not training ran (an eval, a snapshot): measure throughput afresh."""
        self.monitor.restart_window()

    def flush(self) -> None:
        self.metrics.flush()

    def publish(self) -> None:
        """The metrics file, wherever it is, holds every step so far (a snapshot is being taken)."""
        self.metrics.publish()

    def close(self, last_words: Optional[str] = None) -> None:
        clear_status()
        if last_words:
            log.info(last_words)
        self.metrics.close()
