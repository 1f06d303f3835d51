"""Where a training run keeps its snapshots: the interface every store offers the Checkpointer, and
the single-file store, which gathers the full state to one file (sharded_store.py writes shards).
"""
import contextlib
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Protocol

import torch
import torch.nn as nn

from mingpt.common import files
from mingpt.common.errors import SnapshotError, short_reason
from mingpt.distributed.parallel import gather_full_state, restore_full_state, unwrap
from mingpt.storage.snapshot import (
    FOLDER_ENTRY,
    SHARDED_ENTRY,
    TRAINING_KEY,
    Snapshot,
    beside,
    check_tensors_fit,
    is_folder,
    list_entries,
    newest_snapshot,
    repadded,
    sharded_entries,
    snapshot_folder,
    step_of,
    write_error,
    write_snapshot,
)

FORMAT_KEY = "trainer_config.snapshot_format"
_PATTERNS = {"single": FOLDER_ENTRY, "sharded": SHARDED_ENTRY}


@dataclass(frozen=True)
class SetAside:
    """What a store did with the snapshots a diverged run wrote after its last healthy one."""

    moved: list[str]
    """Where they are now: names no run resumes from (kept to look at, never pruned)."""
    resume_from: Optional[str]
    """The snapshot a resume now picks: the newest that healthy steps followed (None: none)."""


class SnapshotStore(Protocol):
    """What the Checkpointer asks of a store; FullStateStore and ShardedSnapshotStore offer it.

    A diverged run must go back to a snapshot that healthy steps followed, never to one written
    inside the spike (checkpointer.py): a store keeps the newest such snapshot, as `confirm` names
    it, however many newer ones it writes, and can set the newer ones aside."""

    folder: str
    """Where snapshots (and the metrics beside them) live."""

    def confirm(self, step: int) -> None:
        """The snapshot of step was followed by healthy steps: keep it until a newer one is."""

    def set_aside(self) -> SetAside:
        """Rename the snapshots newer than the confirmed one so that no run resumes from them
        (global rank 0 alone)."""

    def tidy(self) -> None:
        """The run has ended: what was kept only for a divergence to go back to goes (rank 0)."""

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, info: Snapshot, is_main: bool) -> None:
        """Take a snapshot now; every rank calls it."""

    def capture(self, model: nn.Module, optimizer: torch.optim.Optimizer, info: Snapshot, is_main: bool,
                copy: Callable[[Any], Any]) -> Callable[[], None]:
        """The part of a save every rank takes now (the state passed through copy, a staging copy);
        returns the write, to run now or in the background."""

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_config: dict[str, Any],
                vocab: list[str], tokenizer: str = "") -> tuple[Optional[Snapshot], Optional[str]]:
        """Load the newest snapshot, if any, into this rank's model and optimizer: its info and path.
        A snapshot path whose newest snapshot is of the other format is refused (check_format)."""

    def location(self, step: int) -> str:
        """Where the snapshot of step is, written or restored (what a line names)."""


class FullStateStore:
    """The single-file snapshots of one run (`snapshot_format=single`): one file, or a folder
    keeping the newest few. Each holds the full state, gathered to global rank 0, which writes it."""

    def __init__(self, path: str, keep_last: int = 1):
        self.path = path
        self.keep_last = keep_last
        self.is_folder = is_folder(path)
        self.confirmed: Optional[int] = None
        """The step of the newest snapshot healthy steps followed (confirm)."""
        self.newest: Optional[int] = None
        """The step of the snapshot at path (a single file), as this run wrote or read it."""
        self._last_good: Optional[int] = None
        """The step of the copy at last_good_path (a single file), kept by this run."""
        self._restored: tuple[Optional[int], str] = (None, "")
        """The step and path of the snapshot this run resumed from."""

    @property
    def last_good_path(self) -> str:
        """Beside a single file: the newest snapshot healthy steps followed, while the file at path is
        newer (`gpt_snapshot.last_good.pt`)."""
        return beside(self.path, "last_good")

    def confirm(self, step: int) -> None:
        self.confirmed = step

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
        keep_the_good_one = self.newest is not None and self.newest == self.confirmed
        self.newest = snapshot.step
        return lambda: self._write(snapshot, keep_the_good_one)

    def _write(self, snapshot: Snapshot, keep_the_good_one: bool) -> None:
        """Write the snapshot. A single file it replaces is first kept as last_good_path when healthy
        steps followed it; in a folder, all but the newest keep_last and the confirmed one go."""
        if self.is_folder:
            write_snapshot(snapshot, self._entry(snapshot.step))
            files.keep_newest(list_entries(self.path), self.keep_last, also=self._entry(self.confirmed))
            return
        if keep_the_good_one:
            try:
                files.keep_a_copy(self.path, self.last_good_path)
            except Exception as e:
                raise write_error(self.last_good_path, e) from None
            self._last_good = self.confirmed
        write_snapshot(snapshot, self.path)

    def tidy(self) -> None:
        if self.is_folder:
            files.keep_newest(list_entries(self.path), self.keep_last)
        elif self._last_good is not None:
            with contextlib.suppress(FileNotFoundError):
                files.remove(self.last_good_path)
            self._last_good = None

    def _entry(self, step: Optional[int]) -> Optional[str]:
        return f"{self.folder}/snapshot_{step:09d}.pt" if step is not None else None

    def location(self, step: int) -> str:
        if self._restored[0] == step:
            return self._restored[1]
        return self._entry(step) if self.is_folder else self.path

    def set_aside(self) -> SetAside:
        if self.is_folder:
            return set_aside_entries(list_entries(self.path), FOLDER_ENTRY, self.confirmed,
                                     lambda entry: f"{self.folder}/diverged_{step_of(entry):09d}.pt",
                                     lambda: list_entries(self.path))
        if self.newest is None or self.newest == self.confirmed:
            return SetAside([], self.path if self.newest is not None else None)
        diverged = beside(self.path, "diverged")
        files.keep_a_copy(self.path, diverged)
        if self.confirmed is not None and self._last_good == self.confirmed:
            files.move(self.last_good_path, self.path)  # replaces the diverged one in one rename
            self.newest, self._last_good = self.confirmed, None
            return SetAside([diverged], self.path)
        files.remove(self.path)
        self.newest = None
        return SetAside([diverged], None)

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_config: dict[str, Any],
                vocab: list[str], tokenizer: str = "") -> tuple[Optional[Snapshot], Optional[str]]:
        """Load the newest snapshot, if any, into this rank's model and optimizer."""
        if self.is_folder:  # a folder may hold the other format's (sharded_<step>/) instead
            check_format(self.path, "single", list_entries(self.path), sharded_entries(self.path))
        snapshot, path = newest_snapshot(self.path)
        if snapshot is None:
            return None, None
        self.newest = snapshot.step
        snapshot = repadded(snapshot, model_config)
        snapshot.check_matches(model_config, vocab, path, tokenizer)
        snapshot.check_optimizer(optimizer.param_groups, path)
        self._restored = (snapshot.step, path)
        try:
            check_tensors_fit(unwrap(model), snapshot)
            restore_full_state(model, optimizer, snapshot.model_state, snapshot.optimizer_state)
        except (RuntimeError, KeyError, ValueError) as e:
            raise SnapshotError(f"snapshot {path} does not fit this model and optimizer ({short_reason(e)}); "
                                "set trainer_config.snapshot_path to a new location") from None
        return snapshot, path


def check_format(folder: str, snapshot_format: str, ours: list[str], theirs: list[str]) -> None:
    """Refuse a snapshot folder whose newest snapshot is of the other format, in one line naming the
    key, rather than ignore it: the run would start from an older snapshot of its own format, or from
    scratch, and write its own beside it. ours, theirs: complete entries of each format, oldest first."""
    other = "sharded" if snapshot_format == "single" else "single"
    if not theirs:
        return
    newest = step_of(theirs[-1], _PATTERNS[other])
    if ours and step_of(ours[-1], _PATTERNS[snapshot_format]) >= newest:
        return  # its own is the newest: older snapshots of the other format are history
    raise SnapshotError(
        f"{FORMAT_KEY}: {folder} holds {other} snapshots, the newest {theirs[-1]} (step {newest}), and this "
        f"run reads and writes {snapshot_format} ones; set {FORMAT_KEY}={other} to resume from it, or set "
        f"{TRAINING_KEY} to another location")


def set_aside_entries(entries: list[str], pattern: re.Pattern, confirmed: Optional[int],
                      aside: Callable[[str], str], remaining: Callable[[], list[str]],
                      move: Optional[Callable[[str], None]] = None) -> SetAside:
    """A folder's snapshot entries newer than the confirmed step set aside (renamed to aside(entry),
    or by move); the newest left is the one a resume picks."""
    newer = [entry for entry in entries if confirmed is None or step_of(entry, pattern) > confirmed]
    moved = []
    for entry in newer:
        (move or (lambda e: files.move(e, aside(e))))(entry)
        moved.append(aside(entry))
    left = remaining()
    return SetAside(moved, left[-1] if left else None)
