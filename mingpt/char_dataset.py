"""Character-level text data: a token file made once per machine, memory-mapped by every rank.

Every position of the text starts a sample (the original's choice): sample i is
x = text[i : i + block_size], y = text[i + 1 : i + block_size + 1]. The text is encoded once, in a
streaming pass, into a token file (prepare_data.py) that every process of a machine maps, so memory
does not grow with the corpus and ranks share one copy through the page cache.

With data_config.tokenizer set to a byte-level BPE (tokens/tokenizer.py) the same holds of its
tokens: a sample is block_size tokens, and "characters" below reads "tokens". Pre-tokenized shards
(llm.c's, nanoGPT's: tokens/shards.py) are read as they lie, with no token file: their stream of ids
stands where a token file's ids do.
"""
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from mingpt.common import files
from mingpt.common.errors import DataError, check, check_choice, check_positive
from mingpt.tokens.permutation import Blocks, Permutation
from mingpt.tokens.shard_cache import FOLDER as SHARD_CACHE_FOLDER
from mingpt.tokens.shard_cache import ShardCache
from mingpt.tokens.shards import AUTO, FORMATS, ShardStream, names_shards, open_shards
from mingpt.tokens.text_ranges import is_ranged, open_ranges, prepare_ranges
from mingpt.tokens.text_set import DEFAULT_TEXT_FIELD, TextSet, open_set, prepare_set, set_files
from mingpt.tokens.token_file import TokenFile, encode_text, open_token_file, prepare, token_file_for
from mingpt.tokens.tokenizer import (
    DEFAULT_SAMPLE_MB,
    DEFAULT_VOCAB_SIZE,
    TokenizerChoice,
    Vocabulary,
    check_settings,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = REPO_ROOT / "data" / "input.txt"
"""tiny-shakespeare, committed as the original commits it: the default trains with no network."""

SPLITS = ("random", "contiguous")
PATH_KEY, VAL_PATH_KEY = "data_config.path", "data_config.val_path"


@dataclass
class DataConfig:
    path: str = str(DEFAULT_CORPUS)
    """A local path or any fsspec URL (s3://, gs://, https://, ...) of a UTF-8 text file; or
    pre-tokenized shards (data_config.format): a .bin file, a folder of them or a glob
    ('fineweb10B/fineweb_train_*.bin', quoted), read in sorted path order as one stream; or a set of
    texts: a folder or a glob of .txt, .jsonl and .parquet files (a .jsonl or .parquet file alone is a
    set of one), each prepared once into a token file of its own and read in sorted path order as one
    stream. Each of these locally or behind a URL (a folder's URL ends with "/")."""
    block_size: int = 128
    """Characters of context per sample."""
    train_split: float = 0.9
    """Share of the samples (random) or of the text (contiguous) used for training; not used with
    data_config.val_path."""
    truncate: float = 1.0
    """Keep only this leading share of the text. gpt2_train_cfg.yaml sets the original's 0.05, made
    for tiny-shakespeare (`python main.py` trains on 5% of it, as the original did); a run on
    another text says how much of it the share keeps. 1.0: the whole text (a DataConfig's default).
    Of data_config.path only: data_config.val_path is read whole."""
    cache_dir: Optional[str] = None
    """Where token files are kept for texts behind fsspec URLs (s3://...) or in read-only folders
    (a local text's own folder otherwise); default $MINGPT_CACHE_DIR or ~/.cache/mingpt-ddp."""
    split: str = "random"
    """'random': the original's split of overlapping windows (test windows share characters with
    training windows, so the test loss is not held out). 'contiguous': the first train_split of
    the text trains, the rest tests, with no character in both: the honest held-out measure. Not used
    with data_config.val_path."""
    tokenizer: str = "char"
    """char: one token per character (the original's). bpe: a byte-level BPE (GPT-2's kind) trained
    on this text, kept with its token file. Or the path (local or fsspec URL) of a byte-level BPE's
    tokenizer.json (GPT-2's, or any in the Hugging Face tokenizers format): nothing is downloaded.
    With gpt_config.init_from, the model folder's tokenizer.json is used (leave this at char).
    Pre-tokenized shards, and a val_path, need the tokenizer.json that made them (GPT-2's for llm.c's
    FineWeb shards)."""
    bpe_vocab_size: int = DEFAULT_VOCAB_SIZE
    """tokenizer=bpe: at most this many tokens, the 256 byte tokens included (a small text may
    give fewer merges)."""
    bpe_sample_mb: float = DEFAULT_SAMPLE_MB
    """tokenizer=bpe: train it on this many MB of the text, in 64 windows spread evenly over it
    (all of it if smaller): a few MB settle a few thousand merges, and training reads about 2 MB/s."""
    format: str = AUTO
    """What path (and val_path) hold. auto: a text, as always, unless the path is a .bin file, a
    folder or a glob: then shards, each file recognised by its header (llm.c's magic number) or else
    read as nanoGPT's. text: a UTF-8 text whatever its name. llmc: llm.c's and modded-nanogpt's shards
    (FineWeb's fineweb_train_*.bin: a 1,024-byte header, then uint16 ids). nanogpt: nanoGPT
    prepare.py's train.bin and val.bin (uint16 ids, no header). Shards are read as they lie: nothing is
    prepared; their stream is continuous, so a window may straddle two shards. A folder or glob of
    texts (.txt, .jsonl, .parquet: by their suffixes, under auto or text) is a set of texts."""
    text_field: str = DEFAULT_TEXT_FIELD
    """A set of texts: the field of each JSON line (.jsonl), and the column of a Parquet file, that
    holds a document's text. Each document is ended by the tokenizer's <|endoftext|> (a newline for
    characters, or a tokenizer.json without it). Parquet needs pyarrow (pip install 'mingpt-ddp[parquet]')."""
    val_path: Optional[str] = None
    """The evaluation's own data, in path's forms (shards, a folder or glob of them, or a text, of
    data_config.format), as FineWeb (fineweb_val_*.bin) and nanoGPT (val.bin) ship it: training then
    uses all of path's windows and evaluation all of val_path's, and train_split and split do not
    apply. Needs data_config.tokenizer set to a tokenizer.json. null: the test split is cut from path."""
    shards_at_once: Optional[int] = None
    """Shards that training reads at a time, for shards trained whole (val_path set) or cut with
    split=contiguous: an epoch visits path's shards in a seeded order, this many together, their
    windows shuffled among themselves, while the next ones are read ahead, so that reads stay within
    a few shards instead of scattering over the whole set; its samples are then consecutive windows
    (llm.c's: an epoch is one pass over the tokens), since the windows at every position would hold
    a run in its first shards for block_size passes. 0: a window at every position of the set, in
    one shuffled order (nanoGPT's random offsets). null: 2 for remote shards (which need it), 0 for
    shards on this machine."""
    shard_cache_gb: float = 10.0
    """Remote shards (path an s3://... URL or glob of them): the most disk that their copies on
    this machine take, in the cache folder (data_config.cache_dir), shared by its ranks; the least
    recently used are deleted first. It must hold twice shards_at_once shards (the group being read
    and the next, fetched ahead): FineWeb's are 200 MB."""

    def __post_init__(self) -> None:
        check_positive(self, "data_config", "block_size")
        check(self.shards_at_once is None or self.shards_at_once >= 0, "data_config.shards_at_once",
              f"must be 0 (off), more, or null (the path decides), got {self.shards_at_once}")
        check_positive(self, "data_config", "shard_cache_gb")
        check_settings(self.tokenizer, self.bpe_vocab_size, self.bpe_sample_mb)
        check(0.0 < self.train_split < 1.0, "data_config.train_split",
              f"must be between 0 and 1 (exclusive), got {self.train_split}")
        check(0.0 < self.truncate <= 1.0, "data_config.truncate",
              f"must be in (0, 1], got {self.truncate}")
        check_choice(self, "data_config", "split", SPLITS)
        check_choice(self, "data_config", "format", FORMATS)
        check(bool(self.text_field), "data_config.text_field",
              "must not be empty; name the JSON field (or Parquet column) that holds the text")
        check(self.val_path is None or bool(self.val_path), VAL_PATH_KEY,
              "must not be empty; give shards or a text, or null to cut the test split from path")

    @property
    def reading_shards_at_once(self) -> int:
        """shards_at_once, or what null means for path: 2 for remote shards, 0 otherwise."""
        if self.shards_at_once is not None:
            return self.shards_at_once
        return 2 if files.is_remote(self.path) else 0

    @functools.cached_property
    def tokenizer_choice(self) -> TokenizerChoice:
        """Made once: a tokenizer.json is read when first asked for (path's data, then val_path's)."""
        return TokenizerChoice.of(self.tokenizer, self.bpe_vocab_size, self.bpe_sample_mb)


class CharDataset(Dataset):
    """The text as token ids (a memory-mapped token file, or an array for a text in memory).

    Sample i is the window starting at character i; `dataset[starts]` with a tensor of starts gives
    a whole batch at once, gathered from the ids in one indexing operation.
    """

    def __init__(self, text: str, block_size: int):
        """A text already in memory (tests, benchmarks): encoded as a token file would be."""
        ids, vocab = encode_text(text)
        self._setup(ids, vocab, block_size, whole_text=True)

    @classmethod
    def from_token_file(cls, tokens: TokenFile, block_size: int, truncate: float = 1.0) -> "CharDataset":
        """The leading `truncate` share of a prepared token file (see from_ids)."""
        return cls.from_ids(tokens.ids, Vocabulary.kept(tokens.vocab, tokens.tokenizer), block_size, truncate)

    @classmethod
    def from_ids(cls, ids, vocabulary: Vocabulary, block_size: int, truncate: float = 1.0) -> "CharDataset":
        """The leading `truncate` share of a text's ids (a token file's array, or a ShardStream), with
        the vocabulary of that share (of characters; a BPE's vocabulary is its tokenizer's, whatever
        share is kept)."""
        dataset = cls.__new__(cls)
        length = int(len(ids) * truncate)
        dataset._setup(ids[:length], vocabulary.tokens, block_size,
                       whole_text=length == len(ids) or not vocabulary.is_char, vocabulary=vocabulary)
        dataset.text_length = len(ids)
        return dataset

    def _setup(self, ids: np.ndarray, vocab: list[str], block_size: int, whole_text: bool,
               vocabulary: Optional[Vocabulary] = None) -> None:
        self.block_size = block_size
        self.ids = ids
        self.stride = 1
        """Tokens from one sample's window to the next: 1, a window at every position (the original's);
        block_size, consecutive windows (shards read a few at a time: in_consecutive_windows)."""
        self.text_length = len(ids)
        """Tokens in the whole text, before data_config.truncate kept its leading share (ids)."""
        self._id_map: Optional[np.ndarray] = None
        self.vocabulary = vocabulary or Vocabulary(vocab)
        """The tokens and how text becomes them: what a snapshot keeps to decode the model's output."""
        if not whole_text:
            # A truncated text may lack some of the whole text's characters. Its vocabulary is its
            # own (the original's: the characters it trains on), reached through a small table.
            present = np.flatnonzero(count_ids(ids, len(vocab)))
            if len(present) < len(vocab):
                self._id_map = np.full(len(vocab), -1, dtype=np.int64)
                self._id_map[present] = np.arange(len(present))
                vocab = [vocab[i] for i in present]
                self.vocabulary = Vocabulary(vocab)
        self.vocab: list[str] = vocab

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def shards(self) -> Optional[ShardStream]:
        """The pre-tokenized shards the ids are read from; None for a text."""
        return self.ids if isinstance(self.ids, ShardStream) else None

    @property
    def num_chars(self) -> int:
        return len(self.ids)

    def __len__(self) -> int:
        return self.samples_before(len(self.ids))

    def in_consecutive_windows(self) -> None:
        """From now on sample i is the window at i * block_size (a window's last token, its last
        target, is the next one's first input): an epoch is one pass over the tokens."""
        self.stride = self.block_size

    def samples_before(self, position: int) -> int:
        """Samples whose window (block_size + 1 tokens) ends at or before a position of the ids."""
        return max((position - self.block_size - 1) // self.stride + 1, 0)

    def first_sample_from(self, position: int) -> int:
        """The first sample whose window starts at or after a position of the ids."""
        return -(-position // self.stride)

    def __getitem__(self, samples) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y of each sample's window (an int gives one sample, a tensor a batch)."""
        return inputs_and_targets(self.windows(samples))

    def windows(self, samples) -> torch.Tensor:
        """The block_size + 1 token ids of each sample's window, in one contiguous (..., T + 1) tensor."""
        samples = np.asarray(samples, dtype=np.int64)
        if samples.size and (samples.min() < 0 or samples.max() >= len(self)):
            raise IndexError(f"sample index outside 0..{len(self) - 1}")
        return self.token_ids((samples * self.stride)[..., None] + np.arange(self.block_size + 1))

    def token_ids(self, positions) -> torch.Tensor:
        """Token ids (int64) of the text at these character positions."""
        ids = self.ids[positions]
        return torch.from_numpy((self._id_map[ids] if self._id_map is not None else ids).astype(np.int64))

    @property
    def kept(self) -> str:
        """How much of the text trains and tests: "55,769 characters", or what truncate dropped."""
        kept = f"{self.num_chars:,} {self.unit}"
        if self.num_chars == self.text_length:
            return kept
        share = self.num_chars / self.text_length
        return f"{kept} (the first {share:.0%} of its {self.text_length:,}: data_config.truncate)"

    @property
    def unit(self) -> str:
        """What a token is, for what the user reads."""
        return "characters" if self.vocabulary.is_char else "tokens"

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self.vocabulary.encode(text), dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return self.vocabulary.decode(ids.tolist())


def inputs_and_targets(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x and y of a window (or a batch of them): two overlapping views of its memory, y shifted by
    one token. A batch moves to a GPU as its windows, one contiguous (pinned) tensor and therefore
    one asynchronous copy, and is split on the device; x and y moved apart would each be a strided
    view, copied through a pageable temporary, twice."""
    return windows[..., :-1], windows[..., 1:]


def batch_on(device: torch.device, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch from the loaders as inputs and targets on device: its windows in one copy, or the
    (x, y) pair of a dataset of another kind."""
    if isinstance(batch, torch.Tensor):
        return inputs_and_targets(batch.to(device, non_blocking=True))
    return tuple(t.to(device, non_blocking=True) for t in batch)


def count_ids(ids: np.ndarray, vocab_size: int, chunk: int = 1 << 24) -> np.ndarray:
    """How often each id occurs, a chunk at a time (bincount copies its input as int64)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for first in range(0, len(ids), chunk):
        counts += np.bincount(ids[first:first + chunk], minlength=vocab_size)
    return counts


class Split(Dataset):
    """A share of a dataset's samples. Sample i of the split is window `start(i)` of the text: an
    offset for the contiguous split, a position of a seeded permutation for the random one. No
    list of indices is ever built."""

    def __init__(self, dataset: CharDataset, first: int, length: int, order: Optional[Permutation] = None,
                 shards_at_once: int = 0):
        self.dataset = dataset
        self.first = first
        self.length = length
        self.order = order
        self.shards_at_once = shards_at_once
        """Of a dataset of shards: how many shards training reads at a time (blocks()); 0: any order."""

    def blocks(self) -> Optional[Blocks]:
        """The split's samples as runs that start in one shard, to be read shards_at_once shards at
        a time (data_loader.py); None for a text, or when the split has an order of its own."""
        shards = self.dataset.shards
        if shards is None or self.order is not None or not self.shards_at_once:
            return None
        first_samples = -(-shards.starts // self.dataset.stride)  # of the windows that start in each shard
        edges = np.clip(first_samples, self.first, self.first + self.length) - self.first
        return Blocks(np.diff(edges).tolist(), self.shards_at_once, warm=shards.read_ahead)

    def __len__(self) -> int:
        return self.length

    def starts(self, indices) -> torch.Tensor:
        """The dataset's sample (window start) for each of the split's indices."""
        positions = torch.as_tensor(indices, dtype=torch.int64) + self.first
        return self.order(positions) if self.order is not None else positions

    def __getitem__(self, indices) -> torch.Tensor:
        """The windows of the split's samples at indices (see inputs_and_targets)."""
        return self.dataset.windows(self.starts(indices).numpy())

    def spread(self, count: int) -> Optional["Spread"]:
        """At most `count` of the split's windows for a bounded evaluation (Spread); None for a split in
        an order of its own (the random split's permutation of overlapping windows, where a seeded
        subset of that order is as fair a sample)."""
        return Spread(self, count) if self.order is None else None


class Spread(Dataset):
    """At most `count` windows of a split of consecutive windows (a val_path, the contiguous split's
    test side) that do not overlap, block_size tokens apart as llm.c's validation reads them, spread
    evenly over the whole split: a bounded evaluation sees all of the text, not its beginning, and no
    token is a target twice. They depend on the count alone, in this order, which the loaders deal out
    as they deal any order: the same windows at every evaluation and at any world size."""

    def __init__(self, split: Split, count: int):
        self.split = split
        self.step = max(split.dataset.block_size // split.dataset.stride, 1)
        """Samples of the split from a window to the first that does not overlap it (1 for consecutive
        windows already)."""
        self.candidates = (len(split) - 1) // self.step + 1
        """The split's windows that do not overlap, from its first on."""
        self.length = min(count, self.candidates)

    def __len__(self) -> int:
        return self.length

    def starts(self, indices) -> torch.Tensor:
        """The dataset's sample (window start) of the nth of `length` evenly spaced candidates, for
        each n in indices."""
        nth = torch.as_tensor(indices, dtype=torch.int64) * self.candidates // self.length
        return self.split.starts(nth * self.step)

    def __getitem__(self, indices) -> torch.Tensor:
        """The windows at indices (see inputs_and_targets)."""
        return self.split.dataset.windows(self.starts(indices).numpy())


def in_windows(dataset: Dataset) -> Dataset:
    """A dataset as the Trainer's loaders read it, a batch of windows at a time: a CharDataset given
    whole is a split of all its samples; a Split already is one. Another dataset is left as it is
    (its (x, y) pairs then move to the device as two tensors)."""
    return Split(dataset, 0, len(dataset)) if isinstance(dataset, CharDataset) else dataset


def open_corpus(config: DataConfig, validation: bool = False) -> CharDataset:
    """The configured text's token file, memory-mapped (prepare_corpus has made it on this machine),
    or its shards; of data_config.val_path when validation is asked for."""
    key, path = (VAL_PATH_KEY, config.val_path) if validation else (PATH_KEY, config.path)
    truncate = 1.0 if validation else config.truncate
    text_set = set_of_texts(config, key, path)
    if text_set is not None:
        prepared = open_set(text_set)
        if isinstance(prepared, TokenFile):  # a set of one: that file's token file, as a text's
            dataset = CharDataset.from_token_file(prepared, config.block_size, truncate)
        else:
            stream, tokenizer_json = prepared
            dataset = CharDataset.from_ids(stream, vocabulary_of(tokenizer_json), config.block_size, truncate)
    elif names_shards(path, config.format):
        vocabulary = vocabulary_of_shards(config.tokenizer_choice)
        stream = open_shards(path, config.format, len(vocabulary), key, remote_cache(config, path, key))
        check_cache_holds(stream, config.reading_shards_at_once, whole=validation)
        dataset = CharDataset.from_ids(stream, vocabulary, config.block_size, truncate)
    elif is_ranged(path, choice := text_tokenizer(config, key)):
        stream, tokenizer_json = open_ranges(path, config.cache_dir, choice, key)
        dataset = CharDataset.from_ids(stream, vocabulary_of(tokenizer_json), config.block_size, truncate)
    else:
        dataset = CharDataset.from_token_file(open_text(path, config, key), config.block_size, truncate)
    if len(dataset) == 0:
        raise too_short(dataset, path, key, config.block_size, truncate)
    return dataset


def remote_cache(config: DataConfig, path: str, key: str) -> Optional[ShardCache]:
    """Where remote shards' copies go on this machine (None for shards on it)."""
    if not files.is_remote(path):
        return None
    return ShardCache(files.cache_folder(config.cache_dir) / SHARD_CACHE_FOLDER,
                      int(config.shard_cache_gb * 1e9), key)


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


def vocabulary_of_shards(choice: TokenizerChoice) -> Vocabulary:
    """Shards hold ids, not text: their vocabulary is the tokenizer.json that made them."""
    if choice.file is None:
        raise DataError(f"data_config.tokenizer: pre-tokenized shards hold token ids, and {choice.name} "
                        "would make a vocabulary of a text; set data_config.tokenizer to the tokenizer.json "
                        "that made the shards (GPT-2's for llm.c's FineWeb shards)")
    return vocabulary_of(choice.file.json)


@functools.lru_cache(maxsize=1)
def vocabulary_of(tokenizer_json: str) -> Vocabulary:
    """A tokenizer.json's Vocabulary, made once for path's shards and val_path's (GPT-2's takes a
    third of a second)."""
    return Vocabulary.from_json(tokenizer_json)


def open_text(path: str, config: DataConfig, key: str) -> TokenFile:
    """A text's token file, made by prepare_corpus."""
    choice = text_tokenizer(config, key)
    tokens = open_token_file(token_file_for(path, config.cache_dir, choice))
    if tokens.settings != choice.settings():  # another run, of other settings, made it meanwhile
        raise DataError(f"token file {tokens.path} was made again by another run, for other tokenizer "
                        "settings; run one tokenizer setting per text at a time, then start again")
    return tokens


def too_short(dataset: CharDataset, path: str, key: str, block_size: int, truncate: float) -> DataError:
    """No window fits: block_size + 1 tokens are more than the data holds."""
    if dataset.shards is None and key == PATH_KEY:  # the text's own words, as they always were
        return DataError(
            f"data_config.block_size={block_size} is not smaller than the text "
            f"({dataset.num_chars} {dataset.unit} after truncate={truncate}); "
            "lower data_config.block_size or raise data_config.truncate"
        )
    shards = f"{dataset.shards.describe()}, " if dataset.shards is not None else ""
    kept = f" after truncate={truncate}" if truncate < 1 else ""
    return DataError(f"{key}: {path} ({shards}{dataset.num_chars:,} {dataset.unit}{kept}) is too short for "
                     f"one window of data_config.block_size={block_size} + 1 {dataset.unit}; lower "
                     "data_config.block_size or give more data")


def prepare_corpus(config: DataConfig, local_main: bool = True) -> None:
    """Make (or check) the token file of each text (path, and val_path if set), reading the text
    once, from wherever it is. Shards need nothing: open_corpus checks them as it maps them.

    A single text: call it on one process per machine (local_main) and make the others wait: the
    token file is shared by every process of the machine through the page cache. A set of texts:
    call it on every process of the machine (local_main or not), which share its files' preparation
    (text_set.prepare_set), then make them wait for each other; so for a text large enough to be
    prepared in ranges (text_ranges.py), whose ranges they share.
    """
    corpora = [(key, path) for key, path in ((PATH_KEY, config.path), (VAL_PATH_KEY, config.val_path))
               if path is not None]
    sets = {key: set_of_texts(config, key, path) for key, path in corpora}  # a set's shape, its tokenizer
    texts = [(key, path) for key, path in corpora
             if sets[key] is None and not names_shards(path, config.format)]
    choices = [text_tokenizer(config, key) for key, _ in texts]  # every refusal before anything is made
    for text_set in sets.values():
        if text_set is not None and text_set.choice.is_char:
            text_set.tokenizer(make=False)  # characters for several texts are refused here
    for (_, path), choice in zip(texts, choices):
        if is_ranged(path, choice):  # a large text: in ranges, by every process of the machine
            prepare_ranges(path, config.cache_dir, choice)
        elif local_main:
            prepare(path, config.cache_dir, choice)
    for text_set in sets.values():
        if text_set is not None:
            prepare_set(text_set)


def set_of_texts(config: DataConfig, key: str, path: str) -> Optional[TextSet]:
    """The set of texts a data path names (text_set.py), or None: one text, or shards."""
    found = set_files(path, config.format, key)
    if found is None:
        return None
    choice = text_tokenizer(config, key)
    return TextSet(key, tuple(found), choice, config.text_field, config.cache_dir)


def text_tokenizer(config: DataConfig, key: str) -> TokenizerChoice:
    """What makes a text's ids: data_config.tokenizer; for a val_path text, a tokenizer.json only
    (characters, or a BPE trained on the text, would give it a vocabulary of its own, not path's)."""
    choice = config.tokenizer_choice
    if key == VAL_PATH_KEY and choice.file is None:
        raise DataError(f"{key}: a text of its own needs data_config.tokenizer set to a tokenizer.json (with "
                        f"{choice.name}, each text would have a vocabulary of its own)")
    return choice


def split_dataset(dataset: CharDataset, config: DataConfig, seed: int,
                  validation: Optional[CharDataset] = None) -> tuple[Split, Split]:
    """Train and test splits, identical on every rank for the same seed. With a validation set
    (data_config.val_path), all of dataset trains and all of validation tests."""
    at_once = config.reading_shards_at_once if dataset.shards is not None else 0
    if at_once and (validation is not None or config.split == "contiguous"):
        dataset.in_consecutive_windows()
    if validation is not None:
        return Split(dataset, 0, len(dataset), shards_at_once=at_once), Split(validation, 0, len(validation))
    if config.split == "random":
        # The original's random_split: a seeded permutation of all samples, cut at train_split.
        train_len = int(len(dataset) * config.train_split)
        order = Permutation(len(dataset), seed)
        train = Split(dataset, 0, train_len, order)
        test = Split(dataset, train_len, len(dataset) - train_len, order)
    else:
        # Cut the text, not the windows: no character is seen by both sides.
        cut = int(dataset.num_chars * config.train_split)
        first_test = dataset.first_sample_from(cut)
        train = Split(dataset, 0, dataset.samples_before(cut), shards_at_once=at_once)
        test = Split(dataset, first_test, max(len(dataset) - first_test, 0))
    if len(train) == 0 or len(test) == 0:
        raise DataError(
            f"data_config.train_split={config.train_split} leaves {len(train)} train and {len(test)} "
            f"test samples of block_size {config.block_size}; use more text or a smaller block_size"
        )
    return train, test
