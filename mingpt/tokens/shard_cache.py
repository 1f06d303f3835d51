"""Remote shards (s3://, gs://, any fsspec URL) fetched whole into a bounded cache on this machine.

A set of shards behind an object store is neither read through the store window by window (a
request of milliseconds per window, thousands per step) nor copied whole before training (hours for
100 GB, and a disk to hold it). Training reads a set a few shards at a time (data_config.
shards_at_once, permutation.BlockOrder), so each shard is fetched whole, once, just before its group
starts: as a group starts, the sampler asks for its shards and the next group's (ShardStream.
read_ahead), a thread of the training process fetches them in that order, and the DataLoader's
workers map a shard's local copy when they first read it, waiting for its fetch only when it is not
there yet (the first group, or a store slower than training).

The cache is shared by the processes of a machine: a copy is named by its URL and version (ETag or
modification time), fetched by the first process to ask (a lock per copy: the others wait and find it
made) and written atomically, one fetch at a time. data_config.shard_cache_gb bounds it: before a
fetch, the least recently used copies are deleted until the new one fits. A process keeps at most as many copies
mapped as the cache holds, so that a deleted copy's disk space comes back.
"""
import contextlib
import hashlib
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from mingpt.common import files
from mingpt.common.errors import DataError, short_reason

FOLDER = "shards"
"""The cache folder's subfolder for copies of remote shards."""
HEADER_READERS = 16
"""Remote headers read at once at start-up (a set of 1,000 shards: 1,000 small requests)."""


def copy_name(url: str, version: str) -> str:
    """A copy's file name: the shard's own, after a digest of where it is and which version it is."""
    digest = hashlib.sha256(f"{url}\n{version}".encode()).hexdigest()[:16]
    return f"{digest}-{url.rstrip('/').rsplit('/', 1)[-1]}"


class ShardCache:
    """The copies of remote shards on this machine, at most `capacity_bytes` of them."""

    def __init__(self, folder: Path, capacity_bytes: int, key: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.capacity_bytes = capacity_bytes
        self.key = key
        """The config key the shards came from, for errors."""
        self._ahead: Optional[ThreadPoolExecutor] = None
        self._ahead_lock = threading.Lock()

    def copy_of(self, url: str, size: int, local: Path) -> Path:
        """The local copy of a remote shard, fetched now if it is not here (once per machine)."""
        if not local.exists():
            with files.locked(local):
                if not local.exists():  # another process may have made it while this one waited
                    # One fetch at a time on this machine: two making room at once (the fetch-ahead
                    # thread and a read that could not wait, or two processes) would each count only
                    # the copies already made, and together pass the bound (seen under load).
                    with files.locked(self.folder / ".fetching"):
                        self._make_room(size, keep=local)
                        self._fetch(url, local)
        with contextlib.suppress(OSError):
            os.utime(local)  # recently used: evicted last
        return local

    def fetch_ahead(self, shards: list[tuple[str, int, Path]]) -> None:
        """Fetch these (url, size, local copy) in the background, in order; a failure is left to the
        read that needs the shard, which fetches it again and says why."""
        with self._ahead_lock:
            if self._ahead is None:
                self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-fetch")
        for url, size, local in shards:
            self._ahead.submit(self._quietly, lambda u=url, s=size, p=local: self.copy_of(u, s, p))

    def __getstate__(self) -> dict:
        """Pickled into a DataLoader worker (spawned) without the fetching thread: workers only read."""
        return {name: value for name, value in vars(self).items() if name not in ("_ahead", "_ahead_lock")}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._ahead, self._ahead_lock = None, threading.Lock()

    @staticmethod
    def _quietly(fetch: Callable[[], Path]) -> None:
        with contextlib.suppress(Exception):
            fetch()

    def _fetch(self, url: str, local: Path) -> None:
        temporary = local.with_name(f".{local.name}.{os.getpid()}.part")
        try:
            files.download(url, temporary)
            os.replace(temporary, local)
        except Exception as error:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise DataError(f"{self.key}: cannot fetch {url} into {self.folder} ({short_reason(error)}); "
                            "check the store, the shard and your credentials (or the cache's free disk: "
                            "data_config.cache_dir)") from None

    def _make_room(self, size: int, keep: Path) -> None:
        """Delete the least recently used copies until `size` more bytes fit."""
        copies = [path for path in self.folder.glob("*") if path.is_file() and not path.name.startswith(".")
                  and not path.name.endswith(".lock") and path != keep]
        stats = {path: path.stat() for path in copies}
        used = sum(stat.st_size for stat in stats.values())
        for path in sorted(copies, key=lambda p: stats[p].st_mtime):
            if used + size <= self.capacity_bytes:
                break
            with contextlib.suppress(OSError):
                path.unlink()
                used -= stats[path].st_size


def open_remote_headers(urls: list[str], read_one: Callable[[str], object]) -> list:
    """read_one(url) for each URL, HEADER_READERS at a time, in the URLs' order."""
    with ThreadPoolExecutor(max_workers=HEADER_READERS) as pool:
        return list(pool.map(read_one, urls))


class MappedCopies:
    """A process's maps of remote shards' copies: at most `most` at once, the least recently read
    dropped first (its copy may since have been evicted: its disk space then comes back)."""

    def __init__(self, most: int):
        self.most = max(most, 1)
        self._maps: OrderedDict[int, np.memmap] = OrderedDict()

    def get(self, index: int, open_map: Callable[[], np.memmap]) -> np.memmap:
        if index in self._maps:
            self._maps.move_to_end(index)
            return self._maps[index]
        while len(self._maps) >= self.most:
            self._maps.popitem(last=False)
        self._maps[index] = open_map()
        return self._maps[index]
