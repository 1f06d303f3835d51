"""Where a training run keeps its snapshots: the interface every store offers the Checkpointer, and
the single-file store, which gathers the full state to one file (sharded_store.py writes shards).
"""
from dataclasses import replace
from typing import Any, Callable, Optional, Protocol

import torch
import torch.nn as nn

from mingpt.common import files
from mingpt.common.errors import SnapshotError, short_reason
from mingpt.distributed.parallel import gather_full_state, restore_full_state, unwrap
from mingpt.storage.snapshot import (
    Snapshot,
    check_tensors_fit,
    is_folder,
    list_entries,
    newest_snapshot,
    repadded,
    snapshot_folder,
    write_snapshot,
)


class SnapshotStore(Protocol):
    """What the Checkpointer asks of a store; FullStateStore and ShardedSnapshotStore offer it."""

    folder: str
    """Where snapshots (and the metrics beside them) live."""

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, info: Snapshot, is_main: bool) -> None:
        """Take a snapshot now; every rank calls it."""

    def capture(self, model: nn.Module, optimizer: torch.optim.Optimizer, info: Snapshot, is_main: bool,
                copy: Callable[[Any], Any]) -> Callable[[], None]:
        """The part of a save every rank takes now (the state passed through copy, a staging copy);
        returns the write, to run now or in the background."""

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_config: dict[str, Any],
                vocab: list[str], tokenizer: str = "") -> tuple[Optional[Snapshot], Optional[str]]:
        """Load the newest snapshot, if any, into this rank's model and optimizer: its info and path."""


class FullStateStore:
    """The single-file snapshots of one run (`snapshot_format=single`): one file, or a folder
    keeping the newest few. Each holds the full state, gathered to global rank 0, which writes it."""

    def __init__(self, path: str, keep_last: int = 1):
        self.path = path
        self.keep_last = keep_last
        self.is_folder = is_folder(path)

    @property
    def folder(self) -> str:
        """Where snapshots (and the metrics beside them) live."""
        return snapshot_folder(self.path)

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
            files.keep_newest(list_entries(self.path), self.keep_last)

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_config: dict[str, Any],
                vocab: list[str], tokenizer: str = "") -> tuple[Optional[Snapshot], Optional[str]]:
        """Load the newest snapshot, if any, into this rank's model and optimizer."""
        snapshot, path = newest_snapshot(self.path)
        if snapshot is None:
            return None, None
        snapshot = repadded(snapshot, model_config)
        snapshot.check_matches(model_config, vocab, path, tokenizer)
        try:
            check_tensors_fit(unwrap(model), snapshot)
            restore_full_state(model, optimizer, snapshot.model_state, snapshot.optimizer_state)
        except (RuntimeError, KeyError, ValueError) as e:
            raise SnapshotError(f"snapshot {path} does not fit this model and optimizer ({short_reason(e)}); "
                                "set trainer_config.snapshot_path to a new location") from None
        return snapshot, path
