"""data_loader.py: one global sample order per epoch, dealt out to any number of ranks."""
import os
import signal
import time

import numpy as np
import psutil
import torch
from helpers import make_text

from mingpt.char_dataset import CharDataset, DataConfig, inputs_and_targets, split_dataset
from mingpt.distributed.process_group import DistEnv
from mingpt.tokens.data_loader import (
    DEFAULT_WORKERS,
    EPOCH_SEED_STRIDE,
    GlobalOrderSampler,
    batches_per_rank,
    make_dataloader,
    rank_loader,
    usable_workers,
)
from mingpt.tokens.permutation import BlockOrder, Blocks
from mingpt.tokens.windows import Split
from mingpt.trainer import TrainerConfig

DEFAULT_EVAL_BATCHES = TrainerConfig().eval_batches


def env(rank: int, world_size: int) -> DistEnv:
    return DistEnv(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size,
                   device=torch.device("cpu"), backend="gloo")


def rank_batches(num_samples, batch_size, world_size, epoch=1, start=0, shuffle=True, limit=None):
    """Each rank's batches of one pass, as lists."""
    ranks = []
    for rank in range(world_size):
        sampler = GlobalOrderSampler(num_samples, batch_size, env(rank, world_size), shuffle, seed=7,
                                     limit=limit)
        sampler.set_epoch(epoch, start=start)
        batches = [batch.tolist() for batch in sampler]
        assert len(batches) == len(sampler)
        ranks.append(batches)
    return ranks


def global_order(ranks) -> list[int]:
    """The samples step by step, each step's ranks in the DistributedSampler's interleaving."""
    order = []
    for step in zip(*ranks):
        order += [sample for round_ in zip(*step) for sample in round_]
    return order


def test_a_pass_is_every_sample_once_split_over_the_ranks():
    ranks = rank_batches(1000, batch_size=16, world_size=2)
    samples = [s for batches in ranks for batch in batches for s in batch]
    assert sorted(samples) == list(range(1000))
    assert not set(sum(ranks[0], [])) & set(sum(ranks[1], []))
    assert len(ranks[0]) == len(ranks[1]) == 32  # 500 each: 31 batches of 16 and one of 4


def test_the_order_does_not_depend_on_the_world_size():
    one = global_order(rank_batches(960, batch_size=32, world_size=1))
    two = global_order(rank_batches(960, batch_size=16, world_size=2))
    three = global_order(rank_batches(960, batch_size=8, world_size=4))
    assert one == two == three
    assert one != list(range(960))  # shuffled
    assert one != global_order(rank_batches(960, batch_size=32, world_size=1, epoch=2))  # per epoch


def test_an_uneven_pass_is_filled_from_its_start_like_distributed_sampler():
    ranks = rank_batches(1001, batch_size=100, world_size=2)
    samples = [s for batches in ranks for batch in batches for s in batch]
    assert len(samples) == 1002 and sorted(set(samples)) == list(range(1001))
    first = global_order(rank_batches(1001, batch_size=100, world_size=2))[0]
    assert samples.count(first) == 2  # the one extra sample is the pass's first


def test_resumed_at_another_world_size_every_sample_is_trained_once():
    order = global_order(rank_batches(1200, batch_size=25, world_size=2))
    trained = order[: 4 * 50]  # 4 steps of 25 x 2 ranks, then a snapshot
    rest = rank_batches(1200, batch_size=40, world_size=4, start=200)
    rest_samples = [s for batches in rest for batch in batches for s in batch]
    assert sorted(trained + rest_samples) == list(range(1200))
    assert global_order(rest) == order[200:]


def test_the_steps_left_count_the_rest_of_the_epoch_at_the_world_size_resumed_at():
    """The schedule's horizon after a resume at another world size: the rest of the open epoch at the
    new one, then whole epochs; none left once max_epochs are done."""
    resumed = GlobalOrderSampler(1200, batch_size=40, env=env(0, 4), shuffle=True, seed=7)  # 160 a step
    assert resumed.steps_left(finished_epoch=0, epoch_samples=200, max_epochs=3) == 7 + 2 * 8  # 1,000 left: 7
    assert resumed.steps_left(finished_epoch=1, epoch_samples=0, max_epochs=3) == 2 * 8
    assert resumed.steps_left(finished_epoch=3, epoch_samples=0, max_epochs=3) == 0


def test_an_eval_subset_is_fixed_and_unshuffled_passes_keep_the_split_order():
    subset = rank_batches(500, batch_size=10, world_size=2, limit=60, epoch=0)
    again = rank_batches(500, batch_size=10, world_size=2, limit=60, epoch=0)
    assert subset == again and len(subset[0]) == 3
    assert len(set(global_order(subset))) == 60
    assert global_order(rank_batches(100, batch_size=10, world_size=2, shuffle=False)) == list(range(100))


def test_the_loader_gathers_whole_batches_of_windows():
    """One contiguous (B, T + 1) tensor per batch: on a GPU one pinned, asynchronous copy, split
    into inputs and targets on the device (char_dataset.inputs_and_targets)."""
    text = make_text(3000)
    dataset = CharDataset(text, block_size=8)
    train, _ = split_dataset(dataset, DataConfig(path="unused", block_size=8), seed=0)
    loader = make_dataloader(train, batch_size=16, workers=0, env=env(0, 1), shuffle=True, seed=3)
    loader.sampler.set_epoch(1)
    indices = next(iter(loader.sampler))
    windows = next(iter(loader))
    assert isinstance(windows, torch.Tensor) and windows.is_contiguous()
    assert windows.shape == (16, 9) and windows.dtype == torch.int64
    x, y = inputs_and_targets(windows)
    for row, start in enumerate(train.starts(indices).tolist()):
        assert dataset.decode(x[row]) == text[start:start + 8]
        assert dataset.decode(y[row]) == text[start + 1:start + 9]


def test_a_pass_over_a_trillion_samples_starts_at_once():
    """Nothing is built per sample: the first batch of a huge pass costs what any batch costs."""
    sampler = GlobalOrderSampler(10**12, batch_size=8, env=env(1, 2), shuffle=True, seed=1)
    sampler.set_epoch(3, start=10**11)
    batch = next(iter(sampler))
    assert batch.shape == (8,) and int(batch.max()) < 10**12 and len(sampler) == 56_250_000_000


def test_unset_workers_follow_the_cpus_this_process_may_use_and_a_number_is_used_as_given():
    cpus = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(cpus)})  # as Slurm or taskset would: one CPU of the machine's
        assert usable_workers(None, env(0, 1)) == 0
        assert usable_workers(2, env(0, 1)) == 2
    finally:
        os.sched_setaffinity(0, cpus)
    assert usable_workers(None, env(0, 1)) == min(DEFAULT_WORKERS, len(cpus) - 1)


def test_data_workers_leave_the_stop_signals_to_the_training_process():
    dataset = CharDataset(make_text(3000), block_size=8)
    loader = make_dataloader(dataset, batch_size=4, workers=1, env=env(0, 1), shuffle=True, seed=3,
                             signals_for_training=(signal.SIGTERM, signal.SIGINT))
    batches = iter(loader)
    next(batches)
    (worker,) = [child for child in psutil.Process().children() if child.name() == "pt_data_worker"]
    for number in (signal.SIGTERM, signal.SIGINT):
        worker.send_signal(number)
    time.sleep(0.5)
    assert worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE
    assert next(batches)[0].shape == (4, 8)  # still loading
    del batches


def test_a_block_order_is_dealt_as_the_permutation_is_and_reads_the_next_blocks_ahead():
    """Shards read a few at a time (data_config.shards_at_once): the same order at any world size,
    each sample once, a resume at another world size goes on where the epoch was; each group's
    blocks and the next group's are asked for as the group starts."""
    warmed = []
    blocks = Blocks([300, 200, 250, 210], at_once=2, warm=warmed.append)

    def order(world_size, batch_size, start=0):
        ranks = []
        for rank in range(world_size):
            sampler = GlobalOrderSampler(960, batch_size, env(rank, world_size), True, seed=7, blocks=blocks)
            sampler.set_epoch(1, start=start)
            ranks.append([batch.tolist() for batch in sampler])
        return global_order(ranks)

    one = order(1, 32)
    assert sorted(one) == list(range(960)) and one == order(2, 16) == order(4, 8)
    assert order(2, 16, start=320) == one[320:]
    first_group, second_group = BlockOrder(blocks, seed=7 + EPOCH_SEED_STRIDE).groups
    assert warmed[0] == [*first_group, *second_group] and warmed[1] == list(second_group)
    first_blocks = set(np.searchsorted([300, 500, 750, 960], one[:500], side="right"))
    assert first_blocks == set(first_group)  # the first stretch reads the first group's blocks only


# ----------------------------------------------------------------------------------- evaluation

def eval_loader(test, batch_size, eval_batches=DEFAULT_EVAL_BATCHES, rank=0, world_size=1):
    """The Trainer's test loader of rank `rank` (rank_loader, as Trainer._prepare_dataloader calls it)."""
    loader = rank_loader(test, batch_size, None, eval_batches, workers=0, seed=5, env=env(rank, world_size),
                         signals_for_training=())
    return loader


def evaluated(test, batch_size, world_size=1, **settings) -> list[int]:
    """The window starts of one evaluation, in the global order of its ranks' batches."""
    ranks = []
    for rank in range(world_size):
        loader = eval_loader(test, batch_size, rank=rank, world_size=world_size, **settings)
        ranks.append([loader.dataset.starts(batch).tolist() for batch in loader.sampler])
    return global_order(ranks)


def test_a_large_evaluation_set_is_bounded_by_default_to_windows_spread_without_overlap():
    """A val_path of 60,000 characters (59,992 windows: 14,998 batches of 4) is evaluated on the
    default's 100 batches, of windows that do not overlap, from its start to its end; split at random,
    on a seeded subset of 100 batches."""
    dataset = CharDataset(make_text(60_000), block_size=8)
    val = Split(dataset, 0, len(dataset))
    loader = eval_loader(val, batch_size=4)
    assert len(loader) == DEFAULT_EVAL_BATCHES == 100 and batches_per_rank(len(val), 4, 1) == 14_998
    starts = evaluated(val, batch_size=4)
    assert len(starts) == 400 and min(np.diff(starts)) >= 8
    assert starts[0] == 0 and starts[-1] > 0.99 * len(dataset)
    assert torch.equal(next(iter(loader)), dataset.windows(starts[:4]))
    _, random_test = split_dataset(dataset, DataConfig(path="unused", block_size=8), seed=0)
    subset = eval_loader(random_test, batch_size=4)
    assert len(subset) == 100 and subset.dataset is random_test and subset.sampler.shuffle


def test_bounded_windows_are_the_same_at_every_evaluation_and_any_world_size():
    dataset = CharDataset(make_text(20_000), block_size=8)
    _, test = split_dataset(dataset, DataConfig(path="unused", block_size=8, split="contiguous"), seed=0)
    one = evaluated(test, batch_size=8, eval_batches=5)
    two = evaluated(test, batch_size=4, eval_batches=5, world_size=2)  # 40 windows either way
    assert one == two == evaluated(test, batch_size=8, eval_batches=5)
    assert len(one) == 40 and min(np.diff(one)) >= 8 and one[0] == int(test.starts(0))


def test_a_split_within_the_bound_is_evaluated_whole_in_order_as_before():
    """The default run's test split is smaller than the bound: every sample, in the split's order,
    the last round filled from its start, exactly as eval_batches=0 (the old default) evaluates it."""
    assert 5_565 <= DEFAULT_EVAL_BATCHES * 216  # the default run: 5,565 test samples, 26 batches of 216
    dataset = CharDataset(make_text(3000), block_size=8)
    for split in ("random", "contiguous"):
        _, test = split_dataset(dataset, DataConfig(path="unused", block_size=8, split=split), seed=0)
        whole = evaluated(test, batch_size=16, world_size=2, eval_batches=0)
        assert evaluated(test, batch_size=16, world_size=2) == whole
        starts = test.starts(torch.arange(len(test))).tolist()
        assert whole == starts + starts[:len(starts) % 2]  # an odd count's last round: its first again
        assert eval_loader(test, batch_size=16, world_size=2).dataset is test


def test_eval_batches_0_evaluates_every_window_however_many():
    dataset = CharDataset(make_text(60_000), block_size=8)
    val = Split(dataset, 0, len(dataset))
    loader = eval_loader(val, batch_size=4, eval_batches=0)
    assert len(loader) == 14_998 and loader.dataset is val
    assert evaluated(val, batch_size=64, eval_batches=0) == list(range(len(dataset)))
