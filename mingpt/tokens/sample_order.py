"""What decides a run's training samples and their order, kept in every snapshot: a resume on other
data is refused unless asked for (storage/checkpointer.py), since the position a snapshot holds
(step 6, sample 192 of epoch 1) is a place in its data's order, and in another order the same
place would train some samples twice and others never.

The order follows from the data's tokens (data_config.path's text or shards, cut by truncate), how
they are split (split and train_split, or all of path beside a val_path), the windows (block_size,
and consecutive windows when shards are read a few at a time) and the seed that shuffles them. The
tokens are known by a cheap fingerprint: the count and the first and last ids of a token file, or the
names and sizes of the shards (whose ids may lie on S3), never a pass over the data. The world size
is not part of it: every world size deals the same global order (permutation.py).
"""
import hashlib
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

import numpy as np

EDGE_IDS = 1 << 16
"""Ids at each end of a token file that its fingerprint reads."""

WHAT_CHANGED = {
    "tokens": "the text or shards (data_config.path, data_config.truncate)",
    "split": "the split (data_config.split, data_config.train_split, data_config.val_path)",
    "block_size": "data_config.block_size",
    "consecutive_windows": "the windows (data_config.shards_at_once)",
    "seed": "trainer_config.seed",
}


@dataclass(frozen=True)
class SampleOrder:
    tokens: str
    """How many tokens train, and their fingerprint."""
    split: str
    """"random 0.9", "contiguous 0.9", or "all of path" (data_config.val_path set)."""
    block_size: int
    consecutive_windows: bool
    """Windows a block apart (shards read a few at a time), not at every position."""
    seed: int

    @classmethod
    def of(cls, ids, block_size: int, split: str, consecutive_windows: bool, seed: int) -> "SampleOrder":
        return cls(fingerprint(ids), split, block_size, consecutive_windows, seed)

    def changes_from(self, recorded: dict[str, Any]) -> list[str]:
        """What differs in this run from the order a snapshot recorded ("the split (...): random 0.9 ->
        contiguous 0.9"); nothing for a snapshot written before orders were recorded."""
        if not recorded:
            return []
        return [f"{WHAT_CHANGED[f.name]}: {recorded.get(f.name)} -> {getattr(self, f.name)}"
                for f in fields(self) if recorded.get(f.name) != getattr(self, f.name)]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fingerprint(ids) -> str:
    """"1,115,394 tokens, 3f2a9c0e1b7d": the count, and a digest of the shards' names and sizes or
    of a token file's first and last EDGE_IDS ids."""
    digest = hashlib.sha256(str(len(ids)).encode())
    shards = getattr(ids, "shards", None)
    if shards is not None:
        for shard in shards:
            digest.update(f"{os.path.basename(shard.url or shard.path)}:{shard.n_tokens};".encode())
    else:
        for edge in (ids[:EDGE_IDS], ids[max(len(ids) - EDGE_IDS, 0):]):
            digest.update(np.ascontiguousarray(edge).tobytes())
    return f"{len(ids):,} tokens, {digest.hexdigest()[:12]}"


def split_of(split: str, train_split: float, val_path: Optional[str]) -> str:
    return "all of path" if val_path else f"{split} {train_split:g}"
