"""Training snapshots: what they hold, and writing and reading them safely through fsspec.

- Atomic: the snapshot is written to a temporary name beside the target and renamed (moved, on
  object stores) only once complete, so a crash mid-save leaves the previous snapshot intact.
- Safe: loaded with weights_only=True, so a snapshot can hold tensors and plain values but cannot
  run code.
- Self-describing: the vocabulary and model config travel with the weights, so a snapshot alone
  can rebuild its model and decode its output.
"""
import io
import os
import uuid
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from errors import SnapshotError
from storage import short_reason


@dataclass
class Snapshot:
    model_state: dict[str, torch.Tensor]
    """Full model state dict, unprefixed parameter names."""
    optimizer_state: dict[str, Any]
    """Full optimizer state dict, keyed by parameter name."""
    finished_epoch: int
    scaler_state: dict[str, Any]
    """GradScaler state; empty when no scaler is in use."""
    vocab: list[str]
    """Characters in token-id order."""
    model_config: dict[str, Any]
    """The GPTConfig fields the model was built with."""

    def check_matches(self, model_config: dict[str, Any], vocab: list[str], path: str) -> None:
        """Refuse a snapshot of another model shape or vocabulary, naming what differs."""
        shape_keys = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")
        differ = [f"{k}={self.model_config.get(k)} (config: {model_config[k]})"
                  for k in shape_keys if self.model_config.get(k) != model_config[k]]
        if differ:
            raise SnapshotError(f"snapshot {path} is of another model: {', '.join(differ)}; set "
                                "trainer_config.snapshot_path to a new file or match the model config")
        if self.vocab != vocab:
            raise SnapshotError(f"snapshot {path} was trained on another vocabulary; set "
                                "trainer_config.snapshot_path to a new file or use the snapshot's data")


def save_snapshot(snapshot: Snapshot, path: str) -> None:
    """Write snapshot to path (local or any fsspec URL), replacing the old one only when complete."""
    fs, target = fsspec.core.url_to_fs(path)
    parent = os.path.dirname(target)
    temporary = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        if parent:
            fs.makedirs(parent, exist_ok=True)
        with fs.open(temporary, "wb") as f:
            torch.save(asdict(snapshot), f)
            if isinstance(fs, LocalFileSystem):
                f.flush()
                os.fsync(f.fileno())  # the rename below must not expose unwritten blocks
        fs.mv(temporary, target)
    except OSError as e:
        if fs.exists(temporary):
            fs.rm(temporary)
        raise SnapshotError(f"could not write snapshot {path} ({short_reason(e)}); "
                            "check trainer_config.snapshot_path and free space") from None


def load_snapshot(path: str) -> Optional[Snapshot]:
    """The snapshot at path, None if there is none; SnapshotError if it is not a usable one."""
    fs, target = fsspec.core.url_to_fs(path)
    if not fs.exists(target):
        return None
    advice = "move it away or set trainer_config.snapshot_path to another file"
    try:
        with fs.open(target, "rb") as f:
            # Read whole, then parse: much faster than torch.load on a remote file object.
            buffer = io.BytesIO(f.read())
        state = torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable, corrupt or unsafe file is the same problem to the user
        raise SnapshotError(f"snapshot {path} cannot be loaded ({short_reason(e)}); {advice}") from None
    expected = {f.name for f in fields(Snapshot)}
    if not isinstance(state, dict) or set(state) != expected:
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise SnapshotError(f"snapshot {path} is not a minGPT-DDP snapshot (holds {found}); {advice}")
    return Snapshot(**state)
