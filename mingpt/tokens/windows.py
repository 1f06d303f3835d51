"""The samples of a stream of ids as the loaders read them: windows, a share of them, a spread of them.

A sample is a window of block_size + 1 ids, its inputs and, one further, its targets: at every position
of the ids (the original's choice), or at every block_size-th (consecutive windows, as llm.c reads its
shards). Windows gathers a batch of them in one indexing operation (char_dataset.CharDataset is one,
with its vocabulary); a Split is a share of them (split_windows cuts the train and test splits), a
Spread a bounded evaluation's windows, spread over a split. No list of indices is ever built. A batch
travels as its windows and becomes inputs and targets on the device (inputs_and_targets).
"""
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from mingpt.common.errors import DataError
from mingpt.tokens.permutation import Blocks, Permutation
from mingpt.tokens.shards import ShardStream, count_ids
from mingpt.tokens.tokenizer import Vocabulary

RANDOM, CONTIGUOUS = "random", "contiguous"
"""data_config.split: the original's random split of overlapping windows, or cut text."""


class Windows(Dataset):
    """The windows over ids: a token file's array, or a ShardStream of several files."""

    def __init__(self, ids, block_size: int, id_map: Optional[np.ndarray] = None):
        self.ids = ids
        self.block_size = block_size
        self.stride = 1
        """Tokens from one sample's window to the next: 1, a window at every position (the original's);
        block_size, consecutive windows (shards read a few at a time: in_consecutive_windows)."""
        self.id_map = id_map
        """The dataset's id of each id of the stream (a truncated text's own characters); None: the same."""

    @property
    def shards(self) -> Optional[ShardStream]:
        """The stream of files the ids are read from (shards, a set's, a text's ranges); None: one file."""
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

    def windows(self, samples) -> torch.Tensor:
        """The block_size + 1 token ids of each sample's window, in one contiguous (..., T + 1) tensor."""
        samples = np.asarray(samples, dtype=np.int64)
        if samples.size and (samples.min() < 0 or samples.max() >= len(self)):
            raise IndexError(f"sample index outside 0..{len(self) - 1}")
        return self.token_ids((samples * self.stride)[..., None] + np.arange(self.block_size + 1))

    def token_ids(self, positions) -> torch.Tensor:
        """Token ids (int64) of the text at these character positions."""
        ids = self.ids[positions]
        return torch.from_numpy((self.id_map[ids] if self.id_map is not None else ids).astype(np.int64))


class Split(Dataset):
    """A share of a dataset's samples. Sample i of the split is window `start(i)` of the text: an
    offset for the contiguous split, a position of a seeded permutation for the random one. No
    list of indices is ever built."""

    def __init__(self, dataset: "Windows", first: int, length: int, order: Optional[Permutation] = None,
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
        """The windows of the split's samples at indices (inputs_and_targets: x and y)."""
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
        """The windows at indices (inputs_and_targets: x and y)."""
        return self.split.dataset.windows(self.starts(indices).numpy())


def own_characters(ids, vocabulary: Vocabulary) -> tuple[Optional[np.ndarray], Vocabulary]:
    """The vocabulary of a truncated text's own characters (the original's: those it trains on, which
    may lack some of the whole text's) and the table from the whole text's ids to it (Windows.id_map);
    (None, vocabulary) when it has them all. A BPE's vocabulary stays its tokenizer's, whatever share
    is kept."""
    if not vocabulary.is_char:
        return None, vocabulary
    present = np.flatnonzero(count_ids(ids, len(vocabulary)))
    if len(present) == len(vocabulary):
        return None, vocabulary
    id_map = np.full(len(vocabulary), -1, dtype=np.int64)
    id_map[present] = np.arange(len(present))
    return id_map, Vocabulary([vocabulary[i] for i in present])


def split_windows(windows: Windows, split: str, train_split: float, seed: int, shards_at_once: int = 0,
                  validation: Optional[Windows] = None) -> tuple[Split, Split]:
    """Train and test splits (data_config.split, train_split), identical on every rank for the same
    seed. With a validation set (data_config.val_path), all of windows trains and all of validation
    tests. Shards trained whole or cut contiguously are read shards_at_once at a time, in consecutive
    windows."""
    at_once = shards_at_once if windows.shards is not None else 0
    if at_once and (validation is not None or split == CONTIGUOUS):
        windows.in_consecutive_windows()
    if validation is not None:
        return Split(windows, 0, len(windows), shards_at_once=at_once), Split(validation, 0, len(validation))
    if split == RANDOM:
        # The original's random_split: a seeded permutation of all samples, cut at train_split.
        train_len = int(len(windows) * train_split)
        order = Permutation(len(windows), seed)
        train = Split(windows, 0, train_len, order)
        test = Split(windows, train_len, len(windows) - train_len, order)
    else:
        # Cut the text, not the windows: no character is seen by both sides.
        cut = int(windows.num_chars * train_split)
        first_test = windows.first_sample_from(cut)
        train = Split(windows, 0, windows.samples_before(cut), shards_at_once=at_once)
        test = Split(windows, first_test, max(len(windows) - first_test, 0))
    if len(train) == 0 or len(test) == 0:
        raise DataError(
            f"data_config.train_split={train_split} leaves {len(train)} train and {len(test)} "
            f"test samples of block_size {windows.block_size}; use more text or a smaller block_size"
        )
    return train, test


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


def in_windows(dataset: Dataset) -> Dataset:
    """A dataset as the Trainer's loaders read it, a batch of windows at a time: Windows given whole
    (a CharDataset) are a split of all their samples; a Split already is one. Another dataset is left
    as it is (its (x, y) pairs then move to the device as two tensors)."""
    return Split(dataset, 0, len(dataset)) if isinstance(dataset, Windows) else dataset
