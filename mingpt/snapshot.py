"""Training snapshots: what they hold, and writing and reading them safely through fsspec.

- Atomic: a snapshot is written to a temporary name beside its target and renamed (copied then
  deleted, on object stores) only once complete, so a crash or a failed upload mid-save leaves the
  previous snapshot intact and never leaves a partial file under a snapshot's name.
- Safe: loaded with weights_only=True, so a snapshot can hold tensors and plain values but cannot
  run code.
- Self-describing: the vocabulary and model config travel with the weights, so a snapshot alone
  can rebuild its model and decode its output.
- Exact: the training position (epoch, batch within it, step) and every rank's RNG state, so a
  resumed run continues with the next unseen batch and the same dropout masks.

`trainer_config.snapshot_path` ending in `.pt` names one file, replaced at every save. Any other
path is a folder holding `snapshot_<step>.pt` files, of which the newest `keep_last` are kept;
resuming picks the newest.
"""
import io
import os
import re
import uuid
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Optional

import fsspec
import torch
import torch.nn as nn
from fsspec.implementations.local import LocalFileSystem

from errors import SnapshotError
from parallel import gather_full_state, restore_full_state, unwrap
from storage import make_folder, parent_folder, short_reason

TRAINING_KEY = "trainer_config.snapshot_path"
"""What the user sets to point at snapshots; error messages name it (a command may name its own)."""
_FOLDER_ENTRY = re.compile(r"snapshot_(\d+)\.pt$")


@dataclass
class Progress:
    """Where training stands."""

    finished_epoch: int = 0
    """The last epoch trained to its end."""
    epoch_step: int = 0
    """Optimizer steps of the next epoch already taken (0 at an epoch boundary)."""
    epoch_samples: int = 0
    """Positions of the next epoch's global sample order already trained, over all ranks: where a
    resumed run continues, at any world size (data_loader.py)."""
    step: int = 0
    """Optimizer steps so far."""
    tokens: int = 0
    """Training tokens seen so far, over all ranks."""
    world_size: int = 1
    """Ranks that trained up to here: RNG states are per rank, so they resume at the same count."""


@dataclass
class Snapshot(Progress):
    """Everything a run needs to continue exactly where it stopped (Progress's fields first)."""

    model_state: dict[str, torch.Tensor] = field(default_factory=dict)
    """Full model state dict, unprefixed parameter names."""
    optimizer_state: dict[str, Any] = field(default_factory=dict)
    """Full optimizer state dict, keyed by parameter name."""
    scaler_state: dict[str, Any] = field(default_factory=dict)
    """GradScaler state; empty when no scaler is in use."""
    rng_states: list[dict[str, Optional[torch.Tensor]]] = field(default_factory=list)
    """Per rank: the CPU and (when used) CUDA generator states when the snapshot was taken."""
    vocab: list[str] = field(default_factory=list)
    """Characters in token-id order."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """The GPTConfig fields the model was built with."""

    @property
    def progress(self) -> Progress:
        return Progress(**{f.name: getattr(self, f.name) for f in fields(Progress)})

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict holding the same objects: dataclasses.asdict would deep-copy every
        tensor, a second copy of the whole state made during every save."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def check_matches(self, model_config: dict[str, Any], vocab: list[str], path: str) -> None:
        """Refuse a snapshot of another model shape or vocabulary, naming what differs."""
        shape_keys = ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")
        differ = [f"{k}={self.model_config.get(k)} (config: {model_config[k]})"
                  for k in shape_keys if self.model_config.get(k) != model_config[k]]
        if differ:
            raise SnapshotError(f"snapshot {path} is of another model: {', '.join(differ)}; set "
                                "trainer_config.snapshot_path to a new location or match the model config")
        if self.vocab != vocab:
            raise SnapshotError(f"snapshot {path} was trained on another vocabulary; set "
                                "trainer_config.snapshot_path to a new location or use the snapshot's data")


def write_snapshot(snapshot: Snapshot, path: str) -> None:
    """Write snapshot to path (local or any fsspec URL), replacing the old one only when complete."""
    fs, target = fsspec.core.url_to_fs(path)
    temporary = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        make_folder(fs, fs._parent(target))
        with fs.open(temporary, "wb") as f:
            torch.save(snapshot.as_dict(), f)
            if isinstance(fs, LocalFileSystem):
                f.flush()
                os.fsync(f.fileno())  # the rename below must not expose unwritten blocks
        fs.mv(temporary, target)
    except Exception as e:  # a full disk, a lost connection, a revoked credential
        _remove_quietly(fs, temporary)
        raise SnapshotError(f"could not write snapshot {path} ({short_reason(e)}); "
                            "check trainer_config.snapshot_path, its credentials and free space") from None
    except BaseException:  # Ctrl-C pressed again mid-save: no temporary left behind either
        _remove_quietly(fs, temporary)
        raise


def _remove_quietly(fs: fsspec.AbstractFileSystem, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm(path)
    except Exception:  # the original error is the one to report
        pass


def read_snapshot(path: str, key: str = TRAINING_KEY) -> Optional[Snapshot]:
    """The snapshot at path, None if there is none; SnapshotError if it is not a usable one."""
    advice = f"move it away or set {key} to another location"
    fs, target = fsspec.core.url_to_fs(path)
    try:
        if not fs.exists(target):
            return None
        with fs.open(target, "rb") as f:
            # Read whole, then parse: much faster than torch.load on a remote file object.
            buffer = io.BytesIO(f.read())
    except Exception as e:
        raise SnapshotError(f"cannot read snapshot {path} ({short_reason(e)}); check {key} "
                            "and its credentials") from None
    try:
        state = torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt, truncated, or a pickle that would run code: all refused
        raise SnapshotError(f"snapshot {path} cannot be loaded ({short_reason(e)}); {advice}") from None
    expected = {f.name for f in fields(Snapshot)}
    if not isinstance(state, dict) or set(state) != expected:
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise SnapshotError(f"snapshot {path} is not a minGPT-DDP snapshot (holds {found}); {advice}")
    return Snapshot(**state)


def check_tensors_fit(model: nn.Module, snapshot: Snapshot) -> None:
    """ValueError naming a tensor the snapshot lacks, one the model has not, or one of another shape.
    Loading alone is not enough: it fills a missing weight with the model's fresh one, and it takes
    optimizer state of any shape (on which the first step crashes the process)."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}  # full shapes, even sharded
    optimizer_state = snapshot.optimizer_state.get("state", {})
    missing = sorted(shapes.keys() - snapshot.model_state.keys())
    if missing:
        raise ValueError(f"the snapshot lacks {', '.join(missing)}")
    unknown = sorted((snapshot.model_state.keys() | optimizer_state.keys()) - shapes.keys())
    if unknown:
        raise ValueError(f"the model has no {', '.join(unknown)}")
    tensors = [(name, name, tensor) for name, tensor in snapshot.model_state.items()]
    tensors += [(name, f"{name} ({key})", value) for name, state in optimizer_state.items()
                for key, value in state.items() if isinstance(value, torch.Tensor) and value.dim() > 0]
    for name, label, tensor in tensors:
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"the snapshot's {label} is {tuple(tensor.shape)}, the model's {shapes[name]}")


class SnapshotStore:
    """The single-file snapshots of one run: one file, or a folder keeping the newest few."""

    def __init__(self, path: str, keep_last: int = 1):
        self.path = path
        self.keep_last = keep_last
        self.is_folder = not path.endswith(".pt")

    @property
    def folder(self) -> str:
        """Where snapshots (and the metrics beside them) live."""
        return self.path.rstrip("/") if self.is_folder else parent_folder(self.path)

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, info: Snapshot, is_main: bool) -> None:
        """Gather the full state (every rank takes part); global rank 0 writes it with info."""
        self.capture(model, optimizer, info, is_main)()

    def capture(self, model: nn.Module, optimizer: torch.optim.Optimizer, info: Snapshot, is_main: bool,
                copy: Callable[[Any], Any] = lambda state: state) -> Callable[[], None]:
        """The part of a save every rank takes now: gather the full state to rank 0, passed through
        copy (a staging copy, for a background write). Returns the write, for rank 0 to run now or
        in the background (on the other ranks it does nothing)."""
        model_state, optimizer_state = gather_full_state(model, optimizer)
        if not is_main:
            return lambda: None
        model_state, optimizer_state = copy((model_state, optimizer_state))
        snapshot = replace(info, model_state=model_state, optimizer_state=optimizer_state)
        return lambda: self._write(snapshot)

    def _write(self, snapshot: Snapshot) -> None:
        """Write the snapshot; in a folder, then drop all but the newest keep_last."""
        target = f"{self.folder}/snapshot_{snapshot.step:09d}.pt" if self.is_folder else self.path
        write_snapshot(snapshot, target)
        if self.is_folder:
            for old in self._entries()[: -self.keep_last]:
                fs, old_path = fsspec.core.url_to_fs(old)
                fs.rm(old_path)

    def read_latest(self, key: str = TRAINING_KEY) -> tuple[Optional[Snapshot], Optional[str]]:
        """The newest snapshot and its path, or (None, None)."""
        path = self.latest(key)
        snapshot = read_snapshot(path, key) if path else None
        return (snapshot, path) if snapshot else (None, None)

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_config: dict[str, Any],
                vocab: list[str]) -> tuple[Optional[Snapshot], Optional[str]]:
        """Load the newest snapshot, if any, into this rank's model and optimizer."""
        snapshot, path = self.read_latest()
        if snapshot is None:
            return None, None
        snapshot.check_matches(model_config, vocab, path)
        try:
            check_tensors_fit(unwrap(model), snapshot)
            restore_full_state(model, optimizer, snapshot.model_state, snapshot.optimizer_state)
        except (RuntimeError, KeyError, ValueError) as e:
            raise SnapshotError(f"snapshot {path} does not fit this model and optimizer ({short_reason(e)}); "
                                "set trainer_config.snapshot_path to a new location") from None
        return snapshot, path

    def latest(self, key: str = TRAINING_KEY) -> Optional[str]:
        """Path of the newest complete snapshot, or None."""
        if not self.is_folder:
            return self.path
        entries = self._entries(key)
        return entries[-1] if entries else None

    def _entries(self, key: str = TRAINING_KEY) -> list[str]:
        """Complete snapshots in the folder, oldest first (temporaries do not match the name)."""
        return list_entries(self.path, _FOLDER_ENTRY, key=key)


def _names_in(fs, folder: str) -> list[str]:
    """The folder's entries; none when it does not exist (yet).

    Asked in one call: `exists` then `ls` would race with rank 0's write probe, which makes an
    object store's "folder" (a key prefix) exist for a moment and then vanish again.
    """
    try:
        return fs.ls(folder, detail=False)
    except FileNotFoundError:
        return []


def list_entries(folder_url: str, pattern: re.Pattern, complete=lambda fs, name: True,
                 key: str = TRAINING_KEY) -> list[str]:
    """URLs of the folder's entries whose names match pattern (group 1: a step), oldest first."""
    fs, folder = fsspec.core.url_to_fs(folder_url.rstrip("/"))
    try:
        names = _names_in(fs, folder)
        steps = sorted((int(m.group(1)), name.rstrip("/")) for name in names
                       if (m := pattern.search(name.rstrip("/"))) and complete(fs, name.rstrip("/")))
    except Exception as e:
        raise SnapshotError(f"cannot list snapshots in {folder_url} ({short_reason(e)}); check {key} "
                            "and its credentials") from None
    prefix = folder_url.split("://")[0] + "://" if "://" in folder_url else ""
    return [prefix + name for _, name in steps]
