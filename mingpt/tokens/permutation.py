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
