"""The data, as the original's char_dataset.py has it: DataConfig, CharDataset, and the train/test split.

Every position of the text starts a sample (the original's choice): sample i is
x = text[i : i + block_size], y = text[i + 1 : i + block_size + 1]. The text is encoded once into ids
that every process of a machine maps from one file, so memory does not grow with the corpus:
tokens/sources.py tells what data_config.path is (a text, a large text in ranges, a set of texts,
pre-tokenized shards) and prepares it; tokens/windows.py gathers the windows, cuts the splits and
makes a batch inputs and targets. With a BPE (tokens/tokenizer.py) or shards a sample is block_size
tokens, and "characters" below reads "tokens".
"""
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from mingpt.common import files
from mingpt.common.errors import check, check_choice, check_positive
from mingpt.tokens.shards import AUTO
from mingpt.tokens.sources import PATH_KEY, VAL_PATH_KEY, SourceSettings, source_of, too_short
from mingpt.tokens.text_set import DEFAULT_TEXT_FIELD
from mingpt.tokens.token_file import encode_text
from mingpt.tokens.tokenizer import DEFAULT_SAMPLE_MB, DEFAULT_VOCAB_SIZE, TokenizerChoice, Vocabulary
from mingpt.tokens.windows import CONTIGUOUS, RANDOM, Split, Windows, own_characters, split_windows
# Where they lived before tokens/windows.py; the Trainer and the benchmarks import them from here.
from mingpt.tokens.windows import Spread, batch_on, in_windows, inputs_and_targets  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = REPO_ROOT / "data" / "input.txt"
"""tiny-shakespeare, committed as the original commits it: the default trains with no network."""
SPLITS = (RANDOM, CONTIGUOUS)


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
        check(0.0 < self.train_split < 1.0, "data_config.train_split",
              f"must be between 0 and 1 (exclusive), got {self.train_split}")
        check(0.0 < self.truncate <= 1.0, "data_config.truncate",
              f"must be in (0, 1], got {self.truncate}")
        check_choice(self, "data_config", "split", SPLITS)
        check(self.val_path is None or bool(self.val_path), VAL_PATH_KEY,
              "must not be empty; give shards or a text, or null to cut the test split from path")
        self.sources  # the keys of how path and val_path are read (tokenizer, format, ...): checked there

    @functools.cached_property
    def sources(self) -> SourceSettings:
        """What tokens/sources.py needs to tell what path and val_path are, and to read them; made once
        (a tokenizer.json is read when first asked for). A null shards_at_once is 2 for remote shards."""
        remote = files.is_remote(self.path)
        at_once = 2 if self.shards_at_once is None and remote else self.shards_at_once or 0
        return SourceSettings(TokenizerChoice.of(self.tokenizer, self.bpe_vocab_size, self.bpe_sample_mb),
                              self.format, self.text_field, self.cache_dir, at_once, self.shard_cache_gb)


class CharDataset(Windows):
    """The text as token ids and their vocabulary. Sample i is the window starting at character i
    (Windows: `dataset[starts]` with a tensor of starts gives a batch, in one gather from the ids)."""

    def __init__(self, text: str, block_size: int):
        """A text already in memory (tests, benchmarks): encoded as a token file would be."""
        ids, vocab = encode_text(text)
        self._setup(ids, Vocabulary(vocab), block_size, len(ids))

    @classmethod
    def from_ids(cls, ids, vocabulary: Vocabulary, block_size: int, truncate: float = 1.0) -> "CharDataset":
        """The leading `truncate` share of a text's ids (a token file's array, or a ShardStream)."""
        dataset = cls.__new__(cls)
        dataset._setup(ids[:int(len(ids) * truncate)], vocabulary, block_size, len(ids))
        return dataset

    def _setup(self, ids, vocabulary: Vocabulary, block_size: int, text_length: int) -> None:
        # A truncated text has a vocabulary of its own characters (the original's), through a table.
        id_map, vocabulary = own_characters(ids, vocabulary) if len(ids) < text_length else (None, vocabulary)
        super().__init__(ids, block_size, id_map)
        self.text_length = text_length
        """Tokens in the whole text, before data_config.truncate kept its leading share (ids)."""
        self.vocabulary = vocabulary
        """The tokens and how text becomes them: what a snapshot keeps to decode the model's output."""
        self.vocab: list[str] = vocabulary.tokens

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __getitem__(self, samples) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y of each sample's window (an int gives one sample, a tensor a batch)."""
        return inputs_and_targets(self.windows(samples))

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


def prepare_corpus(config: DataConfig, local_main: bool = True) -> None:
    """Make (or check) on this machine what path, and val_path if set, need before they are read,
    each kind of data its own way (tokens/sources.py). Call it on every process of the machine
    (local_main: its local rank 0), then make them wait for each other before open_corpus."""
    sources = [source_of(path, key, config.sources) for key, path in corpora(config)]  # refusals first
    for source in sources:
        source.prepare(local_main)


def open_corpus(config: DataConfig, validation: bool = False) -> CharDataset:
    """The data of path (of val_path when validation is asked for), as prepare_corpus left it."""
    key, path = corpora(config)[1 if validation else 0]
    truncate = 1.0 if validation else config.truncate
    source = source_of(path, key, config.sources)
    data = source.open()
    dataset = CharDataset.from_ids(data.ids, data.vocabulary, config.block_size, truncate)
    if len(dataset) == 0:
        raise too_short(source, path, dataset.ids, dataset.unit, config.block_size, truncate)
    return dataset


def describe_data(config: DataConfig, dataset: CharDataset, train_set: Split, test_set: Split) -> str:
    """What a run trains and tests on: "Data: input.txt, 55,769 characters, vocabulary of 65; ..."."""
    def described(path: str, data: CharDataset) -> str:
        return f"{path}, {data.kept}" + (f" in {data.shards.describe()}" if data.shards is not None else "")

    validation = f"; validation {described(config.val_path, test_set.dataset)}" if config.val_path else ""
    split = "data_config.val_path" if config.val_path else f"{config.split} split"
    return (f"Data: {described(config.path, dataset)}, vocabulary of {dataset.vocab_size}{validation}; "
            f"{len(train_set):,} train and {len(test_set):,} test samples ({split})")


def corpora(config: DataConfig) -> list[tuple[str, str]]:
    """(key, path) of path, and of val_path if set."""
    return [(PATH_KEY, config.path)] + ([(VAL_PATH_KEY, config.val_path)] if config.val_path else [])


def split_dataset(dataset: CharDataset, config: DataConfig, seed: int,
                  validation: Optional[CharDataset] = None) -> tuple[Split, Split]:
    """Train and test splits, identical on every rank for the same seed (tokens/windows.split_windows:
    the original's seeded random split, or the contiguous one). With a validation set
    (data_config.val_path), all of dataset trains and all of validation tests."""
    return split_windows(dataset, config.split, config.train_split, seed, config.sources.shards_at_once,
                         validation)
