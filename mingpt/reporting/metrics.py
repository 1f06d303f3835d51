"""Training metrics as JSON lines, kept by global rank 0 beside the snapshot (any fsspec path).

One line per training step (epoch, iter, step, tokens, loss, lr, tokens_per_s: the throughput of
the latest progress window, mfu, grad_norm), one per eval pass, and one per HellaSwag scoring
("kind": "hellaswag": accuracy, correct, items; reporting/hellaswag_eval.py), and under fault tolerance
one per step whose samples of the global order nobody trained ("kind": "missed": samples; each replica
group keeps a file of its own: replica_group_metrics_path); run trackers (trackers.py)
get the same lines as they are flushed. Step losses and norms stay on the device until flush(), which the
trainer calls at log time: recording a step costs no host-device synchronisation.

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

from mingpt.common import files
from mingpt.common.logger import warn_once
from mingpt.reporting.trackers import FINISHED, Trackers


def default_metrics_path(snapshot_path: str) -> str:
    """Beside the snapshot: `gpt_snapshot.pt` -> `gpt_snapshot.metrics.jsonl`; a snapshot folder
    `s3://bucket/run/` -> `s3://bucket/run/metrics.jsonl`."""
    if snapshot_path.endswith(".pt"):
        return snapshot_path[: -len(".pt")] + ".metrics.jsonl"
    return snapshot_path.rstrip("/") + "/metrics.jsonl"


def replica_group_metrics_path(path: str, group: int) -> str:
    """Replica group g's own file under fault tolerance (group 0 keeps path): `gpt_snapshot.metrics.jsonl`
    -> `gpt_snapshot.metrics.replica1.jsonl`. Each group's rank 0 writes its own, as it saw the run."""
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}.replica{group}.{suffix}" if dot and "/" not in suffix else f"{path}.replica{group}"


def open_run_metrics(path: str, check_folder: bool, active: bool) -> "MetricsLog":
    """The run's metrics log at path, its folder checked for writing at start-up if asked."""
    if active and check_folder:
        files.check_writable(files.parent_folder(path), "trainer_config.metrics_path")
    return MetricsLog(path, active)


def local_copy_of(url: str) -> str:
    """Where the lines of a remote metrics file are appended (one file per URL, in the cache folder)."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return str(files.cache_folder(None) / "metrics" / f"{digest}.jsonl")


class MetricsLog:
    def __init__(self, path: str, active: bool):
        self.path = path
        self.active = active
        self._appended_to = local_copy_of(path) if files.is_remote(path) else path
        """The file flush() appends to: path itself, or its local copy (see the module's docstring)."""
        self._pending: list[dict[str, Any]] = []
        self.trackers: Optional[Trackers] = None
        """Rank 0's run trackers, when the run has any (set once they are open)."""
        self._tracked_through = 0
        """The last step the trackers have had: a tracker's history only moves forward (trackers.py)."""

    def start(self, resumed_step: int) -> None:
        """Keep the lines of the steps a snapshot holds; drop any written after it (or all)."""
        if not self.active:
            return
        lines = self._read()
        self._tracked_through = max((line["step"] for line in lines), default=0)
        kept = "".join(json.dumps(line) + "\n" for line in lines if line["step"] <= resumed_step)
        files.write_atomically(self._appended_to, lambda f: f.write(kept.encode()))
        self.publish()

    def record(self, kind: str, loss: Optional[torch.Tensor] = None, **fields: Any) -> None:
        if self.active:
            losses = {} if loss is None else {"loss": loss.detach()}  # a "ranks" line has none
            self._pending.append({"kind": kind, **fields, **losses})

    def flush(self) -> None:
        if not self._pending:
            return
        lines = on_the_host(self._pending)
        self._pending.clear()
        files.append_text(self._appended_to, "".join(json.dumps(line) + "\n" for line in lines))
        if self.trackers is not None:
            self.trackers.send([line for line in lines if line["step"] > self._tracked_through])

    def publish(self) -> None:
        """Flush, and upload the local copy of a remote file (a snapshot is taken, or the run ends)."""
        self.flush()
        if self.active and self._appended_to != self.path:
            data = files.read_bytes(self._appended_to)
            files.write_atomically(self.path, lambda f: f.write(data))

    def close(self, outcome: str = FINISHED) -> None:
        self.publish()
        if self.trackers is not None:
            self.trackers.close(outcome)

    def _read(self) -> list[dict[str, Any]]:
        """The file's lines. One that cannot be read (the half line a run killed while appending
        leaves, or bytes garbled) is dropped with a warning: it must never block the next resume."""
        try:
            text = files.read_bytes(self.path).decode(errors="replace")
        except FileNotFoundError:  # no run has written it yet
            return []
        lines, dropped = [], 0
        for line in filter(str.strip, text.splitlines()):
            parsed = parse_line(line)
            if parsed is None:
                dropped += 1
            else:
                lines.append(parsed)
        if dropped:
            warn_once(f"metrics file {self.path}: dropped {dropped} unreadable line(s) (a run killed while "
                      "writing it leaves a torn last line); the others are kept")
        return lines


def parse_line(line: str) -> Optional[dict[str, Any]]:
    """A metrics line as written (a JSON object with its step), or None."""
    try:
        parsed = json.loads(line)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) and isinstance(parsed.get("step"), int) else None


def on_the_host(pending: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Recorded lines with their device tensors (losses, gradient norms) as numbers, in one sync."""
    tensor_keys = [[key for key, value in line.items() if isinstance(value, torch.Tensor)]
                   for line in pending]
    tensors = [line[key].float() for line, keys in zip(pending, tensor_keys) for key in keys]
    values = iter(torch.stack(tensors).tolist() if tensors else [])
    return [{**line, **{key: next(values) for key in keys}} for line, keys in zip(pending, tensor_keys)]


def read_metrics(path: str, kind: Optional[str] = None) -> list[dict[str, Any]]:
    """The lines of a metrics file, optionally of one kind ('train' or 'eval')."""
    lines = MetricsLog(path, active=False)._read()
    return [line for line in lines if kind is None or line["kind"] == kind]
