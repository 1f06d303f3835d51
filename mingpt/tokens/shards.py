"""Pre-tokenized shards: llm.c's and nanoGPT's files of token ids, read where they lie.

The field keeps large corpora already tokenized, in two formats:
- llm.c's (and modded-nanogpt's: FineWeb's `fineweb_train_000001.bin`): a header of 256 little-endian
  int32, header[0] the magic 20240520, header[1] the version (1: uint16 GPT-2 ids), header[2] the
  number of ids; the ids follow from byte 1,024. llm.c's dev/data/data_common.py documents one more
  kind, magic 20240801 version 7 with uint32 ids (LLaMA 3's); any other version is refused.
- nanoGPT's prepare.py (`train.bin`, `val.bin`): uint16 ids and nothing else.

Nothing is prepared: the files of a set are memory-mapped read-only, in sorted path order, and read as
one stream of ids (ShardStream). Both formats are continuous streams of documents separated by
<|endoftext|>, cut into files by size rather than at a document's end, so a window may straddle two
shards as it straddles two documents inside one. Start-up reads 1 KB per shard; memory does not grow
with the corpus (the pages read are the page cache's, shared by the ranks of a machine).

Ids beyond the vocabulary are looked for batch by batch as they are read (a max over the batch), and
in the whole of a small set when it is opened; never in the whole of a large one, whose start-up
would then take minutes.
"""
import contextlib
import glob
import json
import os
import resource
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from mingpt.common import files
from mingpt.common.errors import DataError, short_reason
from mingpt.tokens.shard_cache import MappedCopies, ShardCache, copy_name, open_remote_headers
from mingpt.tokens.token_file import read_header, remote_version

LLMC, NANOGPT = "llmc", "nanogpt"
SHARD_FORMATS = (LLMC, NANOGPT)
FORMAT_NAMES = {LLMC: "llm.c", NANOGPT: "nanoGPT"}
TEXT, AUTO = "text", "auto"
FORMATS = (AUTO, TEXT, *SHARD_FORMATS)
"""data_config.format's choices."""
SUFFIX = ".bin"
"""The suffix of both formats' files: a folder's shards are its .bin files."""
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
LLMC_KINDS = {20240520: {1: np.dtype("<u2")}, 20240801: {7: np.dtype("<u4")}}
"""llm.c's magic numbers, and for each the versions it documents with their id types."""
GPT2_MAGIC = 20240520
NANOGPT_DTYPE = np.dtype("<u2")
SCAN_LIMIT_BYTES = 64 << 20
"""A set of ids up to this size is scanned whole for ids beyond the vocabulary when it is opened
(tens of milliseconds); a larger one is checked batch by batch, as it is read."""
FD_HEADROOM = 256
"""Open files left for everything else a process opens."""
REMOTE = "remote shards are not supported yet; copy them locally"


def names_shards(path: str, format: str) -> bool:
    """Whether a data path names pre-tokenized shards rather than a text: the format says so, or,
    under auto, the path is a .bin file, a folder or a glob (a text keeps meaning a text)."""
    if format == TEXT:
        return False
    if format in SHARD_FORMATS:
        return True
    if files.is_remote(path):  # no listing here: a URL's query string may hold a "?"
        return path.endswith((SUFFIX, "/")) or "*" in path
    local = files.local_path(path)
    if local.endswith(SUFFIX) or os.path.isdir(local):
        return True
    return glob.has_magic(local) and not os.path.isfile(local)


@dataclass(frozen=True)
class Shard:
    """Where a shard's ids lie in its file, read from its header and size."""

    path: Path
    """The file read: the shard itself, or a remote shard's copy in the cache (made when first read)."""
    format: str
    dtype: np.dtype
    offset: int
    n_tokens: int
    url: Optional[str] = None
    """A remote shard's URL (shard_cache.py); None for a shard on this machine."""

    @property
    def source(self) -> str:
        """Where the shard lies, as the user named it."""
        return self.url or str(self.path)

    @property
    def file_bytes(self) -> int:
        return self.offset + self.n_tokens * self.dtype.itemsize

    @property
    def kind(self) -> str:
        """What the user calls it: "llm.c (uint16 ids)"."""
        return f"{FORMAT_NAMES[self.format]} ({self.dtype.name} ids)"


class ShardStream:
    """A set of shards as one stream of ids: `stream[positions]` gathers the ids at an int64 array
    of positions (any shape), `stream[:n]` keeps the first n, `len(stream)` counts them all.

    A gather within one shard (nearly every window) is one fancy index into its map; one that spans
    shards is sorted once and split at the shards' starts.
    """

    def __init__(self, shards: list[Shard], key: str, vocab_size: Optional[int], length: Optional[int] = None,
                 maps: Optional[list[Optional[np.memmap]]] = None, cache: Optional[ShardCache] = None):
        self.shards = shards
        self.key = key
        """The config key the set came from, for errors (data_config.path or val_path)."""
        self.vocab_size = vocab_size
        """Ids from this on are beyond the tokenizer's vocabulary; None: not checked."""
        counts = np.array([shard.n_tokens for shard in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        """Where each shard starts in the stream, and (last) the stream's end."""
        self.length = int(self.starts[-1]) if length is None else length
        self.cache = cache
        """Where remote shards' copies are kept (None: every shard is on this machine)."""
        self._maps = maps if maps is not None else local_maps(shards)
        self._copies = self._mapped_copies()
        self.scanned = False
        """Every id was checked against the vocabulary (scan)."""

    def __getstate__(self) -> dict:
        """Pickled (a DataLoader worker that is not forked) as its shards, never as their ids."""
        return {name: value for name, value in vars(self).items() if name not in ("_maps", "_copies")}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._maps = local_maps(self.shards)
        self._copies = self._mapped_copies()

    def _mapped_copies(self) -> Optional[MappedCopies]:
        """Remote shards' maps: at most as many as the cache holds copies of the largest."""
        if self.cache is None:
            return None
        return MappedCopies(self.cache.capacity_bytes // max(shard.file_bytes for shard in self.shards))

    def _map(self, index: int) -> np.memmap:
        """A shard's ids: mapped at open, or a remote shard's copy, fetched and mapped when first read."""
        shard = self.shards[index]
        if shard.url is None:
            return self._maps[index]
        return self._copies.get(index, lambda: self._map_copy(shard))

    def _map_copy(self, shard: Shard) -> np.memmap:
        """The copy's map. Another process making room may evict the copy between its fetch and its
        map (the least recently used, so rarely one still wanted): then it is fetched once more."""
        for _ in range(2):
            self.cache.copy_of(shard.url, shard.file_bytes, shard.path)
            with contextlib.suppress(FileNotFoundError):
                return np.memmap(shard.path, dtype=shard.dtype, mode="r", offset=shard.offset,
                                 shape=(shard.n_tokens,))
        self.cache.copy_of(shard.url, shard.file_bytes, shard.path)
        return map_ids(shard)  # a third time: said in one line if it fails again

    @property
    def dtype(self) -> np.dtype:
        return self.shards[0].dtype

    def __len__(self) -> int:
        return self.length

    def describe(self) -> str:
        """"12 llm.c shards"."""
        count = len(self.shards)
        return f"{count} {FORMAT_NAMES[self.shards[0].format]} shard{'s' if count != 1 else ''}"

    def __getitem__(self, index) -> "np.ndarray | ShardStream":
        if isinstance(index, slice):
            return self.head(index)
        positions = np.asarray(index, dtype=np.int64)
        flat = positions.reshape(-1)
        ids = np.empty(flat.shape, self.dtype)
        if flat.size:
            lowest, highest = int(flat.min()), int(flat.max())
            if lowest < 0 or highest >= self.length:
                raise IndexError(f"token position outside 0..{self.length - 1}")
            first, last = np.searchsorted(self.starts, [lowest, highest], side="right") - 1
            if first == last:
                ids[:] = self._read(first, flat)
            else:
                self._gather_across(flat, first, last, ids)
        return ids.reshape(positions.shape)

    def _gather_across(self, flat: np.ndarray, first: int, last: int, ids: np.ndarray) -> None:
        """Positions in several shards: sorted once, each shard's run of them read in one index."""
        order = np.argsort(flat, kind="stable")
        ordered = flat[order]
        bounds = np.searchsorted(ordered, self.starts[first:last + 2])
        for shard, lo, hi in zip(range(first, last + 1), bounds[:-1], bounds[1:]):
            if lo < hi:
                ids[order[lo:hi]] = self._read(shard, ordered[lo:hi])

    def _read(self, shard: int, positions: np.ndarray) -> np.ndarray:
        """The ids of one shard at stream positions, checked against the vocabulary."""
        ids = self._map(shard)[positions - self.starts[shard]]
        if self.vocab_size is not None and ids.size and int(ids.max()) >= self.vocab_size:
            first_bad = int(np.flatnonzero(ids >= self.vocab_size)[0])
            raise self.beyond_vocabulary(shard, int(ids[first_bad]),
                                         int(positions[first_bad] - self.starts[shard]))
        return ids

    def beyond_vocabulary(self, shard: int, value: int, where: int) -> DataError:
        return DataError(f"{self.key}: {self.shards[shard].path} holds the id {value:,} (at token "
                         f"{where:,}), beyond the vocabulary of {self.vocab_size:,} of "
                         "data_config.tokenizer; give the tokenizer.json that made the shards")

    def head(self, index: slice) -> "ShardStream":
        """The stream's first n ids (`stream[:n]`, data_config.truncate): only its shards are mapped."""
        if index.start not in (None, 0) or index.step not in (None, 1):
            raise IndexError("a shard stream slices as stream[:n] only")
        n = min(max(index.stop if index.stop is not None else self.length, 0), self.length)
        kept = max(int(np.searchsorted(self.starts, n, side="left")), 1)  # shards holding the first n
        return ShardStream(self.shards[:kept], self.key, self.vocab_size, n, self._maps[:kept], self.cache)

    def read_ahead(self, shards: list[int]) -> None:
        """Bring these shards near in the background (nothing waits): the next ones an epoch's order
        reads (BlockOrder). Remote shards are fetched into the cache; the kernel is asked to read
        local ones into the page cache, one call each."""
        remote = [self.shards[index] for index in shards if self.shards[index].url]
        if remote:
            self.cache.fetch_ahead([(shard.url, shard.file_bytes, shard.path) for shard in remote])
        for index in shards:
            shard = self.shards[index]
            if shard.url:
                continue
            with contextlib.suppress(OSError, AttributeError):  # a hint: no such call here, nothing worse
                descriptor = os.open(shard.path, os.O_RDONLY)
                try:
                    os.posix_fadvise(descriptor, shard.offset, shard.n_tokens * shard.dtype.itemsize,
                                     os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(descriptor)

    def parts(self) -> Iterator[np.ndarray]:
        """The stream's ids, a shard's (its first ones, for the last one kept) at a time."""
        for index in range(len(self.shards)):
            yield self._map(index)[: self.length - int(self.starts[index])]

    def scan(self) -> None:
        """Every id of the set against the vocabulary, a shard at a time (a small set only)."""
        for shard, ids in enumerate(self._maps):
            if int(ids.max()) >= self.vocab_size:
                where = int(np.flatnonzero(ids >= self.vocab_size)[0])
                raise self.beyond_vocabulary(shard, int(ids[where]), where)
        self.scanned = True


def count_ids(ids: "np.ndarray | ShardStream", vocab_size: int, chunk: int = 1 << 24) -> np.ndarray:
    """How often each id occurs in an array of ids or a stream, a chunk at a time (bincount copies
    its input as int64)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for part in ids.parts() if isinstance(ids, ShardStream) else [ids]:
        for first in range(0, len(part), chunk):
            counts += np.bincount(part[first:first + chunk], minlength=vocab_size)
    return counts


def local_maps(shards: list[Shard]) -> list[Optional[np.memmap]]:
    """The maps of the shards on this machine, made now (remote shards' copies: when first read)."""
    return [None if shard.url else map_ids(shard) for shard in shards]


def map_ids(shard: Shard) -> np.memmap:
    """A shard's ids, mapped read-only (pages are read when touched, and shared with other ranks)."""
    try:
        return np.memmap(shard.path, dtype=shard.dtype, mode="r", offset=shard.offset,
                         shape=(shard.n_tokens,))
    except OSError as e:
        raise DataError(f"cannot map {shard.path} ({e.strerror}); with many shards, raise the open files "
                        "limit (ulimit -n)") from None


# ------------------------------------------------------------------------------------------ opening

def open_shards(path: str, format: str, vocab_size: Optional[int], key: str,
                cache: Optional[ShardCache] = None) -> ShardStream:
    """The shards a data path names (a .bin file, a folder of them, or a glob; remote ones, a file
    or a glob, through the cache), checked from their headers and sizes, as one stream. format: auto
    (each file recognised by llm.c's magic, else nanoGPT's for a .bin file) or one of SHARD_FORMATS;
    key names the config key in errors."""
    if files.is_remote(path):
        shards = remote_shards(path, format, key, cache)
    else:
        shards = [read_shard(found, format, key) for found in shard_files(path, key)]
    kinds = {(shard.format, shard.dtype) for shard in shards}
    if len(kinds) > 1:
        first = shards[0]
        other = next(shard for shard in shards if (shard.format, shard.dtype) != (first.format, first.dtype))
        raise DataError(f"{key}: mixed formats in one set: {first.path} is {first.kind}, {other.path} "
                        f"{other.kind}; give the shards of one format")
    allow_open_files(len(shards))
    stream = ShardStream(shards, key, vocab_size, cache=cache if files.is_remote(path) else None)
    small = len(stream) * stream.dtype.itemsize <= SCAN_LIMIT_BYTES
    if vocab_size is not None and small and stream.cache is None:
        stream.scan()
    return stream


def remote_shards(path: str, format: str, key: str, cache: ShardCache) -> list[Shard]:
    """The remote shards a URL, a URL's glob or a folder's URL (ending with "/": its .bin files) names,
    from their headers (1 KB each, read a few at a time) and sizes; each to be read from its copy in
    the cache."""
    folder = path.endswith("/")
    urls = remote_listing(f"{path}*{SUFFIX}" if folder else path, path, key) if folder or "*" in path \
        else [path]
    if not urls and folder:
        raise DataError(f"{key}: the folder {path} holds no {SUFFIX} shards; point it at a folder of llm.c's "
                        "or nanoGPT's .bin files, or at a text")
    if not urls:
        raise DataError(f"{key}: the glob {path} matches no file; check the pattern (and quote it, so that "
                        "the shell leaves it to the data loader)")

    def read_one(url: str) -> Shard:
        try:
            info, head = files.info(url), files.read_range(url, 0, HEADER_BYTES)
        except Exception as e:
            raise DataError(f"{key}: cannot read {url} ({short_reason(e)}); check the store, the shard "
                            "and your credentials") from None
        shard = shard_of(url, head, info["size"], format, key)
        return replace(shard, path=cache.folder / copy_name(url, json.dumps(remote_version(info))), url=url)

    return open_remote_headers(urls, read_one)


def remote_listing(pattern: str, path: str, key: str) -> list[str]:
    """The URLs a remote glob matches (path: what the user gave, for the error), sorted, in one
    request; a store that cannot be listed is one line."""
    try:
        return files.glob(pattern)
    except Exception as e:  # no credentials, no such bucket, an unreachable store: s3fs's own kinds
        raise DataError(f"{key}: cannot list {path} ({short_reason(e)}); check the store and your "
                        "credentials") from None


def shard_files(path: str, key: str) -> list[Path]:
    """A glob's matching files, a folder's .bin files, or the one file, sorted by path."""
    local = files.local_path(path)
    if os.path.isfile(local):
        found = [Path(local)]
    elif os.path.isdir(local):
        found = sorted(child for child in Path(local).glob(f"*{SUFFIX}") if child.is_file())
        if not found:
            raise DataError(f"{key}: the folder {path} holds no {SUFFIX} shards; point it at a folder of "
                            "llm.c's or nanoGPT's .bin files, or at a text")
    elif glob.has_magic(local):
        found = glob_matches(local, path, key)
    else:
        raise DataError(f"{key}: no such file or folder {path}; point it at shards (a .bin file, a folder "
                        "or a glob of them) or at a text")
    return found


def glob_matches(local: str, path: str, key: str) -> list[Path]:
    """The files a local glob matches, sorted; none is one line naming the key."""
    found = sorted(Path(match) for match in glob.glob(local) if os.path.isfile(match))
    if not found:
        raise DataError(f"{key}: the glob {path} matches no file; check the pattern (and quote it, so "
                        "that the shell leaves it to the data loader)")
    return found


def read_shard(path: Path, format: str, key: str) -> Shard:
    """A shard's layout from its first 1,024 bytes and its size (its ids are not read)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise DataError(f"{key}: cannot read {path} ({e.strerror}); check its permissions") from None
    return shard_of(path, head, size, format, key)


def shard_of(path, head: bytes, size: int, format: str, key: str) -> Shard:
    """A shard's layout from its first bytes and its size; path (a Path, or a remote shard's URL)
    names it."""
    magic = int.from_bytes(head[:4], "little", signed=True) if len(head) >= 4 else None
    if format == AUTO:
        if magic not in LLMC_KINDS and not str(path).endswith(SUFFIX):
            raise DataError(f"{key}: {path} is neither an llm.c shard (no magic number) nor a {SUFFIX} file "
                            "of nanoGPT's; name shards, or one text (sets of texts are not supported yet)")
        format = LLMC if magic in LLMC_KINDS else NANOGPT
    if format == LLMC:
        shard = llmc_shard(path, magic, head, size, key)
    else:
        shard = nanogpt_shard(path, magic, size, key)
    if shard.n_tokens == 0:
        raise DataError(f"{key}: {path} holds no tokens; remove it from the set")
    return shard


def llmc_shard(path: Path, magic: Optional[int], head: bytes, size: int, key: str) -> Shard:
    """An llm.c shard: its magic, a version documented for it, and a size its header accounts for."""
    if magic not in LLMC_KINDS:
        found = "is empty" if magic is None else f"starts with {magic}"
        raise DataError(f"{key}: {path} is not an llm.c shard: its header {found}, not the magic "
                        f"{GPT2_MAGIC} (data_config.format=llmc); check the file, or the format")
    if len(head) < HEADER_BYTES:
        raise DataError(f"{key}: {path} is {size:,} bytes, shorter than llm.c's {HEADER_BYTES:,}-byte "
                        "header: a truncated shard; fetch it again")
    version, count = (int(value) for value in np.frombuffer(head, "<i4", count=3)[1:])
    versions = LLMC_KINDS[magic]
    if version not in versions:
        known = ", ".join(f"{v} ({dtype.name} ids)" for v, dtype in versions.items())
        raise DataError(f"{key}: {path} is of version {version} of llm.c's format (magic {magic}), which "
                        f"this project does not read; it reads version {known}")
    dtype = versions[version]
    expected = HEADER_BYTES + count * dtype.itemsize
    if count < 0 or size != expected:
        problem = "truncated" if size < expected else "longer than its header says: damaged"
        raise DataError(f"{key}: {path} is {size:,} bytes where its header says {expected:,} "
                        f"({HEADER_BYTES:,} + {count:,} ids of {dtype.itemsize} bytes): {problem}; "
                        "fetch it again")
    return Shard(path, LLMC, dtype, HEADER_BYTES, count)


def nanogpt_shard(path: Path, magic: Optional[int], size: int, key: str) -> Shard:
    """A nanoGPT file: uint16 ids, so an even number of bytes; one that starts as llm.c's is not one."""
    if magic in LLMC_KINDS:
        raise DataError(f"{key}: {path} starts with llm.c's magic {magic}: it is an llm.c shard, not raw "
                        "nanoGPT ids; use data_config.format=llmc (or auto)")
    if size % NANOGPT_DTYPE.itemsize:
        raise DataError(f"{key}: {path} is {size:,} bytes, an odd length where nanoGPT's .bin holds 2-byte "
                        "ids: truncated, or not such a file")
    return Shard(path, NANOGPT, NANOGPT_DTYPE, 0, size // NANOGPT_DTYPE.itemsize)


def allow_open_files(count: int) -> None:
    """Each memory map holds a file descriptor (numpy's memmap, before Python 3.13), and FineWeb's
    100B tokens are 1,030 shards, past the usual soft limit of 1,024 open files: raise this process's
    soft limit, as far as its hard limit allows, when the shards need more than it leaves."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else FD_HEADROOM
    wanted = in_use + count + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):  # then mapping says so (map_ids)
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(raised, soft), hard))


# ------------------------------------------------------------------------ the project's own token files

MINGPT = "mingpt"
"""The project's token files (token_file.py), as the prepared files of a set of texts (text_set.py)
are read: one stream, as shards are, so that the split, the sample order and resuming are the same."""
FORMAT_NAMES[MINGPT] = "text"


LAYOUT_FIELDS = ("dtype", "data_offset", "n_tokens")
"""Where a token file's ids lie, as its header says."""


def open_token_files(paths: list[Path], key: str, tokenizer_settings: dict,
                     layouts: Optional[list[dict]] = None) -> ShardStream:
    """A set's token files as one stream, each laid out as its header says (the ids are not read:
    the preparation checked them); all made with these tokenizer settings, so of one vocabulary.
    layouts: their LAYOUT_FIELDS, known already (a set's current index): no header is read."""
    shards = []
    for index, path in enumerate(paths):
        layout = layouts[index] if layouts is not None else read_header(path)
        if layouts is None and layout["tokenizer"] != tokenizer_settings:
            raise DataError(f"token file {path} was made by another run, for other tokenizer settings; run "
                            "one tokenizer setting per set at a time, then start again")
        shards.append(Shard(Path(path), MINGPT, np.dtype(layout["dtype"]), layout["data_offset"],
                            layout["n_tokens"]))
    allow_open_files(len(shards))
    return ShardStream(shards, key, None)
