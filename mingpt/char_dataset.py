"""Character-level text data: read once through fsspec, encode once, serve slices.

Every position of the text starts a sample (the original's choice): sample i is
x = text[i : i + block_size], y = text[i + 1 : i + block_size + 1].
"""
import os
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import fsspec
import torch
from torch.utils.data import Dataset, Subset, random_split

from errors import DataError, check, check_positive

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = REPO_ROOT / "data" / "input.txt"
CORPUS_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
CORPUS_URL_ENV = "MINGPT_CORPUS_URL"
"""Environment variable that points the default-corpus download at a mirror."""

SPLITS = ("random", "contiguous")


@dataclass
class DataConfig:
    path: str = str(DEFAULT_CORPUS)
    """A local path or any fsspec URL (s3://, gs://, https://, ...) of a UTF-8 text file."""
    block_size: int = 128
    """Characters of context per sample."""
    train_split: float = 0.9
    """Share of the samples (random) or of the text (contiguous) used for training."""
    truncate: float = 1.0
    """Keep only this leading share of the text."""
    split: str = "random"
    """'random': the original's split of overlapping windows (test windows share characters with
    training windows, so the test loss is not held out). 'contiguous': the first train_split of
    the text trains, the rest tests, with no character in both: the honest held-out measure."""

    def __post_init__(self) -> None:
        check_positive(self, "data_config", "block_size")
        check(0.0 < self.train_split < 1.0, "data_config.train_split",
              f"must be between 0 and 1 (exclusive), got {self.train_split}")
        check(0.0 < self.truncate <= 1.0, "data_config.truncate",
              f"must be in (0, 1], got {self.truncate}")
        check(self.split in SPLITS, "data_config.split",
              f"must be one of {', '.join(SPLITS)}, got {self.split!r}")


class CharDataset(Dataset):
    """The text as one tensor of token ids; a sample is a pair of slices of it."""

    def __init__(self, text: str, block_size: int):
        codepoints = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
        vocab_codepoints = torch.unique(codepoints)  # sorted, like sorted(set(text))
        self.vocab: list[str] = [chr(c) for c in vocab_codepoints.tolist()]
        self.stoi = {ch: i for i, ch in enumerate(self.vocab)}
        self.block_size = block_size
        self.data = torch.searchsorted(vocab_codepoints, codepoints).long()

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __len__(self) -> int:
        return max(len(self.data) - self.block_size, 0)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[idx : idx + self.block_size + 1]
        return chunk[:-1], chunk[1:]

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.stoi[ch] for ch in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.vocab[i] for i in ids.tolist())


def read_text(config: DataConfig) -> str:
    """The configured text, truncated; a DataError says what to fix when it is unusable."""
    try:
        with fsspec.open(config.path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DataError(f"data_config.path: no such file {config.path}; "
                        "point data_config.path at a UTF-8 text file") from None
    except OSError as e:
        raise DataError(f"data_config.path: cannot read {config.path} ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data_config.path: {config.path} is not UTF-8 text "
                        f"({e.reason} at byte {e.start})") from None
    text = text[: int(len(text) * config.truncate)]
    if len(text) <= config.block_size:
        raise DataError(
            f"data_config.block_size={config.block_size} is not smaller than the text "
            f"({len(text)} characters after truncate={config.truncate}); "
            "lower data_config.block_size or raise data_config.truncate"
        )
    return text


def split_dataset(dataset: CharDataset, config: DataConfig, seed: int) -> tuple[Subset, Subset]:
    """Train and test subsets, identical on every rank for the same seed."""
    if config.split == "random":
        train_len = int(len(dataset) * config.train_split)
        generator = torch.Generator().manual_seed(seed)
        train, test = random_split(dataset, [train_len, len(dataset) - train_len], generator=generator)
    else:
        # Cut the text, not the windows: no character is seen by both sides.
        cut = int(len(dataset.data) * config.train_split)
        train = Subset(dataset, range(0, max(cut - dataset.block_size, 0)))
        test = Subset(dataset, range(cut, len(dataset)))
    if len(train) == 0 or len(test) == 0:
        raise DataError(
            f"data_config.train_split={config.train_split} leaves {len(train)} train and {len(test)} "
            f"test samples of block_size {config.block_size}; use more text or a smaller block_size"
        )
    return train, test


def is_default_corpus(path: str) -> bool:
    return Path(path).resolve() == DEFAULT_CORPUS if "://" not in path else False


def fetch_corpus(url: str, dest: Path, timeout_s: float = 30.0) -> None:
    """Download url into dest atomically: a reader never sees a partial file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout_s) as response:
            shutil.copyfileobj(response, out)
        os.replace(tmp, dest)
    except OSError as e:
        os.unlink(tmp)
        raise DataError(
            f"could not download the default corpus from {url} ({e}); put a UTF-8 text file at "
            f"{dest} or set data_config.path"
        ) from None


def ensure_default_corpus(path: str) -> None:
    """Fetch the tiny-shakespeare text into the default location when it is missing there.

    Call it on one process per machine and make the others wait. Any other path is the user's:
    it is read as given and never downloaded into.
    """
    if is_default_corpus(path) and not Path(path).exists():
        fetch_corpus(os.environ.get(CORPUS_URL_ENV, CORPUS_URL), Path(path))
