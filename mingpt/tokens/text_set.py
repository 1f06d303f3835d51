"""A corpus of many files: texts, JSON lines or Parquet, each prepared once into a token file of its
own, by every process of the machine in turn, and read as one stream of ids.

What a set is (set_files): `data_config.path` (or val_path) a folder, or a glob, on this machine or
behind a URL (a folder URL ends with "/"; a URL's glob has a "*"), whose files are texts by their
suffix: `.txt` (UTF-8, read as it is), `.jsonl` (one JSON object a line, the document under
`data_config.text_field`) or `.parquet` (the documents in the column of that name, as Hugging Face
datasets publish them). A single `.jsonl` or `.parquet` file is a set of one; a single `.txt` (or any
other text) stays one text, as it always was; `.bin` files are shards (shards.py); texts and shards
in one set are refused. Other files in a folder (token files, locks, a README) are left alone.
A remote set's files are read through fsspec (a Parquet file's row groups as ranged reads), each once
per machine, into token files in the cache folder, where its BPE is kept too.

Documents: a JSON lines or Parquet file's documents each end with the tokenizer's `<|endoftext|>`
(GPT-2's tokenizer.json has it, and a BPE trained here for a set has it as its first token), else with
a newline: ended rather than joined, so that the files of a set, read one after the other, keep every
boundary between documents marked (as llm.c's FineWeb shards do), and a window that crosses a file's
end crosses a document's end. Each document is encoded on its own (GPT-2's way), with no word across
two documents. A `.txt` file is read as it is: its own line breaks, nothing added.

Tokenizers: one vocabulary for the whole set, made once before any file is encoded. A BPE (`bpe`) is
trained on a sample of the set's first SAMPLE_FILES files, and kept as a tokenizer.json beside them
(bpe-<digest>.tokenizer.json, the digest of the settings and of those files' sizes and times: a changed
sample trains again); every file's token file is made with it, as with a tokenizer.json given.
Characters (`char`): the union of every file's characters, counted by one process while the others
wait (a pass over the whole set), and kept beside the files with each file's own characters and
version (chars-<digest>.json, the digest of the files' names): a changed file is counted again alone,
and only a character new to the set changes the vocabulary (and so makes every file again). Every
file's token file holds the set's characters, and its ids are of them. A set of one file is that
file's characters, as a text's.

Preparation (prepare_set): each process of the machine goes through the files in order and takes
every file whose lock it finds free (token_file.prepare_if_free), skipping those another process holds;
then it waits for those (token_file.prepare), which are made by then: their headers are checked, not
their ids, which the process that held them has just made or checked (so that a restart of W ranks
reads each token file once, not W times). So N processes share a folder's files, each made once (as
much faster as free cores allow: one process already keeps 1.1 cores busy, its encoder's threads);
a file whose token file is current (the source's size and time, the tokenizer and reader settings,
the checksum) is not made again. An error (a bad line, a missing column, a text not UTF-8) removes
the token files this process made in this call: a set is prepared whole or left as it was.

The set's index (SetIndex): once every file's token file is current, the set writes down each file's
source version, its token file's size and time and where its ids lie, in one small file beside the
token files (set-<digest>.index.json). A later start-up (every rank's, each restart's) that finds every
source and token file as written there checks nothing else and reads no token file's header: a BPE
token file's header holds the whole tokenizer.json (GPT-2's is 1.4 MB), so 1,000 of them were seconds
of every rank's start-up. Anything changed, and the files are checked one by one as before, and the
index written again.

Parquet needs pyarrow, an optional extra (`pip install 'mingpt-ddp[parquet]'`): it is Apache Arrow's
reference reader, the one Hugging Face datasets itself uses, reads a column a batch of rows at a time
(memory bounded by a row group, not the file) with every codec those files use; fastparquet needs
pandas, polars a query engine. Nothing else of the project needs it, so a set without Parquet files
does not either.
"""
import contextlib
import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterator, Optional

import numpy as np
from tokenizers import Tokenizer

from mingpt.common import files
from mingpt.common.errors import DataError
from mingpt.tokens import token_file
from mingpt.tokens.bpe_encoder import PIECE_BYTES, Encoder, cut_pieces, encode_pieces, line_cut, word_cut
from mingpt.tokens.shards import (
    AUTO,
    LAYOUT_FIELDS,
    SHARD_FORMATS,
    SUFFIX,
    glob_matches,
    remote_listing,
)
from mingpt.tokens.token_file import CHUNK_BYTES, PlainText, Report
from mingpt.tokens.tokenizer import BPE, END_OF_TEXT, TokenizerChoice, train_bpe

TXT, JSONL, PARQUET = ".txt", ".jsonl", ".parquet"
TEXT_SUFFIXES = (TXT, JSONL, PARQUET)
DOCUMENT_SUFFIXES = (JSONL, PARQUET)
DEFAULT_TEXT_FIELD = "text"
SAMPLE_FILES = 8
"""A set's BPE is trained on a sample of its first files (sorted by path), bpe_sample_mb in all."""
NEWLINE = "\n"
PARQUET_BATCH_ROWS = 1024
IDS_PER_CHUNK = 1 << 20
PYARROW = "pip install 'mingpt-ddp[parquet]' (or pip install pyarrow)"


# -------------------------------------------------------------------------------------- what a set is

def suffix(name: str) -> str:
    """A file's suffix, of a local path or a URL alike."""
    return PurePosixPath(name).suffix


def set_files(path: str, format: str, key: str) -> Optional[list[str]]:
    """The files of the set of texts that path names (local paths or URLs), in sorted path order;
    None when it names one text (as it always did) or shards (shards.py). Every refusal of the set's
    shape is here."""
    if format in SHARD_FORMATS:
        return None
    if files.is_remote(path):
        return remote_set_files(path, format, key)
    local = files.local_path(path)
    if os.path.isfile(local):
        return [local] if format == AUTO and suffix(local) in DOCUMENT_SUFFIXES else None
    folder = os.path.isdir(local)
    if folder:
        found = sorted(str(child) for child in Path(local).iterdir() if child.is_file())
    elif glob.has_magic(local):
        found = [str(match) for match in glob_matches(local, path, key)]
    else:
        return None  # no such file: the text's own error says so
    return texts_of(found, path, format, key, folder)


def remote_set_files(path: str, format: str, key: str) -> Optional[list[str]]:
    """A URL's set: a folder's files (the URL ends with "/") or a glob's ("*"; a "?" may be a query
    string's), listed in one request; a .jsonl or .parquet file is a set of one; else one text."""
    folder = path.endswith("/")
    if not (folder or "*" in path):
        return [path] if format == AUTO and suffix(path) in DOCUMENT_SUFFIXES else None
    found = remote_listing(f"{path}*" if folder else path, path, key)
    if not found and not folder:
        return None  # shards.py says that the glob matches nothing
    return texts_of(found, path, format, key, folder)


def texts_of(found: list[str], path: str, format: str, key: str, folder: bool) -> Optional[list[str]]:
    """The texts among a folder's or a glob's files; None for shards, which shards.py reads."""
    texts = [name for name in found if suffix(name) in TEXT_SUFFIXES]
    shards = [name for name in found if suffix(name) == SUFFIX]
    if texts and shards:
        raise DataError(f"{key}: {texts[0]} is neither an llm.c shard (no magic number) nor a {SUFFIX} file "
                        f"of nanoGPT's but a text, and {shards[0]} a shard: a set is of texts (.txt, .jsonl, "
                        ".parquet) or of shards (.bin), not both; give one kind")
    if texts:
        return texts
    if folder and not shards:
        raise DataError(f"{key}: the folder {path} holds no {SUFFIX} shards and no texts (.txt, .jsonl or "
                        ".parquet files); point it at a folder of either, or at a text")
    if format != AUTO:  # format=text: a folder or glob of no texts
        raise DataError(f"{key}: {path} names no texts (.txt, .jsonl or .parquet files) under "
                        "data_config.format=text; point it at texts, or use format=auto for shards")
    return None  # shards, or files of other kinds: shards.py reads or refuses them


@dataclass(frozen=True)
class TextSet:
    """A set's files and what makes their ids: the user's tokenizer choice and the documents' field."""

    key: str
    files: tuple
    choice: TokenizerChoice
    text_field: str = DEFAULT_TEXT_FIELD
    cache_dir: Optional[str] = None

    def tokenizer(self, make: bool) -> TokenizerChoice:
        """What makes every file's ids: the tokenizer.json given, the set's BPE (trained now when make
        and missing), the set's characters (counted now when make and not current), or a set of one
        file's own characters."""
        if self.choice.is_char and len(self.files) > 1:
            return TokenizerChoice(characters=set_characters(self, make))
        if self.choice.name != BPE:
            return self.choice
        path = self.tokenizer_path()
        if make:
            train_set_bpe(self, path)
        elif not path.exists():
            raise DataError(f"{self.key}: the set's BPE {path} is missing; prepare the data again "
                            "(python mingpt/prepare_data.py <data_config.path> --tokenizer bpe)")
        return TokenizerChoice(str(path))

    def tokenizer_path(self) -> Optional[Path]:
        """Where the set's own tokenizer is kept (None: a tokenizer.json given, or one file's characters):
        beside its first file (or in the cache folder, for a remote set). A BPE's is named by a digest
        of the settings and of the sampled files' versions; the characters', of the files' names."""
        if self.choice.is_char and len(self.files) > 1:
            made_from = {"files": [source_name(f) for f in self.files], "text_field": self.text_field,
                         "version": CHARACTERS_VERSION}
            name = "chars-{}.json"
        elif self.choice.name == BPE:
            sampled = self.files[:SAMPLE_FILES]
            made_from = {"settings": self.choice.settings(), "text_field": self.text_field,
                         "sample": [[source_name(f), token_file.fingerprint(f)] for f in sampled]}
            name = "bpe-{}.tokenizer.json"
        else:
            return None
        digest = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:16]
        folder = None if files.is_remote(self.files[0]) else Path(self.files[0]).parent
        if folder is None or not token_file.folder_is_writable(folder):
            folder = files.cache_folder(self.cache_dir)
        return folder / name.format(digest)

    def reader(self, source: str, tokenizer_json: Optional[str]) -> PlainText:
        """How a file of the set becomes text: as it is, or its documents, each ended by the
        tokenizer's end-of-text token or a newline."""
        if suffix(source) not in DOCUMENT_SUFFIXES:
            return SET_TEXT
        has_end = tokenizer_json is not None and \
            END_OF_TEXT in token_file.parsed_bpe(tokenizer_json)[0].get_vocab()
        kind = JsonLines if suffix(source) == JSONL else Parquet
        return kind(self.text_field, END_OF_TEXT if has_end else NEWLINE, self.key)

    def token_files(self, tokenizer: TokenizerChoice) -> list[Path]:
        return [token_file.token_file_for(f, self.cache_dir, tokenizer) for f in self.files]

    def index(self, tokenizer: TokenizerChoice) -> "SetIndex":
        return SetIndex(self, tokenizer)


def source_name(source: str) -> str:
    """A file's name whichever way it was reached: a local one resolved, a URL as it is."""
    return source if files.is_remote(source) else str(Path(source).resolve())


# -------------------------------------------------------------------------------------------- readers

_encoder: dict = {}
"""The last (tokenizer, dtype)'s Encoder of this process, its table of words kept from one file of a
set to the next: a fresh one spends about 0.1 s per file finding the same words again (half the time
of a 2 MB file). The files of a set share one Tokenizer object (token_file.parsed_bpe): it is the key."""


def shared_encoder(tokenizer: Tokenizer, config: dict, dtype: np.dtype) -> Encoder:
    if _encoder.get("tokenizer") is not tokenizer or _encoder.get("dtype") != np.dtype(dtype):
        _encoder.update(tokenizer=tokenizer, dtype=np.dtype(dtype), encoder=Encoder(tokenizer, config, dtype))
    return _encoder["encoder"]


class SetText(PlainText):
    """A text of a set: read as a single text is (the same token file), encoded with the process's
    shared Encoder."""

    def bpe_ids(self, source: str, tokenizer: Tokenizer, config: dict, dtype: np.dtype
                ) -> Iterator[np.ndarray]:
        return encode_pieces(tokenizer, config, self.texts(source), dtype,
                             shared_encoder(tokenizer, config, dtype))


SET_TEXT = SetText()

class Documents(SetText):
    """A file of documents, each ended by separator (END_OF_TEXT, as one token, or a newline)."""

    kind = ""

    def __init__(self, text_field: str, separator: str, key: str):
        self.text_field = text_field
        self.separator = separator
        self.key = key

    def settings(self) -> dict:
        return {"kind": self.kind, "text_field": self.text_field, "separator": self.separator}

    def documents(self, source: str) -> Iterator[str]:
        raise NotImplementedError

    def texts(self, source: str) -> Iterator[str]:
        """The documents, each followed by a newline, in chunks of about CHUNK_BYTES characters (the
        characters' passes; a BPE without an end-of-text token)."""
        batch, size = [], 0
        for document in self.documents(source):
            batch += [document, NEWLINE]
            size += len(document) + 1
            if size >= CHUNK_BYTES:
                yield "".join(batch)
                batch, size = [], 0
        if batch:
            yield "".join(batch)

    def bpe_ids(self, source: str, tokenizer: Tokenizer, config: dict, dtype: np.dtype
                ) -> Iterator[np.ndarray]:
        """Each document's ids on its own, then the end-of-text id, in chunks of about IDS_PER_CHUNK."""
        end = tokenizer.token_to_id(END_OF_TEXT) if self.separator == END_OF_TEXT else None
        if end is None:
            yield from super().bpe_ids(source, tokenizer, config, dtype)
            return
        encoder = shared_encoder(tokenizer, config, dtype)
        cut = word_cut if encoder.fast else line_cut
        ended = np.array([end], dtype)
        pending, count = [], 0
        for document in self.documents(source):
            for piece in cut_pieces([document.encode("utf-8")], PIECE_BYTES, cut):
                pending.append(encoder.encode(piece))
                count += len(pending[-1])
            pending.append(ended)
            count += 1
            if count >= IDS_PER_CHUNK:
                yield np.concatenate(pending)
                pending, count = [], 0
        if pending:
            yield np.concatenate(pending)

    def sample(self, source: str, sample_bytes: int) -> Iterator[str]:
        """The leading documents, about sample_bytes of them: a set's BPE trains on them."""
        taken = 0
        for document in self.documents(source):
            yield document
            taken += len(document)
            if taken >= sample_bytes:
                return


class JsonLines(Documents):
    kind = "jsonl"

    def documents(self, source: str) -> Iterator[str]:
        """The text_field of each line's object; blank lines are skipped, empty documents too."""
        with token_file.source_errors(source), files.open_file(source, "rb") as f:
            offset = 0
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{self.key}: {source} is not UTF-8 text ({e.reason} at byte "
                                    f"{offset + e.start}, line {number}); convert it to UTF-8") from None
                offset += len(raw)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.rstrip("\r\n"))  # a column counts within the line
                except ValueError as e:
                    raise DataError(f"{self.key}: {source} line {number} is not JSON ({e.msg}, column "
                                    f"{e.colno}); give one JSON object per line") from None
                text = record.get(self.text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise DataError(f"{self.key}: {source} line {number} "
                                    f"{self.what_is_there(record)}; set data_config.text_field to the field "
                                    "that holds the text")
                if text:
                    yield text

    def what_is_there(self, record: object) -> str:
        if not isinstance(record, dict):
            return f"is a JSON {type(record).__name__}, not an object with a \"{self.text_field}\" field"
        if self.text_field not in record:
            return f"has no \"{self.text_field}\" field (it has {', '.join(map(repr, list(record)[:5]))})"
        return f"has a {type(record[self.text_field]).__name__} as \"{self.text_field}\", not a string"


class Parquet(Documents):
    kind = "parquet"

    def documents(self, source: str) -> Iterator[str]:
        """The text column, a batch of rows at a time; null and empty documents are skipped."""
        with open_parquet(source, self.text_field, self.key) as parquet:
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[self.text_field]):
                for text in batch.column(0).to_pylist():
                    if text:
                        yield text


@contextlib.contextmanager
def open_parquet(source: str, text_field: str, key: str):
    """The Parquet file, opened (a remote one read in ranges through fsspec) and checked: pyarrow
    installed, a string column of that name."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{key}: {source} is Parquet, which needs pyarrow: {PYARROW}") from None
    with token_file.source_errors(source), files.open_file(source, "rb") as f:
        try:
            parquet = pq.ParquetFile(f)
        except OSError as e:
            raise DataError(f"{key}: {source} is not a readable Parquet file ({e}); check the file") from None
        check_text_column(parquet, source, text_field, key)
        yield parquet


def check_text_column(parquet, source: str, text_field: str, key: str) -> None:
    import pyarrow.types as types

    schema = parquet.schema_arrow
    if text_field not in schema.names:
        columns = ", ".join(schema.names[:8])
        raise DataError(f"{key}: {source} has no column \"{text_field}\" (its columns: {columns}); set "
                        "data_config.text_field to the column that holds the text")
    column = schema.field(text_field).type
    if not (types.is_string(column) or types.is_large_string(column)
            or getattr(types, "is_string_view", lambda _: False)(column)):
        raise DataError(f"{key}: {source}'s column \"{text_field}\" holds {column}, not strings; set "
                        "data_config.text_field to the column that holds the text")


# --------------------------------------------------------------------------------------- preparing

def train_set_bpe(text_set: TextSet, path: Path) -> None:
    """The set's BPE, trained once under path's lock (the other preparers wait, then find it), on
    bpe_sample_mb MB spread over its first files, with <|endoftext|> as a token; written atomically."""
    with files.locked(path):
        if path.exists():
            return
        sampled = text_set.files[:SAMPLE_FILES]
        share = max(text_set.choice.sample_bytes // len(sampled), 1)
        texts = (text for source in sampled for text in sample_texts(text_set, source, share))
        tokenizer_json = train_bpe(texts, text_set.choice.vocab_size, special_tokens=[END_OF_TEXT]).to_str()
        files.write_atomically(str(path), lambda out: out.write(tokenizer_json.encode()))


def sample_texts(text_set: TextSet, source: str, sample_bytes: int) -> Iterator[str]:
    """A file's share of the BPE's sample: windows spread over a text, a documents file's first ones."""
    reader = text_set.reader(source, None)
    if isinstance(reader, Documents):
        return reader.sample(source, sample_bytes)
    size = token_file.fingerprint(source)["size"]
    return token_file.bpe_sample(source, size, sample_bytes) if size else iter(())


CHARACTERS_VERSION = 1


def set_characters(text_set: TextSet, make: bool) -> str:
    """The set's characters, sorted: the union of its files' (each file's read through its reader, so
    a documents file's newlines count). make: counted now, by one process under the record's lock
    while the others wait, for the files whose version the record lacks; else as recorded."""
    path = text_set.tokenizer_path()
    if not make:
        recorded = read_characters(path)
        if recorded is None:
            raise DataError(f"{text_set.key}: the set's characters {path} are missing; prepare the data "
                            "again (python mingpt/prepare_data.py <data_config.path>)")
        return recorded["characters"]
    versions = [token_file.fingerprint(source) for source in text_set.files]
    recorded = read_characters(path)
    if recorded is None or [entry[0] for entry in recorded["files"]] != versions:
        with files.locked(path):
            recorded = count_characters(text_set, path, versions)
    return recorded["characters"]


def count_characters(text_set: TextSet, path: Path, versions: list[dict]) -> dict:
    """With the record's lock held: each file's characters (as recorded, for a file of the recorded
    version; counted now otherwise), their union, written atomically when anything changed."""
    recorded = read_characters(path)
    before = recorded["files"] if recorded is not None else []  # of the same files, in the same order
    entries = []
    for index, (source, version) in enumerate(zip(text_set.files, versions)):
        chars = before[index][1] if index < len(before) and before[index][0] == version else None
        if chars is None:
            counts = token_file.count_codepoints(source, text_set.reader(source, None))
            chars = "".join(map(chr, np.flatnonzero(counts).tolist()))
        entries.append([version, chars])
    union = "".join(sorted(set("".join(chars for _, chars in entries))))
    if not union:
        raise token_file.empty_text(text_set.files[0])
    record = {"version": CHARACTERS_VERSION, "characters": union, "files": entries}
    if record != recorded:
        text = json.dumps(record, ensure_ascii=False)
        files.write_atomically(str(path), lambda out: out.write(text.encode("utf-8")))
    return record


def read_characters(path: Path) -> Optional[dict]:
    """The set's record of its characters; None when missing or damaged."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and record.get("version") == CHARACTERS_VERSION and \
        isinstance(record.get("characters"), str) and isinstance(record.get("files"), list) and \
        all(isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str)
            for entry in record["files"])
    return record if ok else None


def prepare_set(text_set: TextSet, report: Optional[Report] = None) -> list[Path]:
    """Every file's token file, made by this process or another one of the machine (see the module's
    docstring), current when this returns; its paths, in the set's order."""
    own_tokenizer = text_set.tokenizer_path()  # a BPE or characters made now are rolled back too
    was_there = own_tokenizer is not None and own_tokenizer.exists()
    tokenizer = text_set.tokenizer(make=True)
    index = text_set.index(tokenizer)
    if index.layouts() is not None:
        for source, path in zip(text_set.files, index.token_files):
            tell(report, source, path, False, [])
        return index.token_files
    tokenizer_json = None if tokenizer.is_char else tokenizer.file.json
    readers = [text_set.reader(f, tokenizer_json) for f in text_set.files]
    for source, reader in zip(text_set.files, readers):  # what can be checked cheaply, before any is made
        if isinstance(reader, Parquet):
            with open_parquet(source, reader.text_field, text_set.key):
                pass
    made: list[Path] = []
    try:
        members = [(source, reader, "") for source, reader in zip(text_set.files, readers)]
        token_file.prepare_in_turn(members, text_set.cache_dir, tokenizer,
                                   lambda source, path, now: tell(report, source, path, now, made))
        index.write()
    except DataError:
        for path in made + ([own_tokenizer] if own_tokenizer is not None and not was_there else []):
            for leftover in (path, Path(f"{path}.lock")):
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
        raise
    return index.token_files


def tell(report: Optional[Report], source: str, path: Path, now: bool, made: list[Path]) -> None:
    if now:
        made.append(path)
    if report is not None:
        report(source, path, now)


# ------------------------------------------------------------------------------------- the set's index

INDEX_VERSION = 1


class SetIndex:
    """The set's index (see the module's docstring): beside its first token file, named by a digest
    of the set's files and the settings that make their ids."""

    def __init__(self, text_set: TextSet, tokenizer: TokenizerChoice):
        self.text_set = text_set
        self.token_files = text_set.token_files(tokenizer)
        made_by = {"files": [source_name(f) for f in text_set.files], "tokenizer": tokenizer.settings(),
                   "text_field": text_set.text_field, "version": INDEX_VERSION}
        digest = hashlib.sha256(json.dumps(made_by, sort_keys=True).encode()).hexdigest()[:16]
        self.path = self.token_files[0].parent / f"set-{digest}.index.json"

    def layouts(self) -> Optional[list[dict]]:
        """Where each token file's ids lie, when the index is there and every source and token file
        is as it says; None otherwise (missing, damaged, or anything changed)."""
        try:
            entries = json.loads(self.path.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(entries, list) or len(entries) != len(self.token_files):
            return None
        for entry, source, path in zip(entries, self.text_set.files, self.token_files):
            if not isinstance(entry, dict) or entry.get("token_file") != token_file_version(path) or \
                    entry.get("source") != token_file.fingerprint(source):
                return None
        return [{field: entry[field] for field in LAYOUT_FIELDS} for entry in entries]

    def write(self) -> None:
        """Written by whoever finds every token file current and the index not (all such writers
        write the same)."""
        if self.layouts() is not None:
            return
        entries = []
        for source, path in zip(self.text_set.files, self.token_files):
            header = token_file.read_header(path)
            entries.append({"source": header["fingerprint"], "token_file": token_file_version(path),
                            **{field: header[field] for field in LAYOUT_FIELDS}})
        text = json.dumps({"version": INDEX_VERSION, "files": entries})
        if token_file.folder_is_writable(self.path.parent):
            files.write_atomically(str(self.path), lambda out: out.write(text.encode()))


def token_file_version(path: Path) -> Optional[list[int]]:
    """A token file's size and time: another version of it (made again) has others."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return [stat.st_size, stat.st_mtime_ns]
