"""Prepare the training text once as a token file that every rank memory-maps.

Reading and encoding the whole text on every rank costs each of them the text's size several times
over in RAM. Instead one process per machine streams the text (a local path or any fsspec URL) into
a file of token ids, and every rank maps that file read-only: the pages are shared, and a corpus
larger than memory still trains.

The ids are of the text's characters (the original's tokens), or of a byte-level BPE
(tokenizer.py), whose tokenizer is made (trained on a sample of the text, or read from a
tokenizer.json) while the file is, and kept in its header. Each kind has a file of its own
(`input.txt.tokens`, `input.txt.bpe.tokens`); one made with other tokenizer settings is made again.

Made by `python mingpt/prepare_data.py PATH` ahead of training, or by training itself when missing.

File format (little-endian):
    MAGIC                       14 bytes, b"MINGPT-TOKENS\\x01"
    header length               4 bytes, unsigned
    header                      JSON: version, tokenizer (the settings that made it), vocab
                                (characters) or tokenizer_json (a BPE), vocab_size, dtype,
                                n_tokens, data_offset, crc32, fingerprint, source
    zero padding                up to data_offset, a multiple of ALIGN, so the ids can be mapped
    ids                         n_tokens ids of `dtype`: each character's index in vocab, or
                                the BPE's ids
Version 1 (before BPE) is version 2 of characters without tokenizer and vocab_size: still read.
"""
import codecs
import contextlib
import functools
import hashlib
import json
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

import numpy as np
from tokenizers import Tokenizer

from mingpt.common import files
from mingpt.common.errors import DataError, MinGPTError, short_reason
from mingpt.tokens.bpe_encoder import encode_pieces
from mingpt.tokens.tokenizer import (
    CHAR,
    MAX_VOCAB,
    TokenizerChoice,
    sample_windows,
    token_list,
    train_bpe,
    window_text,
)

MAGIC = b"MINGPT-TOKENS\x01"
VERSION = 2
VERSIONS = (1, 2)
CHARACTERS = {"kind": CHAR}
"""The tokenizer settings of a character token file."""
ALIGN = 4096
"""The ids start at a multiple of this, so they can be memory-mapped."""
CHUNK_BYTES = 4 << 20
"""Bytes of text read at a time: bounds the memory used, whatever the corpus size."""
N_CODEPOINTS = 0x110000
ID_DTYPES = ("uint8", "uint16", "uint32")
VERSION_KEYS = ("ETag", "etag", "LastModified", "last_modified", "Last-Modified", "mtime", "updated",
                "generation", "VersionId", "created")
"""Keys of fs.info() that change when a remote file is rewritten (size alone may not)."""
_LENGTH = struct.Struct("<I")
_PREFIX = len(MAGIC) + _LENGTH.size


@dataclass(frozen=True, eq=False)  # ids is an array: compare the files, not these
class TokenFile:
    """A prepared text: its vocabulary and its ids, mapped read-only from the file."""

    path: Path
    vocab: list[str]
    """The tokens in id order: characters, or a BPE's tokens."""
    ids: np.memmap
    n_tokens: int
    fingerprint: dict
    tokenizer: str = ""
    """A BPE's tokenizer.json; empty for characters."""
    settings: dict = field(default_factory=lambda: dict(CHARACTERS))
    """What made the tokenizer (TokenizerChoice.settings)."""

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)


# ---------------------------------------------------------------------------------------- encoding

def id_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id: 1 byte per character for most texts."""
    for name in ID_DTYPES:
        if vocab_size <= np.iinfo(name).max + 1:
            return np.dtype(name)
    raise ValueError(f"a vocabulary of {vocab_size} tokens is more than uint32 ids hold")


def codepoints(text: str) -> np.ndarray:
    """The code points of text; an ASCII str (the common case) costs a 1-byte copy, not 4."""
    if text.isascii():
        return np.frombuffer(text.encode("ascii"), np.uint8)
    return np.frombuffer(text.encode("utf-32-le"), np.uint32)


def encode_text(text: str) -> tuple[np.ndarray, list[str]]:
    """Ids and vocabulary of a text already in memory: what the streaming path writes for it."""
    cps = codepoints(text)
    vocab_cps = np.unique(cps)  # sorted, like sorted(set(text))
    ids = np.searchsorted(vocab_cps, cps).astype(id_dtype(len(vocab_cps)))
    return ids, [chr(c) for c in vocab_cps.tolist()]


# ------------------------------------------------------------------------------------ reading text

@contextlib.contextmanager
def source_errors(source: str) -> Iterator[None]:
    """Turn a missing or unreadable source into a DataError that says what to fix."""
    try:
        yield
    except FileNotFoundError:
        if files.is_remote(source):  # fsspec's http says so of an unreachable host too
            raise DataError(f"data_config.path: cannot fetch {source} (not there, or no network); check "
                            "the URL, or download the text and point data_config.path at the copy") from None
        raise DataError(f"data_config.path: no such file {source}; "
                        "point data_config.path at a UTF-8 text file") from None
    except OSError as e:
        raise DataError(f"data_config.path: cannot read {source} ({e}); "
                        "check the path and its permissions") from None
    except MinGPTError:
        raise
    except Exception as e:  # an object store's own: no credentials, an unreachable endpoint, ...
        if not files.is_remote(source):
            raise
        raise DataError(f"data_config.path: cannot read {source} ({short_reason(e)}); check the URL and "
                        "the credentials and endpoint for it (the AWS_* environment, for s3://)") from None


def fingerprint(source: str) -> dict:
    """What identifies this version of the source: a different value means rebuild the token file."""
    with source_errors(source):
        if not files.is_remote(source):
            st = os.stat(files.local_path(source))
            return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        info = files.info(source)
    return {"size": info.get("size"), **remote_version(info)}


def remote_version(info: dict) -> dict:
    """The keys of a remote file's fs.info() that change when it is rewritten, as JSON keeps them
    (datetimes and the like compare as their JSON text, the form they are stored in)."""
    return json.loads(json.dumps({key: info[key] for key in VERSION_KEYS if info.get(key) is not None},
                                 default=str))


def text_chunks(source: str, start: int = 0, end: Optional[int] = None) -> Iterator[str]:
    """The text (bytes start..end of it) a chunk at a time, decoded incrementally; a DataError names
    the first bad byte."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    consumed = start  # bytes handed to the decoder before this chunk
    with source_errors(source), files.open_file(source, "rb") as f:
        f.seek(start)
        while True:
            raw = f.read(CHUNK_BYTES if end is None else min(CHUNK_BYTES, end - consumed))
            pending = len(decoder.getstate()[0])  # an incomplete character held back last time
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise DataError(
                    f"data_config.path: {source} is not UTF-8 text ({e.reason} at byte "
                    f"{consumed - pending + e.start}); convert it to UTF-8 or point data_config.path "
                    "at a UTF-8 text file") from None
            consumed += len(raw)
            if text:
                yield text
            if not raw:
                return


class PlainText:
    """How a source becomes text: a UTF-8 text read as it is (the project's one kind until sets of
    files; tokens/text_set.py reads JSON lines and Parquet documents as subclasses of this)."""

    def settings(self) -> Optional[dict]:
        """What the reading depends on, kept in the token file's header ("reader"; none for a plain
        text, whose files predate readers): a file read with other settings is made again."""
        return None

    def texts(self, source: str) -> Iterator[str]:
        """The source's text, a chunk at a time."""
        return text_chunks(source)

    def bpe_ids(self, source: str, tokenizer: Tokenizer, config: dict, dtype: np.dtype
                ) -> Iterator[np.ndarray]:
        """The source's ids under a BPE (config: its tokenizer.json, parsed), a chunk at a time."""
        return encode_pieces(tokenizer, config, self.texts(source), dtype)


PLAIN = PlainText()


class TextRange(PlainText):
    """Bytes start..end of a text, read as a text of its own (tokens/text_ranges.py cuts them)."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end

    def settings(self) -> dict:
        return {"kind": "range", "start": self.start, "end": self.end}

    def texts(self, source: str) -> Iterator[str]:
        return text_chunks(source, self.start, self.end)


def count_codepoints(source: str, reader: PlainText = PLAIN) -> np.ndarray:
    """Pass 1: how often each code point occurs, over the whole text."""
    counts = np.zeros(N_CODEPOINTS, np.int64)
    for text in reader.texts(source):
        chunk_counts = np.bincount(codepoints(text))
        counts[: len(chunk_counts)] += chunk_counts
    return counts


def id_chunks(source: str, lut: np.ndarray, reader: PlainText = PLAIN) -> Iterator[np.ndarray]:
    """Pass 2: the ids of the text, a chunk at a time."""
    for text in reader.texts(source):
        yield lut[codepoints(text)]


# ------------------------------------------------------------------------------------- file format

def header_bytes(header: dict) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode("ascii")
    return MAGIC + _LENGTH.pack(len(body)) + body


def data_offset_for(header: dict) -> int:
    """Where the ids start: past the longest header this file can have, rounded up to ALIGN."""
    widest = dict(header, crc32=0xFFFFFFFF, data_offset=1 << 62, n_tokens=1 << 62)
    return -(-len(header_bytes(widest)) // ALIGN) * ALIGN


def unusable(path: Path, problem: str) -> DataError:
    return DataError(f"token file {path} {problem}; delete it and prepare the data again "
                     "(python mingpt/prepare_data.py <data_config.path>)")


def read_header(path: Path) -> dict:
    """The header of a token file, checked against the file's size (cheap: the ids are not read)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX)
            if len(prefix) < _PREFIX or prefix[: len(MAGIC)] != MAGIC:
                raise unusable(path, "is not a token file (bad magic bytes)")
            (length,) = _LENGTH.unpack(prefix[len(MAGIC):])
            body = f.read(length)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise DataError(f"token file {path} does not exist; prepare the data first "
                        "(python mingpt/prepare_data.py <data_config.path>)") from None
    except OSError as e:
        raise DataError(f"cannot read token file {path} ({e}); check its permissions") from None
    try:
        header = upgraded(json.loads(body))
    except ValueError:
        raise unusable(path, "has a damaged header") from None
    problem = header_problem(header, _PREFIX + len(body), size)
    if problem:
        raise unusable(path, problem)
    return header


def header_problem(header: object, header_end: int, size: int) -> Optional[str]:
    """What is wrong with a parsed header and the file size, or None."""
    if not isinstance(header, dict) or header.get("version") not in VERSIONS:
        return f"has an unknown format (expected version {VERSION})"
    if not vocabulary_ok(header):
        return "has a damaged header (vocabulary or id type)"
    dtype = header["dtype"]
    n_tokens, offset = header.get("n_tokens"), header.get("data_offset")
    numbers_ok = all(isinstance(header.get(k), int) for k in ("n_tokens", "data_offset", "crc32"))
    if not numbers_ok or n_tokens <= 0 or offset < header_end or offset % ALIGN or \
            not isinstance(header.get("fingerprint"), dict):
        return "has a damaged header"
    expected = offset + n_tokens * np.dtype(dtype).itemsize
    if size != expected:
        return f"is {size:,} bytes where its header says {expected:,} (truncated or damaged)"
    return None


def upgraded(header: object) -> object:
    """A version 1 header as version 2 has it: characters, and their number."""
    if isinstance(header, dict) and header.get("version") == 1 and isinstance(header.get("vocab"), list):
        return dict(header, tokenizer=CHARACTERS, vocab_size=len(header["vocab"]))
    return header


def vocabulary_ok(header: dict) -> bool:
    """Characters, or a BPE's tokenizer, and an id type that holds the vocabulary."""
    settings, vocab_size, dtype = header.get("tokenizer"), header.get("vocab_size"), header.get("dtype")
    if not isinstance(settings, dict) or not isinstance(vocab_size, int) or not 0 < vocab_size <= MAX_VOCAB:
        return False
    if settings.get("kind") == CHAR:  # a text's own characters, or a set's (settings["characters"])
        vocab = header.get("vocab")
        tokens_ok = isinstance(vocab, list) and all(isinstance(ch, str) and len(ch) == 1 for ch in vocab) \
            and len(vocab) == vocab_size <= N_CODEPOINTS
    else:
        tokens_ok = isinstance(header.get("tokenizer_json"), str)
    return tokens_ok and dtype == id_dtype(vocab_size).name


def data_crc32(path: Path, offset: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        while block := f.read(CHUNK_BYTES):
            crc = zlib.crc32(block, crc)
    return crc


def open_token_file(path: Path) -> TokenFile:
    """Map a prepared token file read-only. Checks the header and the size, not the checksum:
    the other ranks call this after local rank 0's prepare() checked everything."""
    path = Path(path)
    header = read_header(path)
    ids = np.memmap(path, dtype=header["dtype"], mode="r", offset=header["data_offset"],
                    shape=(header["n_tokens"],))
    tokenizer = header.get("tokenizer_json", "")
    vocab = token_list(Tokenizer.from_str(tokenizer)) if tokenizer else header["vocab"]
    return TokenFile(path, vocab, ids, header["n_tokens"], header["fingerprint"], tokenizer,
                     header["tokenizer"])


def is_up_to_date(path: Path, source_fingerprint: dict, settings: dict, reader: PlainText = PLAIN,
                  checksum: bool = True) -> bool:
    """Whether path is a whole, undamaged token file of this version of the source, made with
    these tokenizer settings (and read with these reader settings); its ids' checksum too, unless
    another process has just checked them (checksum=False)."""
    try:
        header = read_header(path)
    except DataError:
        return False
    return header["fingerprint"] == source_fingerprint and header["tokenizer"] == settings and \
        header.get("reader") == reader.settings() and \
        (not checksum or data_crc32(path, header["data_offset"]) == header["crc32"])


# ---------------------------------------------------------------------------------------- building

def write_ids(out: BinaryIO, chunks: Iterator[np.ndarray]) -> tuple[int, int]:
    """Write the id chunks; (ids written, crc32 of their bytes)."""
    n_written, crc = 0, 0
    for ids in chunks:
        out.write(ids.data)
        crc = zlib.crc32(ids.data, crc)
        n_written += len(ids)
    return n_written, crc


def vocabulary(counts: np.ndarray) -> tuple[list[str], np.ndarray]:
    """The sorted characters that occur, and a table from every code point to its id: one numpy
    lookup per chunk instead of a dict lookup per character."""
    vocab_cps = np.flatnonzero(counts)
    lut = np.zeros(N_CODEPOINTS, id_dtype(len(vocab_cps)))
    lut[vocab_cps] = np.arange(len(vocab_cps))
    return [chr(c) for c in vocab_cps.tolist()], lut


def empty_text(source: str) -> DataError:
    return DataError(f"data_config.path: {source} is empty; "
                     "point data_config.path at a non-empty UTF-8 text file")


def character_plan(source: str, reader: PlainText = PLAIN, characters: str = ""
                   ) -> tuple[dict, Iterator[np.ndarray]]:
    """Pass 1 counts the characters; the header's vocabulary fields, and pass 2, the ids. A set's
    file (characters: the set's, counted over all its files) has no pass 1."""
    if characters:
        vocab, lut = vocabulary(np.bincount(codepoints(characters), minlength=N_CODEPOINTS))
        return {"vocab": vocab, "vocab_size": len(vocab), "dtype": lut.dtype.name}, \
            known_ids(source, lut, reader, vocab)
    counts = count_codepoints(source, reader)
    n_tokens = int(counts.sum())
    if n_tokens == 0:
        raise empty_text(source)
    vocab, lut = vocabulary(counts)
    return {"vocab": vocab, "vocab_size": len(vocab), "dtype": lut.dtype.name, "n_tokens": n_tokens}, \
        id_chunks(source, lut, reader)


def known_ids(source: str, lut: np.ndarray, reader: PlainText, vocab: list[str]) -> Iterator[np.ndarray]:
    """Pass 2 with a vocabulary counted before: a character outside it (the file changed since) would
    become id 0 unseen, so it is refused."""
    known = np.zeros(N_CODEPOINTS, bool)
    known[codepoints("".join(vocab))] = True
    for text in reader.texts(source):
        points = codepoints(text)
        if not known[points].all():
            raise DataError(f"data_config.path: {source} changed while it was being prepared; "
                            "prepare it again once it no longer changes")
        yield lut[points]


def bpe_plan(source: str, choice: TokenizerChoice, size: Optional[int], reader: PlainText = PLAIN
             ) -> tuple[dict, Iterator[np.ndarray]]:
    """The BPE (read, or trained on a sample), and the ids of the text under it, in one pass."""
    tokenizer_json = choice.file.json if choice.file else train_bpe(
        bpe_sample(source, size, choice.sample_bytes), choice.vocab_size).to_str()
    tokenizer, config, vocab_size = parsed_bpe(tokenizer_json)
    dtype = id_dtype(vocab_size)
    chunks = reader.bpe_ids(source, tokenizer, config, dtype)
    return {"tokenizer_json": tokenizer_json, "vocab_size": vocab_size, "dtype": dtype.name}, chunks


@functools.lru_cache(maxsize=2)
def parsed_bpe(tokenizer_json: str) -> tuple[Tokenizer, dict, int]:
    """A tokenizer.json's Tokenizer, its parsed config and its vocabulary's size: made once for the
    files of a set or the ranges of a text, which share one (parsing it was a tenth of each file's
    time, for a set of 2 MB files)."""
    tokenizer = Tokenizer.from_str(tokenizer_json)
    return tokenizer, json.loads(tokenizer_json), len(token_list(tokenizer))


def bpe_sample(source: str, size: Optional[int], sample_bytes: int) -> Iterator[str]:
    """The text a BPE is trained on: windows spread evenly over it (tokenizer.sample_windows); its
    first sample_bytes if its size is unknown."""
    windows = sample_windows(size, sample_bytes) if size is not None else [(0, sample_bytes)]
    with source_errors(source), files.open_file(source, "rb") as f:
        for offset, length in windows:
            f.seek(offset)
            yield window_text(f.read(length), whole=(offset, length) == (0, size))


def build(source: str, path: Path, source_fingerprint: dict, choice: TokenizerChoice = TokenizerChoice(),
          reader: PlainText = PLAIN) -> None:
    """Encode source into path in streaming passes, atomically: a temporary file in the same
    folder, fsync'ed, then renamed, so path is either absent, the old file or the whole new one."""
    if choice.is_char:
        fields, chunks = character_plan(source, reader, choice.characters)
    else:
        fields, chunks = bpe_plan(source, choice, source_fingerprint.get("size"), reader)
    header = {"version": VERSION, "tokenizer": choice.settings(), **fields,
              "fingerprint": source_fingerprint, "source": source}
    if reader.settings() is not None:
        header["reader"] = reader.settings()
    header["data_offset"] = data_offset_for(header)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        with os.fdopen(fd, "wb") as out:
            out.seek(header["data_offset"])
            n_written, header["crc32"] = write_ids(out, chunks)
            if n_written == 0:
                raise empty_text(source)
            expected = header.setdefault("n_tokens", n_written)
            out.seek(0)
            out.write(header_bytes(header))
            out.flush()
            os.fsync(out.fileno())
        if n_written != expected or fingerprint(source) != source_fingerprint:
            raise DataError(f"data_config.path: {source} changed while it was being prepared; "
                            "prepare it again once it no longer changes")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_folder(path.parent)


def fsync_folder(folder: Path) -> None:
    """Make the rename itself durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_leftovers(path: Path) -> None:
    """Delete temporary files of preparations that were killed. Only call with the lock held:
    then no live preparation of path is writing one."""
    for leftover in path.parent.glob(f"{path.name}.*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            leftover.unlink()


# ----------------------------------------------------------------------------------------- placing

def folder_is_writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK)


def token_file_for(source: str, cache_dir: Optional[str] = None, choice: TokenizerChoice = TokenizerChoice(),
                   part: str = "") -> Path:
    """Where the token file of source (of a part of it: `.part0001`) lives: beside a local source when
    its folder is writable, else in the cache folder under a name unique to the source; `.tokens` for
    characters, `.bpe.tokens` for a BPE."""
    suffix = (f".{part}" if part else "") + (".tokens" if choice.is_char else ".bpe.tokens")
    if not files.is_remote(source):
        beside = Path(files.local_path(source) + suffix)
        if folder_is_writable(beside.parent):
            return beside
        key = str(Path(files.local_path(source)).resolve())
    else:
        key = source
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    basename = Path(key.rstrip("/")).name or "text"
    return files.cache_folder(cache_dir) / f"{basename}-{digest}{suffix}"


def prepare(source: str, cache_dir: Optional[str] = None, choice: TokenizerChoice = TokenizerChoice(),
            reader: PlainText = PLAIN, checked: bool = False, part: str = "") -> tuple[Path, bool]:
    """The token file of source, and whether it was (re)built now.

    Safe to call from many processes at once: they take turns under a lock, the first builds, the
    others then find a whole, current file. Any file that is damaged, truncated, older than the
    source or made with other tokenizer settings is rebuilt. checked: another process held the lock
    a moment ago, and so made or checked the file: its header and size are checked, not its ids.
    """
    fingerprint(source)  # a missing source fails here, before a lock file is made beside it
    choice.settings()  # a bad tokenizer.json too
    path = token_file_for(source, cache_dir, choice, part)
    try:
        with files.locked(path):
            return path, make_under_lock(source, path, choice, reader, checksum=not checked)
    except OSError as e:  # the source's own errors are DataErrors by now: this is the token file's
        raise cannot_write(path, e) from None


def prepare_if_free(source: str, cache_dir: Optional[str], choice: TokenizerChoice, reader: PlainText = PLAIN,
                    part: str = "") -> Optional[tuple[Path, bool]]:
    """prepare(), unless another process is preparing source now: then None at once (the preparers
    of a set of texts move on to its next file, and come back to this one at the end)."""
    fingerprint(source)
    choice.settings()
    path = token_file_for(source, cache_dir, choice, part)
    try:
        with files.try_locked(path) as held:
            return (path, make_under_lock(source, path, choice, reader)) if held else None
    except OSError as e:
        raise cannot_write(path, e) from None


def make_under_lock(source: str, path: Path, choice: TokenizerChoice, reader: PlainText,
                    checksum: bool = True) -> bool:
    """With path's lock held: whether path had to be (re)built now, which it then was."""
    source_fingerprint = fingerprint(source)
    if is_up_to_date(path, source_fingerprint, choice.settings(), reader, checksum):
        return False
    remove_leftovers(path)
    build(source, path, source_fingerprint, choice, reader)
    return True


Member = tuple[str, PlainText, str]
"""A token file to make: its source, how the source is read, and which part of it (or "")."""
Report = Callable[[str, Path, bool], None]
"""Told of each token file a process is done with: its source, its path, whether it made it now."""


def prepare_in_turn(members: list[Member], cache_dir: Optional[str], choice: TokenizerChoice,
                    done: Report) -> None:
    """Each member's token file, shared with the machine's other processes: take every one whose lock
    is free, skipping those another process holds; then wait for those, made by then (their headers
    are checked, not their ids, which the process that held them has just made or checked). done
    is told of each: its source, its token file, and whether this process made it now."""
    waiting = []
    for source, reader, part in members:
        made = prepare_if_free(source, cache_dir, choice, reader, part)
        if made is None:
            waiting.append((source, reader, part))
        else:
            done(source, *made)
    for source, reader, part in waiting:
        done(source, *prepare(source, cache_dir, choice, reader, checked=True, part=part))


def cannot_write(path: Path, e: OSError) -> DataError:
    return DataError(f"cannot write the token file {path} ({e}); "
                     "free space on its disk or make its folder writable")
