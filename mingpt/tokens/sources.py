"""What a data path names, decided once, and each kind of data behind one small interface.

`data_config.path` (and `val_path`) names one of four kinds of data. source_of decides which, here
and nowhere else, and each kind is a class with the same two steps (DataSource), as each snapshot
store is one class with the Checkpointer's interface (storage/store.py):

    kind          what the path is                                  prepared on each machine by
    OneText       a text: one token file (token_file.py)            its local rank 0 (the others wait)
    TextInRanges  a text over 256 MB under a BPE, a token file      every process, each taking the
                  per range, read as one stream (text_ranges.py)    ranges no other holds
    SetOfTexts    a folder or glob of texts, JSON lines, Parquet:   every process, each taking the
                  a token file each, one stream (text_set.py)       files no other holds
    Shards        llm.c's or nanoGPT's pre-tokenized shards, read   nobody: read as they lie, their
                  as they lie (shards.py)                           headers checked when opened

`prepare` makes what reading needs on this machine; `open`, once every process of the machine has
prepared, gives the ids (a token file's array, or a stream of several files) and the Vocabulary they
are of: what CharDataset maps into windows. A new kind is a class with these two methods, in this
module, and a line in source_of.
"""
from dataclasses import dataclass
from typing import Optional, Protocol, Union

import numpy as np

from mingpt.common import files
from mingpt.common.errors import DataError, check, check_choice, check_positive
from mingpt.tokens import token_file
from mingpt.tokens.shard_cache import FOLDER as SHARD_CACHE_FOLDER
from mingpt.tokens.shard_cache import ShardCache
from mingpt.tokens.shards import AUTO, FORMATS, ShardStream, names_shards, open_shards, open_token_files
from mingpt.tokens.text_ranges import is_ranged, open_ranges, prepare_ranges
from mingpt.tokens.text_set import DEFAULT_TEXT_FIELD, TextSet, prepare_set, set_files
from mingpt.tokens.token_file import Report
from mingpt.tokens.tokenizer import TokenizerChoice, Vocabulary

PATH_KEY, VAL_PATH_KEY = "data_config.path", "data_config.val_path"


@dataclass(frozen=True)
class SourceSettings:
    """What data_config says of how its paths are read (DataConfig.sources): the slice of it this
    layer sees."""

    tokenizer: TokenizerChoice = TokenizerChoice()
    format: str = AUTO
    text_field: str = DEFAULT_TEXT_FIELD
    cache_dir: Optional[str] = None
    shards_at_once: int = 0
    """data_config.shards_at_once, null already resolved by data_config.path."""
    shard_cache_gb: float = 10.0

    def __post_init__(self) -> None:
        check_choice(self, "data_config", "format", FORMATS)
        check(bool(self.text_field), "data_config.text_field",
              "must not be empty; name the JSON field (or Parquet column) that holds the text")
        check(self.shards_at_once >= 0, "data_config.shards_at_once",
              f"must be 0 (off), more, or null (the path decides), got {self.shards_at_once}")
        check_positive(self, "data_config", "shard_cache_gb")


@dataclass(frozen=True)
class TokenIds:
    """A prepared source as the dataset reads it."""

    ids: Union[np.ndarray, ShardStream]
    """A token file's ids, memory-mapped; or several files' as one stream (shards, a set's token files,
    a text's ranges), whose describe() start-up prints ("3 text shards")."""
    vocabulary: Vocabulary


class DataSource(Protocol):
    """What a data path is to the rest of the project: made ready on each machine, then read."""

    key: str
    """The config key that names it (PATH_KEY or VAL_PATH_KEY), for errors."""

    def prepare(self, local_main: bool, report: Optional[Report] = None) -> None:
        """Make what reading it needs on this machine. Every process of the machine calls it, then
        waits for the others; local_main: this one is the machine's local rank 0 (kinds made by one
        process are made by it, while the others do nothing). report: told of each token file this
        process is done with (prepare_data.py's lines and progress bar)."""

    def open(self) -> TokenIds:
        """Its ids and their vocabulary, after every process of the machine has prepared it."""


def source_of(path: str, key: str, settings: SourceSettings) -> DataSource:
    """The kind of data a path names: a set of texts (text_set.set_files: a folder or glob of texts,
    a .jsonl or .parquet file), shards (shards.names_shards: a .bin file, a folder or glob of them),
    or one text, in ranges when it is large and under a BPE. Every refusal of its shape is said here,
    before anything is made."""
    found = set_files(path, settings.format, key)
    if found is not None:
        tokenizer = text_tokenizer(key, settings.tokenizer)
        return SetOfTexts(TextSet(key, tuple(found), tokenizer, settings.text_field, settings.cache_dir))
    if names_shards(path, settings.format):
        return Shards(path, key, settings)
    tokenizer = text_tokenizer(key, settings.tokenizer)
    kind = TextInRanges if is_ranged(path, tokenizer) else OneText
    return kind(path, key, tokenizer, settings.cache_dir)


def text_tokenizer(key: str, choice: TokenizerChoice) -> TokenizerChoice:
    """What makes a text's ids: data_config.tokenizer; for a val_path text, a tokenizer.json only
    (characters, or a BPE trained on the text, would give it a vocabulary of its own, not path's)."""
    if key == VAL_PATH_KEY and choice.file is None:
        raise DataError(f"{key}: a text of its own needs data_config.tokenizer set to a tokenizer.json (with "
                        f"{choice.name}, each text would have a vocabulary of its own)")
    return choice


# ------------------------------------------------------------------------------------------- texts

@dataclass(frozen=True)
class OneText:
    """A text, made into one token file per machine by its local rank 0 while the others wait."""

    path: str
    key: str
    tokenizer: TokenizerChoice
    cache_dir: Optional[str] = None

    def prepare(self, local_main: bool, report: Optional[Report] = None) -> None:
        if local_main:
            path, now = token_file.prepare(self.path, self.cache_dir, self.tokenizer)
            if report is not None:
                report(self.path, path, now)

    def open(self) -> TokenIds:
        path = token_file.token_file_for(self.path, self.cache_dir, self.tokenizer)
        tokens = token_file.open_token_file(path)
        if tokens.settings != self.tokenizer.settings():  # another run, of other settings, made it meanwhile
            raise DataError(f"token file {tokens.path} was made again by another run, for other tokenizer "
                            "settings; run one tokenizer setting per text at a time, then start again")
        return of_token_file(tokens)


def of_token_file(tokens: token_file.TokenFile) -> TokenIds:
    return TokenIds(tokens.ids, Vocabulary.kept(tokens.vocab, tokens.tokenizer))


@dataclass(frozen=True)
class TextInRanges:
    """A text over RANGE_BYTES under a BPE: its ranges made by every process of the machine, each
    taking those no other holds (text_ranges.py), read one after the other as one stream."""

    path: str
    key: str
    tokenizer: TokenizerChoice
    cache_dir: Optional[str] = None

    def prepare(self, local_main: bool, report: Optional[Report] = None) -> None:
        prepare_ranges(self.path, self.cache_dir, self.tokenizer, report)

    def open(self) -> TokenIds:
        stream, tokenizer = open_ranges(self.path, self.cache_dir, self.tokenizer, self.key)
        return TokenIds(stream, Vocabulary.made_by(tokenizer))


@dataclass(frozen=True)
class SetOfTexts:
    """A set of texts: a token file each, made by every process of the machine in turn, read as one
    stream of the set's one vocabulary (text_set.py); a set of one file is that file's token file."""

    texts: TextSet

    @property
    def key(self) -> str:
        return self.texts.key

    def prepare(self, local_main: bool, report: Optional[Report] = None) -> None:
        prepare_set(self.texts, report)

    def open(self) -> TokenIds:
        tokenizer = self.texts.tokenizer(make=False)
        index = self.texts.index(tokenizer)
        if len(index.token_files) == 1:
            return of_token_file(token_file.open_token_file(index.token_files[0]))
        stream = open_token_files(index.token_files, self.key, tokenizer.settings(), index.layouts())
        return TokenIds(stream, Vocabulary.made_by(tokenizer))


# ------------------------------------------------------------------------------------------ shards

@dataclass(frozen=True)
class Shards:
    """Pre-tokenized shards, read as they lie: nothing to prepare; opening checks their headers (a
    small set's ids too) and, for remote ones, that the cache folder holds what is read at once."""

    path: str
    key: str
    settings: SourceSettings

    def prepare(self, local_main: bool, report: Optional[Report] = None) -> None:
        pass

    def open(self) -> TokenIds:
        vocabulary = shards_vocabulary(self.settings.tokenizer)
        stream = self.stream(len(vocabulary))
        check_cache_holds(stream, self.settings.shards_at_once, whole=self.key == VAL_PATH_KEY)
        return TokenIds(stream, vocabulary)

    def stream(self, vocab_size: Optional[int]) -> ShardStream:
        """The shards as one stream, ids from vocab_size on refused (None: not checked)."""
        return open_shards(self.path, self.settings.format, vocab_size, self.key, self.cache())

    def cache(self) -> Optional[ShardCache]:
        """Where remote shards' copies go on this machine (None for shards on it)."""
        if not files.is_remote(self.path):
            return None
        return ShardCache(files.cache_folder(self.settings.cache_dir) / SHARD_CACHE_FOLDER,
                          int(self.settings.shard_cache_gb * 1e9), self.key)


def shards_vocabulary(choice: TokenizerChoice) -> Vocabulary:
    """Shards hold ids, not text: their vocabulary is the tokenizer.json that made them."""
    if choice.file is None:
        raise DataError(f"data_config.tokenizer: pre-tokenized shards hold token ids, and {choice.name} "
                        "would make a vocabulary of a text; set data_config.tokenizer to the tokenizer.json "
                        "that made the shards (GPT-2's for llm.c's FineWeb shards)")
    return Vocabulary.made_by(choice)


def check_cache_holds(stream: ShardStream, shards_at_once: int, whole: bool) -> None:
    """The cache must hold the group of shards being read and the next one, fetched ahead; or, for
    val_path's (whole), every shard: evaluation reads them in any order."""
    if stream.cache is None:
        return
    check(shards_at_once > 0, "data_config.shards_at_once",
          "remote shards are read a few at a time (the whole set's order would fetch a shard for every "
          "window); set it to 1 or more, or null (2)")
    if whole:
        total = sum(shard.file_bytes for shard in stream.shards)
        check(stream.cache.capacity_bytes >= total, "data_config.shard_cache_gb",
              f"{stream.cache.capacity_bytes / 1e9:g} GB cannot hold val_path's {len(stream.shards)} remote "
              f"shards ({total / 1e9:.3g} GB), which evaluation reads in any order; raise it, or give fewer "
              "or local validation shards")
        return
    at_once, largest = 2 * shards_at_once, max(shard.file_bytes for shard in stream.shards)
    check(stream.cache.capacity_bytes >= at_once * largest, "data_config.shard_cache_gb",
          f"{stream.cache.capacity_bytes / 1e9:g} GB holds fewer than the {at_once} shards of up to "
          f"{largest / 1e9:.3g} GB that are read and fetched ahead at once (2 x data_config.shards_at_once); "
          f"raise it to at least {at_once * largest / 1e9:.3g}")


# ---------------------------------------------------------------------------------------- too short

def too_short(source: DataSource, path: str, ids, unit: str, block_size: int, truncate: float) -> DataError:
    """No window fits: block_size + 1 tokens are more than the kept ids (an array or a stream) hold."""
    if not isinstance(ids, ShardStream) and source.key == PATH_KEY:  # a text's own words, as always
        return DataError(
            f"data_config.block_size={block_size} is not smaller than the text "
            f"({len(ids)} {unit} after truncate={truncate}); "
            "lower data_config.block_size or raise data_config.truncate"
        )
    shards = f"{ids.describe()}, " if isinstance(ids, ShardStream) else ""
    kept = f" after truncate={truncate}" if truncate < 1 else ""
    return DataError(f"{source.key}: {path} ({shards}{len(ids):,} {unit}{kept}) is too short for "
                     f"one window of data_config.block_size={block_size} + 1 {unit}; lower "
                     "data_config.block_size or give more data")
