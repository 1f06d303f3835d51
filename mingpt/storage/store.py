"""Where a training run keeps its snapshots: the interface every store offers the Checkpointer, and
the single-file store, which gathers the full state to one file (sharded_store.py writes shards).
"""
import contextlib
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Protocol, Sequence

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
    it, however many newer ones it writes, and can set the newer ones aside. The watch judges a step
    a step late, so the snapshot a store replaces (or prunes) may not be judged yet: `keep_pending`
    names those, and the store keeps them too, so that at any cadence (a snapshot every step, one
    file, keep_last=1) the newest snapshot healthy steps followed is still there once it is confirmed."""

    folder: str
    """Where snapshots (and the metrics beside them) live."""

    def confirm(self, step: int) -> None:
        """The snapshot of step was followed by healthy steps: keep it until a newer one is."""

    def keep_pending(self, steps: Sequence[int]) -> None:
        """The snapshots of these steps are not judged yet (healthy steps may follow them): keep
        them, besides the confirmed one, until they are (the steps still pending at each save)."""

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
    keeping the newest few. Each holds the full state, gathered to global rank 0, which writes it.

    Besides a single file, while it is newer than the snapshots the watch has judged, up to two
    copies: the newest snapshot healthy steps followed (last_good_path) and the snapshot the file
    held before, not judged yet (previous_path); a folder keeps those two beyond keep_last."""

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
        self._previous: Optional[int] = None
        """The step of the copy at previous_path (a single file), kept by this run."""
        self.pending: frozenset[int] = frozenset()
        """Steps of snapshots not judged yet (keep_pending)."""
        self._restored: tuple[Optional[int], str] = (None, "")
        """The step and path of the snapshot this run resumed from."""

    @property
    def last_good_path(self) -> str:
        """Beside a single file: the newest snapshot healthy steps followed, while the file at path is
        newer (`gpt_snapshot.last_good.pt`)."""
        return beside(self.path, "last_good")

    @property
    def previous_path(self) -> str:
        """Beside a single file: the snapshot it held before, while the watch has not judged the steps
        after it (`gpt_snapshot.previous.pt`)."""
        return beside(self.path, "previous")

    def confirm(self, step: int) -> None:
        self.confirmed = step

    def keep_pending(self, steps: Sequence[int]) -> None:
        self.pending = frozenset(steps)

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
        if self.is_folder:
            kept = {self._entry(step) for step in self._protected()}
            return lambda: self._write_entry(snapshot, kept)
        moves = self._keeping(snapshot.step)  # decided now: a background write runs them later
        self.newest = snapshot.step
        return lambda: self._write(snapshot, moves)

    def _protected(self) -> set[int]:
        """Steps whose snapshots outlive keep_last: the confirmed one and those not judged yet."""
        return set(self.pending) | ({self.confirmed} if self.confirmed is not None else set())

    def _write_entry(self, snapshot: Snapshot, kept: set[str]) -> None:
        """A folder: the new entry, then all but the newest keep_last go, save those kept."""
        write_snapshot(snapshot, self._entry(snapshot.step))
        prune(list_entries(self.path), self.keep_last, kept)

    def _keeping(self, step: int) -> list[tuple[str, str, str]]:
        """A single file about to be replaced by the snapshot of step: what to keep of it and of its
        copies, as (operation, from, to) in order, the bookkeeping done at once. The confirmed
        snapshot stays (the file's own as last_good_path; a previous copy confirmed since becomes
        last_good_path); the file's snapshot not judged yet becomes the previous copy; a copy that
        neither is goes."""
        moves, old = [], self.newest
        if self._previous is not None and self._previous == self.confirmed:
            moves.append(("move", self.previous_path, self.last_good_path))
            self._last_good, self._previous = self._previous, None
        if old is None or old == step:
            return moves  # nothing there, or the same weights rewritten (an epoch's end after its step)
        if old == self.confirmed:
            moves.append(("copy", self.path, self.last_good_path))
            self._last_good = old
        elif old in self.pending:
            moves.append(("copy", self.path, self.previous_path))
            self._previous = old
            return moves
        if self._previous is not None:  # neither confirmed nor pending: ruled out, or superseded
            moves.append(("remove", self.previous_path, ""))
            self._previous = None
        return moves

    def _write(self, snapshot: Snapshot, moves: list[tuple[str, str, str]]) -> None:
        """Keep what the file held as decided (_keeping), then write the snapshot over it."""
        for operation, source, target in moves:
            try:
                if operation == "move":
                    files.move(source, target)
                elif operation == "copy":
                    files.keep_a_copy(source, target)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        files.remove(source)
            except Exception as e:
                raise write_error(target or source, e) from None
        write_snapshot(snapshot, self.path)

    def tidy(self) -> None:
        if self.is_folder:
            prune(list_entries(self.path), self.keep_last)
            return
        for kept, path in ((self._last_good, self.last_good_path), (self._previous, self.previous_path)):
            if kept is not None:
                with contextlib.suppress(FileNotFoundError):
                    files.remove(path)
        self._last_good = self._previous = None

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
            self._drop_previous()
            return SetAside([], self.path if self.newest is not None else None)
        diverged = beside(self.path, "diverged")
        files.keep_a_copy(self.path, diverged)
        copies = {self._last_good: self.last_good_path, self._previous: self.previous_path}
        good = copies.get(self.confirmed) if self.confirmed is not None else None
        if good is None:
            files.remove(self.path)
            self.newest = None
        else:
            files.move(good, self.path)  # replaces the diverged one in one rename
            self.newest = self.confirmed
            if good == self.last_good_path:
                self._last_good = None
            else:
                self._previous = None
        self._drop_previous()
        return SetAside([diverged], self.path if good is not None else None)

    def _drop_previous(self) -> None:
        """The previous copy, once the snapshot to resume from is settled: never confirmed, it was
        written inside the divergence or before the confirmed one (the diverged newest is kept)."""
        if self._previous is not None:
            with contextlib.suppress(FileNotFoundError):
                files.remove(self.previous_path)
            self._previous = None

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


def prune(entries: list[str], keep_last: int, kept: set[str] = frozenset()) -> None:
    """Remove all but the last keep_last of a folder's entries (oldest first, files or folders), save
    those in kept (the confirmed snapshot, and those not judged yet)."""
    for old in entries[:-keep_last]:
        if old not in kept:
            files.remove(old, recursive=True)


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
