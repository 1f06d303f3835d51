"""A seeded permutation of 0..n-1 computed element by element: memory that does not grow with n.

A corpus of a billion characters has a billion samples; a shuffled list of them (randperm, or the
lists random_split and DistributedSampler build) takes 8 GB per rank and seconds per epoch. Here
position i of the order is computed when it is needed: a Feistel network, a bijection on the
integers below the next even power of two >= n, whose round function is an integer hash keyed by
the seed; an image at or above n is mapped again until it falls below n ("cycle walking"), which
keeps the map a bijection on 0..n-1. The domain is at most 4n, so few elements need a second round.

The same (n, seed) gives the same order in every process, on every machine. The arithmetic is
numpy's on uint64 (a batch is a few dozen elements: torch's per-operation overhead was most of a
small model's data time); results come back as int64 tensors.
"""
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

ROUNDS = 4
_MASK32 = np.uint64(0xFFFFFFFF)
_MASK64 = (1 << 64) - 1


def _splitmix64(state: int) -> tuple[int, int]:
    """The next (state, output) of SplitMix64: turns one seed into well-mixed round keys."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def _hash32(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """An integer hash of 32-bit values (uint64 array in, uint64 array of 32-bit values out).

    A 32-bit value times a 32-bit constant fits in 64 bits; only the low 32 bits are kept.
    """
    x = (x ^ key) & _MASK32
    x = (x * np.uint64(0x7FEB352D)) & _MASK32
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & _MASK32
    return x ^ (x >> np.uint64(16))


class Permutation:
    """order(i) for i in 0..n-1 is a bijection onto 0..n-1, fixed by (n, seed)."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        self.n = n
        bits = max((n - 1).bit_length(), 2)
        half_bits = (bits + 1) // 2
        self._half_bits, self._half_mask = np.uint64(half_bits), np.uint64((1 << half_bits) - 1)
        state = seed & _MASK64
        self._keys = []
        for _ in range(ROUNDS):
            state, key = _splitmix64(state)
            self._keys.append(np.uint64(key) & _MASK32)

    def __len__(self) -> int:
        return self.n

    def __call__(self, positions) -> torch.Tensor:
        """The elements at these positions of the order (int64 tensor or array of any shape)."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"positions outside 0..{self.n - 1}")
        out = self._feistel(positions.astype(np.uint64))
        outside = out >= self.n
        while outside.any():  # cycle walking: each step is a bijection, so it ends below n
            out[outside] = self._feistel(out[outside])
            outside = out >= self.n
        return torch.from_numpy(out.astype(np.int64))

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half_bits, x & self._half_mask
        for key in self._keys:
            left, right = right, left ^ (_hash32(right, key) & self._half_mask)
        return (left << self._half_bits) | right


@dataclass(frozen=True)
class Blocks:
    """Runs of consecutive sample indices that lie together (a shard's windows), read a few at a time."""

    sizes: list[int]
    """Samples in each block, in index order (block 0 holds indices 0..sizes[0]-1, and so on)."""
    at_once: int
    """Blocks an epoch reads at a time (data_config.shards_at_once)."""
    warm: Callable[[list[int]], None] = lambda blocks: None
    """Asked to bring these blocks' data near (the next group's), before they are read."""


class BlockOrder:
    """A seeded order of 0..n-1 that reads `at_once` blocks at a time: the blocks in a seeded order,
    cut into groups of at_once; a group's samples in a seeded order of their own, group after group.

    Every sample once per epoch, as with Permutation, and position i is still computed when it is
    needed (a group's order is a Permutation of the group's samples); what changes is where the
    reads go: a stretch of the order touches one group's blocks only, so that a large set of shards
    is read a few shards at a time (their pages stay in the page cache, the next group's are read
    ahead), where a permutation of the whole set reads a window of a different shard at every step.
    """

    def __init__(self, blocks: Blocks, seed: int):
        sizes = np.asarray(blocks.sizes, dtype=np.int64)
        self.n = int(sizes.sum())
        if self.n < 1:
            raise ValueError("an order of no samples")
        self.block_starts = np.concatenate([[0], np.cumsum(sizes)])
        visits = Permutation(len(sizes), seed)(np.arange(len(sizes))).numpy()
        at_once = blocks.at_once
        self.groups = [visits[first:first + at_once] for first in range(0, len(visits), at_once)]
        """The blocks of each group, in the order the epoch reads them."""
        group_sizes = [int(sizes[group].sum()) for group in self.groups]
        self.group_starts = np.concatenate([[0], np.cumsum(group_sizes)])
        self._inner = [Permutation(size, seed + 1 + index) if size else None
                       for index, size in enumerate(group_sizes)]
        self._sizes = sizes

    def __len__(self) -> int:
        return self.n

    def blocks_from(self, group: int) -> list[int]:
        """The blocks of a group and of the one after it: what to have near when the group starts."""
        return [int(block) for later in self.groups[group:group + 2] for block in later]

    def group_at(self, position: int) -> int:
        """The group that a position of the order reads."""
        return int(np.searchsorted(self.group_starts, position, side="right") - 1)

    def __call__(self, positions) -> torch.Tensor:
        """The samples at these positions of the order (int64 tensor or array of any shape)."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"positions outside 0..{self.n - 1}")
        flat, out = positions.reshape(-1), np.empty(positions.size, dtype=np.int64)
        groups = np.searchsorted(self.group_starts, flat, side="right") - 1
        for group in np.unique(groups):
            here = groups == group
            inner = self._inner[group](flat[here] - self.group_starts[group]).numpy()
            blocks = self.groups[group]
            ends = np.cumsum(self._sizes[blocks])  # within the group, block after block
            which = np.searchsorted(ends, inner, side="right")
            out[here] = self.block_starts[blocks[which]] + inner - (ends[which] - self._sizes[blocks[which]])
        return torch.from_numpy(out.reshape(positions.shape))
