"""Where files go: local paths and fsspec URLs (s3://, gs://, memory://, ...) through one door.

The only module of the project that imports fsspec. Everything else names a file by its path or URL
and calls the functions below, which answer "is this remote?" one way, treat local files alike
everywhere (folders made, fsync before rename, appends in place) and raise the filesystem's own
exceptions: the caller knows which config key to name in its one-line error.
"""
import contextlib
import fcntl
import os
import posixpath
import re
import uuid
from pathlib import Path
from typing import IO, Callable, Iterator, Optional

import fsspec
from fsspec.implementations.local import LocalFileSystem

from mingpt.common.errors import MinGPTError, short_reason

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


def _make_folder(fs: fsspec.AbstractFileSystem, folder: str) -> None:
    """Create a local folder. Object stores have no folders, and s3fs's makedirs would create a
    missing *bucket*: a typo in a bucket name must fail, not make a new bucket."""
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(folder, exist_ok=True)


def exists(url: str) -> bool:
    fs, path = _resolve(url)
    return fs.exists(path)


def is_file(url: str) -> bool:
    fs, path = _resolve(url)
    return fs.isfile(path)


def info(url: str) -> dict:
    """The filesystem's description of a file: size, and versions such as ETag or mtime."""
    fs, path = _resolve(url)
    return fs.info(path)


def glob(url: str) -> list[str]:
    """The files a glob names, as URLs of their filesystem, sorted."""
    fs, path = _resolve(url)
    return sorted(fs.unstrip_protocol(found) for found in fs.glob(path) if fs.isfile(found))


def read_range(url: str, start: int, end: int) -> bytes:
    """Bytes start..end of a file (fewer at its end), in one request."""
    fs, path = _resolve(url)
    return fs.cat_file(path, start=start, end=end)


def download(url: str, local: Path) -> None:
    """A remote file's bytes into a local file, streamed (never whole in memory)."""
    fs, path = _resolve(url)
    fs.get_file(path, str(local))


def read_bytes(url: str) -> bytes:
    """A whole file, in one request (much faster than a file object on an object store)."""
    fs, path = _resolve(url)
    return fs.cat_file(path)


def open_file(url: str, mode: str = "rb") -> fsspec.core.OpenFile:
    """A file to use in a `with` block: local, or streamed from or to any fsspec URL."""
    return fsspec.open(url, mode)


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
    try:
        _make_folder(fs, fs._parent(target))
        with fs.open(temporary, "wb") as f:
            write(f)
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


def move(url: str, target: str) -> None:
    """Rename a file to target, replacing it (on this machine at once; on object stores a copy, then
    the original deleted)."""
    fs, path = _resolve(url)
    fs.mv(path, _resolve(target)[1])


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
    """Hold an exclusive lock on `<path>.lock` (a local file): other processes of this machine that
    make path (a token file, a step trace) wait here, then find it made."""
    lock = f"{path}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    except Exception:  # nothing made (a refused source): nothing left beside it either
        with contextlib.suppress(OSError):
            os.unlink(lock)
        raise
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def try_locked(path: Path) -> Iterator[bool]:
    """locked(path) without the wait: yields True with the lock held, or False at once when another
    process holds it (the caller then moves on to other work, as the preparers of a set of texts do)."""
    lock = f"{path}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        except Exception:  # nothing made: nothing left beside it either
            with contextlib.suppress(OSError):
                os.unlink(lock)
            raise
    finally:
        os.close(fd)
