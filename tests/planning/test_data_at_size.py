"""The data of a run of 1,024 ranks, checked on the samplers' own arithmetic (issue 56, item 4): no
process is started, each rank's sampler is built as the Trainer builds it and read whole. Every
sample of an epoch is owned once; the llm.c shards each rank opens, and what its node's cache is asked
for; an evaluation set smaller than the world; the default eval_batches at that size."""
from collections import Counter

import pytest
import torch
from helpers import llmc_shards_of, make_text

from mingpt.char_dataset import DataConfig, in_windows, open_corpus, split_dataset
from mingpt.cluster_check import shards_read, step_wider_than_a_group
from mingpt.distributed.process_group import DistEnv
from mingpt.tokens.data_loader import GlobalOrderSampler, rank_loader
from mingpt.trainer import TrainerConfig

WORLD, PER_NODE = 1024, 8
DEFAULT_TRAIN_SAMPLES = 50_076  # the default config's training split
EVAL_BATCHES = TrainerConfig().eval_batches


def rank(number: int) -> DistEnv:
    return DistEnv(number, number % PER_NODE, WORLD, PER_NODE, torch.device("cpu"), "gloo")


def epoch_of(sampler: GlobalOrderSampler) -> list[int]:
    sampler.set_epoch(1)
    return [int(sample) for batch in sampler for sample in batch]


def test_every_sample_of_an_epoch_is_owned_once_at_1024_ranks():
    """The default training split dealt to 1,024 ranks in batches of 4: every rank takes ceil(n / W)
    positions, 13 batches; together they own every sample, and only the last round's filling (W x
    ceil(n / W) - n positions from the epoch's start) twice."""
    owned = Counter()
    for number in range(WORLD):
        sampler = GlobalOrderSampler(DEFAULT_TRAIN_SAMPLES, 4, rank(number), shuffle=True, seed=1337)
        samples = epoch_of(sampler)
        assert len(samples) == 49 and len(sampler) == 13, number  # ceil(50,076 / 1,024) = 49
        owned.update(samples)
    assert set(owned) == set(range(DEFAULT_TRAIN_SAMPLES))
    assert sum(count - 1 for count in owned.values()) == WORLD * 49 - DEFAULT_TRAIN_SAMPLES == 100


def shard_set(folder, ids_per_shard: int, val_windows: int = 100):
    """32 llm.c shards (a 300-token BPE) and a validation shard of val_windows windows, read 2 at a time."""
    text = folder / "text.txt"
    text.write_text(make_text(40_000))
    glob = llmc_shards_of(text, folder / "set", folder / "tokenizer.json", shards=32,
                          ids_per_shard=ids_per_shard, val_ids=val_windows + 16)
    data = DataConfig(path=glob, val_path=str(folder / "set" / "val.bin"),
                      tokenizer=str(folder / "tokenizer.json"), block_size=16, shards_at_once=2)
    dataset, validation = open_corpus(data), open_corpus(data, validation=True)
    return split_dataset(dataset, data, seed=0, validation=validation)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Shards of 512 windows of 16: a group of 2 holds 1,024 windows, a step of 1,024 ranks x 1 (a
    FineWeb shard holds 97,656 windows of 1,024)."""
    return shard_set(tmp_path_factory.mktemp("shards"), ids_per_shard=512 * 16)


def test_the_shards_each_rank_opens_and_what_its_node_s_cache_is_asked_for(shards):
    """FineWeb's way at 1,024 ranks: 32 shards read 2 at a time, each rank 16 windows of the epoch's
    16,383. Every window is owned once over the ranks; a rank opens the shards its windows lie in, and
    has asked to have each near before (its group's and the next group's, as it enters a group): no
    shard more than twice (a third time on the last rank, whose last position wraps to the epoch's
    first group), so a remote shard is fetched once per node (by the first of its 8 ranks to ask)
    unless the cache let it go since; the 8 ranks of a node together ask for every shard of the set:
    32 fetches per node and epoch, 4 per rank."""
    train, _ = shards
    split = in_windows(train)
    blocks = split.blocks()
    owned, node_asked = Counter(), set()
    for number in range(WORLD):
        sampler = GlobalOrderSampler(len(split), 1, rank(number), shuffle=True, seed=1337, blocks=blocks)
        sampler.set_epoch(1)
        reads = shards_read(sampler, split)
        owned.update(reads.samples)
        wraps = number + WORLD * (len(reads.samples) - 1) >= len(split)  # its last position: the start's
        assert len(reads.samples) == 16 and max(Counter(reads.asked).values()) <= (3 if wraps else 2), number
        assert set(reads.opened) <= set(reads.asked), number  # nothing read that was not asked near
        if number < PER_NODE:
            node_asked.update(reads.asked)
    assert set(owned) == set(range(len(split)))
    assert node_asked == set(range(32))


def test_a_step_wider_than_a_group_of_shards_reads_shards_it_did_not_ask_near(shards):
    """The same shards with a batch of 4: a rank's batch reaches 3 x 1,024 positions of the order past
    its first, wider than a group's 1,022 to 1,024, so a batch reads groups it never asked near; the
    check says so, naming the key and the shards_at_once that would hold it (7: the smallest shard
    holds 511 whole windows). A batch of 1 reaches no further than its own position."""
    train, _ = shards
    split = in_windows(train)
    sampler = GlobalOrderSampler(len(split), 4, rank(0), shuffle=True, seed=1337, blocks=split.blocks())
    sampler.set_epoch(1)
    reads = shards_read(sampler, split)
    assert not set(reads.opened) <= set(reads.asked)
    assert step_wider_than_a_group(sampler) == -(-3 * WORLD // min(split.blocks().sizes)) == 7
    fits = GlobalOrderSampler(len(split), 1, rank(0), shuffle=True, seed=1337, blocks=split.blocks())
    assert step_wider_than_a_group(fits) == 0


def test_an_evaluation_set_smaller_than_the_world_gives_every_rank_one_batch(shards):
    """100 validation windows (1,600 ids) at 1,024 ranks: each rank evaluates one batch of one window
    (the i-th rank the (i mod 100)-th), so every rank meets evaluate()'s all-reduce after the same
    number of batches and none waits for another: no hang. The mean then counts each window 10 or 11
    times (1,024 evaluated), which evaluate()'s docstring allows for (up to world_size - 1 repeats)."""
    _, test = shards
    assert len(test) == 100  # windows at every position of its 116 ids
    seen = Counter()
    for number in range(WORLD):
        loader = rank_loader(in_windows(test), 4, None, EVAL_BATCHES, 0, 1337, rank(number), ())
        batches = [batch.tolist() for batch in loader.sampler]
        assert len(loader) == 1 and len(batches) == 1 and len(batches[0]) == 1, number
        seen.update(batches[0])
    assert set(seen) == set(range(100)) and set(seen.values()) == {10, 11}


def test_the_default_eval_batches_at_1024_ranks_evaluates_the_whole_test_split():
    """eval_batches=100 bounds an evaluation to 100 batches per rank: at 1,024 ranks of the default
    batch of 216 that is 22 million windows, so the default run's 5,565 test windows (and FineWeb's
    100M-token val.bin, 98k windows of 1,024) are evaluated whole, 6 windows (one batch) per rank."""
    bound = EVAL_BATCHES * TrainerConfig().batch_size * WORLD
    assert bound == 22_118_400 > 100_000_000 // 1024
    sampler = GlobalOrderSampler(5_565, 216, rank(WORLD - 1), shuffle=False, seed=1337, limit=None)
    assert sampler.positions_per_rank(0) == 6 and len(sampler) == 1
