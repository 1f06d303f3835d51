"""Sharded snapshots (`trainer_config.snapshot_format=sharded`) for models too large to gather.

Every rank writes its own shard of the model and optimizer state with torch.distributed.checkpoint
(DCP) into a folder per save, `<snapshot_path>/sharded_<step>/`, local or any fsspec URL. Global
rank 0 writes `info.pt` (progress, RNG states, vocabulary and tokenizer, model config) last: a
folder without it is an interrupted save and is ignored. The newest `keep_last` folders are kept.
DCP reshards on load, so a sharded snapshot resumes at any world size and with either method.

Loading stays tensors-only: DCP's `.metadata` is a pickle, so it is read with an unpickler that
accepts only DCP's own metadata classes and refuses any entry that is not a tensor.

Convert to the single-file format (no process group needed):

    python mingpt/convert_snapshot.py SHARDED_FOLDER OUT.pt
"""
import contextlib
import io
import logging
import pickle
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter, StorageWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from mingpt.common import files
from mingpt.common.errors import MinGPTError, SnapshotError, short_reason
from mingpt.distributed.parallel import restore_optimizer_state
from mingpt.distributed.process_group import first_said
from mingpt.storage.snapshot import (
    DIVERGED_INFO,
    SHARDED_ENTRY,
    SHARDED_INFO,
    Snapshot,
    list_entries,
    read_snapshot,
    sharded_entries,
    write_error,
    write_snapshot,
)
from mingpt.storage.store import SetAside, check_format, prune, set_aside_entries

DCP_ERRORS = (Exception, CheckpointException)  # DCP gathers ranks' errors into a BaseException
_SAFE_MODULES = ("torch.distributed.checkpoint.",)
_SAFE_NAMES = {
    ("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"), ("builtins", "frozenset"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch", "device"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: no function of any other module can be reached."""

    def find_class(self, module: str, name: str):
        allowed = (module.startswith(_SAFE_MODULES) or (module, name) in _SAFE_NAMES
                   or (module == "torch" and isinstance(getattr(torch, name, None),
                                                        (torch.dtype, torch.layout, torch.memory_format))))
        if not allowed:
            raise pickle.UnpicklingError(f"refusing {module}.{name} in a snapshot's metadata")
        return super().find_class(module, name)


class SafeReader(FsspecReader):
    """DCP's fsspec reader with a restricted unpickler for `.metadata`, and tensors only."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(io.BytesIO(stream.read())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError("not DCP metadata")
        if any(isinstance(entry, BytesStorageMetadata) for entry in metadata.state_dict_metadata.values()):
            raise pickle.UnpicklingError("a sharded snapshot holds tensors only")  # bytes load unsafely
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _reason(error: BaseException) -> str:
    """The first rank's own error inside DCP's CheckpointException, in one line."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))
        if isinstance(error, tuple):  # (the exception, its traceback), as DCP wraps a rank's failure
            error = error[0]
    return short_reason(error)


@contextlib.contextmanager
def _quiet_dcp():
    """DCP logs a failed read with tracebacks through the *root* logger, on every rank; the user
    gets one SnapshotError line instead."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


@contextlib.contextmanager
def _write_errors_reported(target: str):
    """A failed write (DCP's, or pruning an old folder) as one SnapshotError line."""
    try:
        yield
    except MinGPTError:
        raise
    except DCP_ERRORS as e:
        raise write_error(target, e, _reason) from None


class WatchedFileSystem:
    """DCP's file system layer (its local FileSystem, or the fsspec one), every call it makes to the
    store a transfer the watchdog sees (common/files.py), its failures StorageErrors: the streams it
    writes from their opening to their closing (an object store uploads a small file when it is
    closed, and opening a file on a stale mount is what hangs), and its renames (.metadata's: on S3 a
    copy and a delete), folders, existence checks, removals and listings. Only watching the bytes of
    its streams left a store that froze in any other call unnamed until some other transfer (a
    lease's refresh) stalled too, minutes later and naming that."""

    VERBS = {"rename": "move", "mkdir": "create", "exists": "look for", "rm_file": "remove", "ls": "list"}

    def __init__(self, fs: Any):
        self._fs = fs

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[Any]:
        writes = any(kind in mode for kind in "wa+")
        with files.transfer("write" if writes else "read", str(path)) as under_way:
            with self._fs.create_stream(path, mode) as stream:
                yield files.counted(stream, under_way) if writes else stream

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._fs, name)
        verb = self.VERBS.get(name)
        if verb is None:
            return attribute  # no call to the store (concat_path, init_path, ...)

        def watched(path, *args, **kwargs):
            with files.transfer(verb, str(path)):
                return attribute(path, *args, **kwargs)
        return watched


def _watched_writer(target: str) -> StorageWriter:
    """DCP's writer for target (local, or any fsspec URL), each call it makes to the store a transfer
    the watchdog sees (WatchedFileSystem)."""
    writer = FsspecWriter(target) if files.is_remote(target) else FileSystemWriter(target)
    writer.fs = WatchedFileSystem(writer.fs)
    return writer


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    """This rank's tensors (DTensor shards under FSDP, whole tensors under DDP) by parameter name,
    and the optimizer's param_groups (plain values, kept in info.pt: DCP would pickle them)."""
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    tensors = {"model": get_model_state_dict(model), "optimizer": optimizer_state["state"]}
    return tensors, optimizer_state["param_groups"]


def rank_share(state: dict, rank: int, world_size: int) -> dict:
    """The part of a (nested) state dict that rank writes: its shards (DTensors), and its share of the
    whole tensors every rank holds alike (all of them under DDP; the step counts under FSDP), dealt
    out largest first to the rank with the fewest bytes so far, the same on every rank. DCP would
    write each of those once anyway (its planner drops the duplicates), but only after every rank
    had staged a copy of all of them; loading reads them from wherever they were written."""
    whole = sorted(((path, tensor) for path, tensor in _leaves(state) if not hasattr(tensor, "to_local")),
                   key=lambda item: (-item[1].numel() * item[1].element_size(), item[0]))
    load = [0] * world_size
    others = set()
    for path, tensor in whole:
        writer = load.index(min(load))
        load[writer] += tensor.numel() * tensor.element_size()
        if writer != rank:
            others.add(path)
    return _without(state, others)


def _leaves(state: dict, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value


def _without(state: dict, paths: set, path: tuple = ()) -> dict:
    """state less the leaves at paths, and less the dicts left empty (DCP would store one as bytes)."""
    kept = {}
    for key, value in state.items():
        if isinstance(value, dict):
            value = _without(value, paths, (*path, key))
            if value:
                kept[key] = value
        elif (*path, key) not in paths:
            kept[key] = value
    return kept


class ShardedSnapshotStore:
    """A folder of sharded snapshots (`snapshot_format=sharded`): a store.SnapshotStore."""

    def __init__(self, path: str, keep_last: int, process_group: Optional[dist.ProcessGroup] = None):
        self.path = path.rstrip("/")
        self.keep_last = keep_last
        self.folder = self.path
        self.process_group = process_group
        """The group DCP's planning collectives use; a background save needs one of its own (None:
        the default group, for saves in the training thread)."""
        self.confirmed: Optional[int] = None
        """The step of the newest snapshot healthy steps followed: never pruned (store.SnapshotStore)."""
        self.pending: frozenset[int] = frozenset()
        """Steps of snapshots not judged yet: never pruned either (keep_pending)."""
        self._shards_step: Optional[int] = None
        """The step whose shards this store last wrote or restored. A save at the same step (the
        epoch's snapshot right after a step snapshot) rewrites info.pt only: the shards would be
        the same, and rewriting them in place would leave a folder marked complete while they are
        half-written."""
        self._restored: tuple[Optional[int], str] = (None, "")
        """The step and folder of the snapshot this run resumed from."""

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, info: Snapshot, is_main: bool) -> None:
        """Every rank writes its shard; then rank 0 marks the folder complete and prunes old ones. No
        rank returns before the snapshot is complete, and when any rank's part failed (rank 0's
        info.pt alone, say) every rank raises its error instead of waiting for that rank for good."""
        error = None
        try:
            self.capture(model, optimizer, info, is_main)()
        except MinGPTError as failed:
            error = failed
        said = first_said(str(error) if error is not None else None)
        if said is not None:
            raise error or SnapshotError(said)

    def capture(self, model: nn.Module, optimizer: torch.optim.Optimizer, info: Snapshot, is_main: bool,
                copy: Callable[[Any], Any] = lambda state: state) -> Callable[[], None]:
        """The part of a save each rank takes now: what it writes (rank_share), passed through copy (a
        staging copy, for a background write). Returns the write, for every rank to run, now or in
        the background."""
        tensors, param_groups = _sharded_state(model, optimizer)
        target = f"{self.path}/sharded_{info.step:09d}"
        kept = {self._folder_of(step) for step in {self.confirmed, *self.pending} if step is not None}
        if info.step == self._shards_step:
            info_only = replace(info, optimizer_state={"param_groups": param_groups})
            return lambda: self._complete(target, info_only, is_main, kept)
        self._shards_step = info.step
        group = self.process_group
        share = rank_share(tensors, dist.get_rank(group), dist.get_world_size(group))
        tensors, param_groups = copy((share, param_groups))
        info_without_tensors = replace(info, optimizer_state={"param_groups": param_groups})
        return lambda: self._write(target, tensors, info_without_tensors, is_main, kept)

    def _write(self, target: str, tensors: dict, info: Snapshot, is_main: bool, kept: set[str]) -> None:
        """dcp.save on every rank. It returns on rank 0 only once every rank's shards are written
        (each rank's write result is gathered there before .metadata is written), so rank 0 can
        then write info.pt, which marks the folder complete."""
        with _write_errors_reported(target):
            dcp.save(tensors, storage_writer=_watched_writer(target), process_group=self.process_group)
        self._complete(target, info, is_main, kept)

    def _complete(self, target: str, info: Snapshot, is_main: bool, kept: set[str]) -> None:
        """Rank 0 writes info.pt (atomically: it replaces an older one whole) and prunes old folders,
        save those kept (the confirmed one's, and those not judged yet: decided when it was taken)."""
        if not is_main:
            return
        with _write_errors_reported(target):
            write_snapshot(info, f"{target}/{SHARDED_INFO}")
            prune(self._entries(), self.keep_last, kept)

    def _folder_of(self, step: Optional[int]) -> Optional[str]:
        return f"{self.path}/sharded_{step:09d}" if step is not None else None

    def location(self, step: int) -> str:
        return self._restored[1] if step == self._restored[0] else self._folder_of(step)

    def confirm(self, step: int) -> None:
        self.confirmed = step

    def keep_pending(self, steps: Sequence[int]) -> None:
        self.pending = frozenset(steps)

    def tidy(self) -> None:
        prune(self._entries(), self.keep_last)

    def set_aside(self) -> SetAside:
        """A folder newer than the confirmed one loses its info.pt (renamed DIVERGED_INFO): incomplete,
        no run resumes from it, and no large shard is moved."""
        return set_aside_entries(self._entries(), SHARDED_ENTRY, self.confirmed,
                                 lambda folder: f"{folder}/{DIVERGED_INFO}", self._entries,
                                 move=lambda folder: files.move(f"{folder}/{SHARDED_INFO}",
                                                                f"{folder}/{DIVERGED_INFO}"))

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_config: dict,
                vocab: list[str], tokenizer: str = "") -> tuple[Optional[Snapshot], Optional[str]]:
        """Load the newest complete snapshot into this rank's shards; return its info and path."""
        entries = self._entries()
        check_format(self.path, "sharded", entries, list_entries(self.path))
        if not entries:
            return None, None
        folder = entries[-1]
        info = read_snapshot(f"{folder}/{SHARDED_INFO}")
        info.check_matches(model_config, vocab, folder, tokenizer)
        info.check_optimizer(optimizer.param_groups, folder)
        tensors, _ = _sharded_state(model, optimizer)
        try:
            with _quiet_dcp():
                dcp.load(tensors, storage_reader=SafeReader(folder))
            set_model_state_dict(model, tensors["model"], options=StateDictOptions(strict=True))
            optimizer_state = {"state": tensors["optimizer"], **info.optimizer_state}
            restore_optimizer_state(model, optimizer, optimizer_state)
        except DCP_ERRORS as e:
            earlier = f" (the run then resumes from {entries[-2]})" if len(entries) > 1 else ""
            raise SnapshotError(f"sharded snapshot {folder} cannot be loaded ({_reason(e)}); move it away"
                                f"{earlier} or set trainer_config.snapshot_path to another location"
                                ) from None
        self._shards_step, self._restored = info.step, (info.step, folder)
        return info, folder

    def _entries(self) -> list[str]:
        """Complete snapshot folders (those with info.pt), oldest first."""
        return sharded_entries(self.path)


def to_single_file(sharded_folder: str, out_path: str) -> None:
    """Gather a sharded snapshot into one single-file snapshot, in this process alone."""
    write_snapshot(read_whole(sharded_folder), out_path)


def read_whole(sharded_folder: str) -> Snapshot:
    """A sharded snapshot with its full state, as a single-file snapshot holds it (this process alone)."""
    info = read_snapshot(f"{sharded_folder.rstrip('/')}/{SHARDED_INFO}")
    if info is None:
        raise SnapshotError(f"{sharded_folder} is not a complete sharded snapshot (no {SHARDED_INFO})")
    state: dict = {}
    try:
        # An empty state dict with this planner loads everything there is (as format_utils does).
        with _quiet_dcp():
            _load_state_dict(state, storage_reader=SafeReader(sharded_folder),
                             planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except DCP_ERRORS as e:
        raise SnapshotError(f"sharded snapshot {sharded_folder} cannot be loaded ({_reason(e)})") from None
    optimizer_state = {"state": state["optimizer"], **info.optimizer_state}
    return replace(info, model_state=state["model"], optimizer_state=optimizer_state)
