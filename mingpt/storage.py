"""Where files go: local paths and fsspec URLs (s3://, gs://, memory://, ...) through one facade."""
import uuid

import fsspec

from errors import MinGPTError


def short_reason(error: Exception) -> str:
    """`Type: first line` of an exception, for one-line messages."""
    text = str(error).strip()
    first_line = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first_line[:160]}"


def check_writable(path: str, key: str) -> None:
    """Fail at start-up, not after the first epoch, when path's folder cannot be written.

    Writes and removes an empty object beside path; never touches path itself.
    """
    fs, target = fsspec.core.url_to_fs(path)
    probe = f"{target}.write-test-{uuid.uuid4().hex[:8]}"
    try:
        parent = fs._parent(target)
        if parent:
            fs.makedirs(parent, exist_ok=True)
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except Exception as e:  # permissions, missing buckets, bad credentials: all the user's to fix
        raise MinGPTError(f"{key}: cannot write to {path} ({short_reason(e)}); "
                          f"choose a writable location for {key}") from None
