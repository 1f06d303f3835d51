"""Where files go: local paths and fsspec URLs (s3://, gs://, memory://, ...) through one door.

The only module of the project that imports fsspec. Everything else names a file by its path or URL
and calls the functions below, which answer "is this remote?" one way and treat local files alike
everywhere (folders made, fsync before rename, appends in place).

A file that is not there raises FileNotFoundError, which callers take for "none yet". Any other
failure of a store (a connection refused, a full disk, revoked credentials) is a StorageError: one
line naming the file and the cause, and an OSError, so a caller that names its config key in a line
of its own still can; nothing of a store's failure reaches the user as a traceback.

Every read and write under way is a Transfer that the process's watchdog can see: how much it has
moved, and since when it has not (distributed/watchdog.py names one that has stopped moving). Those
begun inside `part_of(...)` (a snapshot's save) say so, and are named before any other.
"""
import contextlib
import contextvars
import functools
import os
import posixpath
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional

import fsspec
from filelock import FileLock, Timeout
from fsspec.callbacks import Callback
from fsspec.implementations.local import LocalFileSystem

from mingpt.common.errors import MinGPTError, StorageError, short_reason

CACHE_DIR_ENV = "MINGPT_CACHE_DIR"
"""Overrides the cache folder: token files of remote or read-only sources, the CPU's measured peak."""


def is_remote(url: str) -> bool:
    """A URL of another filesystem than this machine's; `file://` names a local file."""
    return "://" in url and not url.startswith("file://")


def local_path(url: str) -> str:
    """A local file's path without `file://`."""
    return url[len("file://"):] if url.startswith("file://") else url


def parent_folder(path: str) -> str:
    """The folder (or bucket prefix) a file path or URL lies in: `s3://b/run/x.pt` -> `s3://b/run`."""
    return posixpath.dirname(path.rstrip("/")) or "."


def _resolve(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url)


@dataclass(eq=False)
class Transfer:
    """A read or write of one file under way in this process, on any thread."""

    verb: str
    """What is done to it: read, write, list, ..."""
    url: str
    done: int = 0
    """Bytes moved so far (where the store tells)."""
    moved_at: float = field(default_factory=time.monotonic)
    """When bytes last moved (or it started)."""
    temporary: Optional[str] = None
    """A local temporary file it writes, to remove if the process must end at once (abandon_transfers)."""
    part_of: Optional[str] = field(default_factory=lambda: _part_of.get())
    """What it is a part of ("saving the snapshot of step 20"), when begun inside part_of()."""

    def advance(self, count: int) -> None:
        self.done += count
        self.moved_at = time.monotonic()

    def describe(self, now: float) -> str:
        """'write of s3://b/snap.pt has not moved for 62 s (12.6 MB written; saving the snapshot of
        step 20)'."""
        details = [f"{self.done / 1e6:.1f} MB {'written' if self.verb == 'write' else 'moved'}"] if self.done else []
        details += [self.part_of] if self.part_of else []
        said = f" ({'; '.join(details)})" if details else ""
        return f"{self.verb} of {self.url} has not moved for {now - self.moved_at:.0f} s{said}"


_part_of: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("part_of", default=None)


@contextlib.contextmanager
def part_of(what: str) -> Iterator[None]:
    """The transfers begun inside, on this thread, are part of what ("saving the snapshot of step
    20"): when several stall at once (a store that stops answering stalls every one, a lease's read
    and a metrics upload with the save), the watchdog names one of these, and says what it was part of."""
    token = _part_of.set(what)
    try:
        yield
    finally:
        _part_of.reset(token)


_under_way: set[Transfer] = set()
_under_way_lock = threading.Lock()
STORE_LIBRARIES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "gcsfs", "adlfs", "urllib3",
                   "requests", "http")
"""Where a store's own exceptions come from (besides OSError): what a StorageError stands for."""


def abandon_transfers() -> None:
    """The process ends now, its writes unfinished: their local temporary files go (the files they
    would have replaced are as they were; an object store shows nothing of an unfinished upload)."""
    with _under_way_lock:
        temporaries = [transfer.temporary for transfer in _under_way if transfer.temporary]
    for temporary in temporaries:
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def stalled_transfer(after_s: float) -> Optional[Transfer]:
    """A transfer under way in this process that has not moved for over after_s, if any: one begun
    inside part_of() first (a save, rather than a lease's refresh or a metrics upload that stalled
    with it), the one that has not moved for longest among them."""
    limit = time.monotonic() - after_s
    with _under_way_lock:
        stalled = [transfer for transfer in _under_way if transfer.moved_at < limit]
    return min(stalled, key=lambda transfer: (transfer.part_of is None, transfer.moved_at), default=None)


@contextlib.contextmanager
def transfer(verb: str, url: str) -> Iterator[Transfer]:
    """A transfer under way while inside; a store's failure in it raised as one StorageError."""
    under_way = Transfer(verb, url)
    with _under_way_lock:
        _under_way.add(under_way)
    try:
        yield under_way
    except (FileNotFoundError, MinGPTError):
        raise
    except Exception as error:
        if not _from_a_store(error):
            raise  # a bug of the caller's, with its traceback
        raise StorageError(verb, url, error) from None
    finally:
        with _under_way_lock:
            _under_way.discard(under_way)


def _from_a_store(error: BaseException) -> bool:
    return isinstance(error, OSError) or type(error).__module__.split(".")[0] in STORE_LIBRARIES


def _one_transfer(verb: str) -> Callable:
    """The function, whose first argument is a file's URL, as one transfer of it."""
    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def in_transfer(url: str, *args, **kwargs) -> Any:
            with transfer(verb, url):
                return function(url, *args, **kwargs)
        return in_transfer
    return decorate


WRITE_PIECE = 8 << 20
"""A large write goes to the file in pieces of this many bytes, so that its transfer moves as each
lands (an object store uploads a part inside a write that fills its buffer)."""


class _Counted:
    """A file being written, whose written bytes move its transfer."""

    def __init__(self, file: IO[bytes], under_way: Transfer):
        self._file, self._under_way = file, under_way

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), WRITE_PIECE):
            piece = view[start:start + WRITE_PIECE]
            self._file.write(piece)
            self._under_way.advance(len(piece))
        return len(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def counted(file: IO[bytes], under_way: Transfer) -> IO[bytes]:
    """file, whose written bytes move under_way (for a writer that opens its files itself: DCP's)."""
    return _Counted(file, under_way)


class _Progress(Callback):
    """fsspec's progress callback, moving a transfer as a download goes."""

    def __init__(self, under_way: Transfer):
        super().__init__()
        self._under_way = under_way

    def relative_update(self, inc: int = 1) -> None:
        super().relative_update(inc)
        self._under_way.advance(inc)


def _make_folder(fs: fsspec.AbstractFileSystem, folder: str) -> None:
    """Create a local folder. Object stores have no folders, and s3fs's makedirs would create a
    missing *bucket*: a typo in a bucket name must fail, not make a new bucket."""
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(folder, exist_ok=True)


@_one_transfer("look for")
def exists(url: str) -> bool:
    fs, path = _resolve(url)
    return fs.exists(path)


@_one_transfer("look for")
def is_file(url: str) -> bool:
    fs, path = _resolve(url)
    return fs.isfile(path)


@_one_transfer("look up")
def info(url: str) -> dict:
    """The filesystem's description of a file: size, and versions such as ETag or mtime."""
    fs, path = _resolve(url)
    return fs.info(path)


@_one_transfer("list")
def glob(url: str) -> list[str]:
    """The files a glob names, as URLs of their filesystem, sorted."""
    fs, path = _resolve(url)
    return sorted(fs.unstrip_protocol(found) for found in fs.glob(path) if fs.isfile(found))


@_one_transfer("read")
def read_range(url: str, start: int, end: int) -> bytes:
    """Bytes start..end of a file (fewer at its end), in one request."""
    fs, path = _resolve(url)
    return fs.cat_file(path, start=start, end=end)


def download(url: str, local: Path) -> None:
    """A remote file's bytes into a local file, streamed (never whole in memory)."""
    fs, path = _resolve(url)
    with transfer("read", url) as under_way:
        fs.get_file(path, str(local), callback=_Progress(under_way))


@_one_transfer("read")
def read_bytes(url: str) -> bytes:
    """A whole file, in one request (much faster than a file object on an object store)."""
    fs, path = _resolve(url)
    return fs.cat_file(path)


def open_file(url: str, mode: str = "rb") -> fsspec.core.OpenFile:
    """A file to use in a `with` block: local, or streamed from or to any fsspec URL."""
    return fsspec.open(url, mode)


@_one_transfer("append to")
def append_text(url: str, text: str) -> None:
    """Append to a local file in place (an object store cannot append: metrics.py keeps a local
    copy of a remote file and uploads it whole now and then)."""
    fs, path = _resolve(url)
    if not isinstance(fs, LocalFileSystem):
        raise ValueError(f"cannot append to {url}: not on this machine")
    _make_folder(fs, fs._parent(path))
    with open(path, "a") as f:
        f.write(text)


def write_atomically(url: str, write: Callable[[IO[bytes]], None]) -> None:
    """Call write on a temporary file beside url, then rename it to url: readers see the old file
    or the complete new one, never part of it. On any failure, a second Ctrl-C included, the
    temporary is removed and the old file is as it was."""
    fs, target = _resolve(url)
    temporary = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
    with transfer("write", url) as under_way:
        if isinstance(fs, LocalFileSystem):
            under_way.temporary = temporary
        try:
            _make_folder(fs, fs._parent(target))
            with fs.open(temporary, "wb") as f:
                write(_Counted(f, under_way))
                if isinstance(fs, LocalFileSystem):
                    f.flush()
                    os.fsync(f.fileno())  # the rename below must not expose unwritten blocks
            fs.mv(temporary, target)  # on object stores: copied, then the temporary deleted
        except BaseException:
            _remove_quietly(fs, temporary)
            raise


def _remove_quietly(fs: fsspec.AbstractFileSystem, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm(path)
    except Exception:  # the original error is the one to report
        pass


@_one_transfer("remove")
def remove(url: str, recursive: bool = False) -> None:
    fs, path = _resolve(url)
    fs.rm(path, recursive=recursive)


def numbered_entries(folder_url: str, pattern: re.Pattern,
                     complete: Callable[[str], bool] = lambda url: True) -> list[str]:
    """URLs of the folder's complete entries whose names match pattern (group 1: a number, such as
    a step), in increasing order; none when the folder does not exist (yet).

    Listed in one call: `exists` then `ls` would race with rank 0's write probe, which makes an
    object store's "folder" (a key prefix) exist for a moment and then vanish again.
    """
    fs, folder = _resolve(folder_url.rstrip("/"))
    try:
        with transfer("list", folder_url):
            names = [name.rstrip("/") for name in fs.ls(folder, detail=False)]
    except FileNotFoundError:
        return []
    prefix = folder_url.split("://")[0] + "://" if "://" in folder_url else ""
    numbered = sorted((int(m.group(1)), prefix + name) for name in names if (m := pattern.search(name)))
    return [url for _, url in numbered if complete(url)]


def keep_newest(entries: list[str], keep_last: int, also: Optional[str] = None) -> None:
    """Remove all but the last keep_last of entries (oldest first), files or folders, and `also`."""
    for old in entries[:-keep_last]:
        if old != also:
            remove(old, recursive=True)


@_one_transfer("move")
def move(url: str, target: str) -> None:
    """Rename a file to target, replacing it (on this machine at once; on object stores a copy, then
    the original deleted)."""
    fs, path = _resolve(url)
    fs.mv(path, _resolve(target)[1])


@_one_transfer("copy")
def keep_a_copy(url: str, target: str) -> None:
    """target becomes a copy of url, which stays: on this machine a second name for the same file (no
    bytes copied; replacing url later leaves target as it was), on object stores a copy made there."""
    fs, path = _resolve(url)
    copy = _resolve(target)[1]
    if isinstance(fs, LocalFileSystem):
        temporary = f"{copy}.tmp-{uuid.uuid4().hex[:8]}"
        os.link(path, temporary)
        os.replace(temporary, copy)
    else:
        fs.copy(path, copy)


def check_writable(folder: str, key: str) -> None:
    """Fail at start-up, not after the first epoch, when folder cannot be written.

    Writes and removes an empty object in it, so unreachable endpoints, missing buckets, bad
    credentials and read-only disks all show before training starts.
    """
    fs, target = _resolve(folder)
    probe = f"{target.rstrip('/')}/.write-test-{uuid.uuid4().hex[:8]}"
    try:
        _make_folder(fs, target)
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except Exception as e:  # permissions, missing buckets, bad credentials: all the user's to fix
        raise MinGPTError(f"{key}: cannot write to {folder} ({short_reason(e)}); "
                          f"choose a writable location for {key}") from None


def cache_folder(cache_dir: Optional[str]) -> Path:
    """Where token files of remote (or read-only) sources go; created when missing."""
    folder = Path(cache_dir or os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "mingpt-ddp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MinGPTError(f"cannot create the token cache folder {folder} ({e}); "
                        f"set {CACHE_DIR_ENV} to a writable folder on the local disk") from None
    return folder


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `<path>.lock` (a local file; filelock's FileLock, an flock where the
    filesystem has one): other processes of this machine that make path (a token file, a step trace)
    wait here, then find it made."""
    lock = FileLock(f"{path}.lock")
    with lock:
        with _gone_on_failure(lock):
            yield


@contextlib.contextmanager
def try_locked(path: Path) -> Iterator[bool]:
    """locked(path) without the wait: yields True with the lock held, or False at once when another
    process holds it (the caller then moves on to other work, as the preparers of a set of texts do)."""
    lock = FileLock(f"{path}.lock", blocking=False)
    try:
        lock.acquire()
    except Timeout:
        yield False
        return
    try:
        with _gone_on_failure(lock):
            yield True
    finally:
        lock.release()


@contextlib.contextmanager
def _gone_on_failure(lock: FileLock) -> Iterator[None]:
    """Nothing made (a refused source): no lock file left beside it either. A process waiting for the
    lock meanwhile is not fooled: filelock takes a lock file only while it is still in its folder."""
    try:
        yield
    except Exception:
        with contextlib.suppress(OSError):
            os.unlink(lock.lock_file)
        raise
