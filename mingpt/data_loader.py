"""Batches for each rank: a DistributedSampler per split that can resume part-way through an epoch."""
import os
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from process_group import DistEnv


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler whose next pass can skip the samples a resumed run already trained on."""

    def __init__(self, dataset: Dataset, env: DistEnv, shuffle: bool, seed: int):
        super().__init__(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=shuffle, seed=seed)
        self._skip = 0

    def skip_next(self, samples: int) -> None:
        """Start the next pass (only) after this many of this rank's samples."""
        self._skip = samples

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self._skip:]
        self._skip = 0
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples - self._skip


def usable_workers(requested: int, env: DistEnv) -> int:
    """Workers beyond the CPU cores a rank can call its own only compete with training for them.

    A sample is two slices of one tensor, so even one worker keeps far ahead of the model.
    """
    cores_per_rank = (os.cpu_count() or 1) // env.local_world_size
    return min(requested, max(cores_per_rank - 1, 0))


def make_dataloader(dataset: Dataset, batch_size: int, workers: int, env: DistEnv,
                    shuffle: bool, seed: int) -> DataLoader:
    """Batches of this rank's share; `workers` is capped at the cores the rank can spare."""
    workers = usable_workers(workers, env)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=ResumableDistributedSampler(dataset, env, shuffle=shuffle, seed=seed),
        num_workers=workers,
        persistent_workers=workers > 0,  # forking new workers every epoch costs seconds
        pin_memory=env.device.type == "cuda",
        # Its own generator: seeding workers must not draw from the global RNG that dropout uses,
        # or a run resumed mid-epoch would see other dropout masks than the unbroken run.
        generator=torch.Generator().manual_seed(seed),
    )
