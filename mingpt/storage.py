"""Where files go: local paths and fsspec URLs (s3://, gs://, memory://, ...) through one facade."""
import posixpath
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

from errors import MinGPTError


def short_reason(error: Exception) -> str:
    """`Type: first line` of an exception, for one-line messages."""
    text = str(error).strip()
    first_line = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first_line[:160]}"


def make_folder(fs: fsspec.AbstractFileSystem, folder: str) -> None:
    """Create a local folder. Object stores have no folders, and s3fs's makedirs would create a
    missing *bucket*: a typo in a bucket name must fail, not make a new bucket."""
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(folder, exist_ok=True)


def parent_folder(path: str) -> str:
    """The folder (or bucket prefix) a file path or URL lies in: `s3://b/run/x.pt` -> `s3://b/run`."""
    return posixpath.dirname(path.rstrip("/")) or "."


def check_writable(folder: str, key: str) -> None:
    """Fail at start-up, not after the first epoch, when folder cannot be written.

    Writes and removes an empty object in it, so unreachable endpoints, missing buckets, bad
    credentials and read-only disks all show before training starts.
    """
    fs, target = fsspec.core.url_to_fs(folder)
    probe = f"{target.rstrip('/')}/.write-test-{uuid.uuid4().hex[:8]}"
    try:
        make_folder(fs, target)
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except Exception as e:  # permissions, missing buckets, bad credentials: all the user's to fix
        raise MinGPTError(f"{key}: cannot write to {folder} ({short_reason(e)}); "
                          f"choose a writable location for {key}") from None
