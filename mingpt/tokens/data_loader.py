"""Batches for each rank, in one global order per epoch that does not depend on the world size.

An epoch is a seeded permutation of the split's samples (permutation.py: computed as it is read,
so memory does not grow with the corpus). Its positions are dealt out as DistributedSampler deals
them: rank r of W takes positions r, r + W, r + 2W, ... So every optimizer step consumes one
contiguous stretch of the global order, batch x W positions long, and "how far the epoch has got"
is one number, the global position, whatever the world size. A run resumed at another world size
starts from that position and every sample of the epoch is still trained exactly once.

A split of pre-tokenized shards read whole (data_config.shards_at_once) has an epoch order of
another kind with the same contract: permutation.BlockOrder, which reads a few shards at a time and
asks for the next ones to be read ahead as it enters each group.

As DistributedSampler does, the last round is filled up to a multiple of the world size with
positions from the start of the epoch's order, so that every rank takes the same number of batches;
up to world_size - 1 samples are seen twice in an epoch.
"""
import functools
import os
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from mingpt.common.errors import check
from mingpt.distributed.control import leave_stops_to_training
from mingpt.distributed.process_group import DistEnv
from mingpt.tokens.permutation import BlockOrder, Blocks, Permutation

EPOCH_SEED_STRIDE = 1_000_003
"""Spaces the epochs' permutation seeds apart (a prime, so that (seed, epoch) pairs rarely meet)."""


class GlobalOrderSampler(Sampler[torch.Tensor]):
    """This rank's batches (tensors of split indices) of one pass, from a global position on.

    shuffle=False keeps the split's own order (evaluation). `limit` caps a pass at its first limit
    positions: a fixed subset of the split (eval_batches). `blocks`: shuffle a block-wise order
    (BlockOrder) instead of a permutation of the whole split.
    """

    def __init__(self, num_samples: int, batch_size: int, env: DistEnv, shuffle: bool, seed: int,
                 limit: Optional[int] = None, blocks: Optional[Blocks] = None):
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank, self.world_size = env.rank, env.world_size
        self.shuffle = shuffle
        self.seed = seed
        self.pass_length = min(num_samples, limit) if limit else num_samples
        self.blocks = blocks
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The next pass is of this epoch's order, from global position `start` on."""
        self.epoch, self.start = epoch, start

    def positions_per_rank(self, start: int) -> int:
        """Positions each rank takes from `start` to the end of the pass (the last round filled)."""
        return -(-(self.pass_length - start) // self.world_size)

    def batches(self, start: int = 0) -> int:
        """Batches each rank takes in a pass from global position `start` on."""
        return -(-self.positions_per_rank(start) // self.batch_size)

    def steps_left(self, finished_epoch: int, epoch_samples: int, max_epochs: int) -> int:
        """The optimizer steps (batches) each rank has left until max_epochs are done, from the current
        position at the current world size: a run resumed at another ends its schedule on its last step.
        finished_epoch: the epochs done; epoch_samples: the samples taken of the next one."""
        in_epoch = finished_epoch < max_epochs
        later_epochs = max(max_epochs - finished_epoch - 1, 0)
        return (self.batches(start=epoch_samples) if in_epoch else 0) + later_epochs * self.batches()

    def __len__(self) -> int:
        return self.batches(self.start)

    def __iter__(self) -> Iterator[torch.Tensor]:
        order = self.epoch_order()
        count = self.positions_per_rank(self.start)
        group = None
        for first in range(0, count, self.batch_size):  # a batch at a time: nothing grows with the pass
            nth = torch.arange(first, min(first + self.batch_size, count))  # this rank's nth positions
            batch = (self.start + self.rank + self.world_size * nth) % self.pass_length  # last round wraps
            if isinstance(order, BlockOrder) and order.group_at(int(batch[0])) != group:
                group = order.group_at(int(batch[0]))
                self.blocks.warm(order.blocks_from(group))  # this group's (at the start) and the next's
            yield order(batch) if order is not None else batch

    def epoch_order(self) -> Optional[Permutation | BlockOrder]:
        """This epoch's order of the split's samples (None: the split's own, unshuffled)."""
        if not self.shuffle:
            return None
        seed = self.seed + EPOCH_SEED_STRIDE * self.epoch
        return BlockOrder(self.blocks, seed) if self.blocks else Permutation(self.num_samples, seed)


DEFAULT_WORKERS = 4
"""The original's data_loader_workers, the most an unset value gives."""


def usable_workers(requested: Optional[int], env: DistEnv) -> int:
    """`requested` as given; unset, DEFAULT_WORKERS capped at the CPU cores this rank can spare.

    Workers beyond the cores a rank can call its own only compete with training for them, and a
    batch is one gather from the memory-mapped token ids, so even one worker keeps far ahead. The
    cores are those this process may run on (its affinity, which Slurm and taskset set), not the
    machine's.
    """
    if requested is not None:
        return requested
    cores_per_rank = len(os.sched_getaffinity(0)) // env.local_world_size
    return min(DEFAULT_WORKERS, max(cores_per_rank - 1, 0))


def make_dataloader(dataset: Dataset, batch_size: int, workers: Optional[int], env: DistEnv, shuffle: bool,
                    seed: int, limit: Optional[int] = None,
                    signals_for_training: tuple[int, ...] = (),
                    blocks: Optional[Blocks] = None) -> DataLoader:
    """Batches of this rank's share, from `workers` processes (usable_workers).

    The sampler hands out whole batches of indices and the dataset gathers each batch in one go
    (batch_size=None: no per-sample calls, no collation). The workers ignore signals_for_training
    (control.py): every process of a run may get a stop signal, and only the training process acts.
    """
    workers = usable_workers(workers, env)
    return DataLoader(
        dataset,
        batch_size=None,
        sampler=GlobalOrderSampler(len(dataset), batch_size, env, shuffle=shuffle, seed=seed, limit=limit,
                                   blocks=blocks),
        num_workers=workers,
        persistent_workers=workers > 0,  # forking new workers every epoch costs seconds
        pin_memory=env.device.type == "cuda",
        # Its own generator: seeding workers must not draw from the global RNG that dropout uses,
        # or a run resumed mid-epoch would see other dropout masks than the unbroken run.
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=functools.partial(leave_stops_to_training, signals_for_training),
    )


def rank_loader(dataset: Dataset, batch_size: int, grad_accum_steps: Optional[int], eval_batches: int,
                workers: Optional[int], seed: int, env: DistEnv, signals_for_training: tuple[int, ...]) -> DataLoader:
    """This rank's loader of a split: for training (grad_accum_steps given) a batch holds a whole
    optimizer step (grad_accum_steps micro-batches), in the epoch's shuffled global order (shards read
    a few at a time). For evaluation (None), the whole split in order when it fits in eval_batches
    batches per rank (or eval_batches is 0); a larger one is bounded to that many, the same at every
    evaluation: windows spread over it without overlap, where it is consecutive windows of a text (its
    `spread`), or else a fixed seeded subset of its order (drawn from the whole split)."""
    def loader(dataset: Dataset, batch: int, shuffle: bool, limit: Optional[int] = None,
               blocks: Optional[Blocks] = None) -> DataLoader:
        return make_dataloader(dataset, batch, workers, env, shuffle=shuffle, seed=seed, limit=limit,
                               signals_for_training=signals_for_training, blocks=blocks)

    if grad_accum_steps is not None:
        blocks = dataset.blocks() if hasattr(dataset, "blocks") else None
        return loader(dataset, batch_size * grad_accum_steps, shuffle=True, blocks=blocks)
    bound = eval_batches * batch_size * env.world_size
    if not eval_batches or len(dataset) <= bound:
        return loader(dataset, batch_size, shuffle=False)
    spread = dataset.spread(bound) if hasattr(dataset, "spread") else None
    if spread is not None:
        return loader(spread, batch_size, shuffle=False)
    return loader(dataset, batch_size, shuffle=True, limit=bound)


def check_step_fits(train_samples: int, batch_size: int, grad_accum_steps: int, world_size: int) -> None:
    """A step must fit in the training split: a larger one would make every step the whole split,
    shorter than the step that the Batch line, tokens/s and the LR horizon count (checked at start-up,
    before the model is placed)."""
    step = batch_size * grad_accum_steps * world_size
    check(step <= train_samples, "trainer_config.batch_size",
          f"a step of {step:,} samples ({batch_size} x {grad_accum_steps} accumulation x {world_size} "
          f"process(es)) is more than the {train_samples:,} training samples; use at most "
          f"{train_samples // (grad_accum_steps * world_size)}, or more data")


def batches_per_rank(num_samples: int, batch_size: int, world_size: int) -> int:
    """Batches each rank takes in a whole pass over num_samples (the last round filled)."""
    return -(-(-(-num_samples // world_size)) // batch_size)
