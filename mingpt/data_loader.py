"""Batches for each rank: a DistributedSampler per split that can resume part-way through an epoch."""
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


def make_dataloader(dataset: Dataset, batch_size: int, workers: int, env: DistEnv,
                    shuffle: bool, seed: int) -> DataLoader:
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
