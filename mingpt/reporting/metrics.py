"""Training metrics as JSON lines, kept by global rank 0 beside the snapshot (any fsspec path).

One line per training step (epoch, iter, step, tokens, loss, lr, tokens_per_s: the throughput of
the latest progress window) and one per eval pass; optionally the same as TensorBoard scalars. Step losses
stay on the device until flush(), which the trainer calls at log time: recording a step costs no
host-device synchronisation.

An object store cannot append: a file there would be rewritten whole at every flush, each upload
longer than the last. So for a remote path the lines are appended to a local copy (in the cache
folder), and the copy is uploaded whole when a snapshot is taken and when the run ends: the remote
file always holds at least what the newest snapshot covers, and its uploads grow with snapshots, not
with flushes.
"""
import hashlib
import json
from typing import Any, Optional

import torch

from mingpt.storage import files


def default_metrics_path(snapshot_path: str) -> str:
    """Beside the snapshot: `gpt_snapshot.pt` -> `gpt_snapshot.metrics.jsonl`; a snapshot folder
    `s3://bucket/run/` -> `s3://bucket/run/metrics.jsonl`."""
    if snapshot_path.endswith(".pt"):
        return snapshot_path[: -len(".pt")] + ".metrics.jsonl"
    return snapshot_path.rstrip("/") + "/metrics.jsonl"


def open_run_metrics(path: Optional[str], snapshot_path: str, tensorboard_dir: Optional[str],
                     active: bool, probed_folder: str) -> "MetricsLog":
    """The run's metrics log, at path or beside the snapshots; its folder is checked for writing at
    start-up, unless it is probed_folder (the snapshots', which their store checks already)."""
    path = path or default_metrics_path(snapshot_path)
    folder = files.parent_folder(path)
    if active and folder != probed_folder:
        files.check_writable(folder, "trainer_config.metrics_path")
    return MetricsLog(path, active, tensorboard_dir)


def local_copy_of(url: str) -> str:
    """Where the lines of a remote metrics file are appended (one file per URL, in the cache folder)."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return str(files.cache_folder(None) / "metrics" / f"{digest}.jsonl")


class MetricsLog:
    def __init__(self, path: str, active: bool, tensorboard_dir: Optional[str] = None):
        self.path = path
        self.active = active
        self._appended_to = local_copy_of(path) if files.is_remote(path) else path
        """The file flush() appends to: path itself, or its local copy (see the module's docstring)."""
        self._pending: list[dict[str, Any]] = []
        self._tensorboard = None
        if active and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # only when asked: pulls in tensorboard

            self._tensorboard = SummaryWriter(tensorboard_dir)

    def start(self, resumed_step: int) -> None:
        """Keep the lines of the steps a snapshot holds; drop any written after it (or all)."""
        if not self.active:
            return
        kept = "".join(json.dumps(line) + "\n" for line in self._read() if line["step"] <= resumed_step)
        files.write_atomically(self._appended_to, lambda f: f.write(kept.encode()))
        self.publish()

    def record(self, kind: str, loss: torch.Tensor, **fields: Any) -> None:
        if self.active:
            self._pending.append({"kind": kind, **fields, "loss": loss.detach()})

    def flush(self) -> None:
        if not self._pending:
            return
        values = torch.stack([line["loss"].float() for line in self._pending]).tolist()  # one sync
        lines = [{**line, "loss": value} for line, value in zip(self._pending, values)]
        self._pending.clear()
        files.append_text(self._appended_to, "".join(json.dumps(line) + "\n" for line in lines))
        if self._tensorboard is not None:
            self._add_scalars(lines)

    def publish(self) -> None:
        """Flush, and upload the local copy of a remote file (a snapshot is taken, or the run ends)."""
        self.flush()
        if self.active and self._appended_to != self.path:
            data = files.read_bytes(self._appended_to)
            files.write_atomically(self.path, lambda f: f.write(data))

    def _add_scalars(self, lines: list[dict[str, Any]]) -> None:
        for line in lines:
            self._tensorboard.add_scalar(f"{line['kind']}/loss", line["loss"], line["step"])
            if line["kind"] == "train":
                self._tensorboard.add_scalar("train/lr", line["lr"], line["step"])
                if line.get("tokens_per_s"):
                    self._tensorboard.add_scalar("train/tokens_per_s", line["tokens_per_s"], line["step"])
        self._tensorboard.flush()

    def close(self) -> None:
        self.publish()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def _read(self) -> list[dict[str, Any]]:
        try:
            text = files.read_bytes(self.path).decode()
        except FileNotFoundError:  # no run has written it yet
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def read_metrics(path: str, kind: Optional[str] = None) -> list[dict[str, Any]]:
    """The lines of a metrics file, optionally of one kind ('train' or 'eval')."""
    lines = MetricsLog(path, active=False)._read()
    return [line for line in lines if kind is None or line["kind"] == kind]
