"""shard_cache.py: shards on S3 (a real moto server on loopback, through s3fs, as test_s3.py) read
through a bounded cache: the same batches as the same shards on disk, the cache never over its
bound, each shard fetched once per visit, and each bad input one line."""
import os
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from helpers import make_text, write_llmc_shard

from mingpt.char_dataset import DataConfig, open_corpus, split_dataset
from mingpt.common.errors import ConfigError, DataError
from mingpt.distributed.process_group import DistEnv
from mingpt.tokens.data_loader import rank_loader
from mingpt.tokens.shard_cache import FOLDER, ShardCache, copy_name
from mingpt.tokens.tokenizer import train_bpe

ONE_RANK = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                   backend="gloo")
SHARD_IDS = 600
SHARD_BYTES = 1024 + 2 * SHARD_IDS


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe(iter([make_text(4000)]), vocab_size=300).save(str(path))
    return path


@pytest.fixture
def shard_sets(s3, tmp_path, monkeypatch):
    """Five llm.c shards of 600 ids on disk and the same in the bucket (train_0..3, val_0)."""
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MINGPT_CACHE_DIR", str(tmp_path / "cache"))
    local = tmp_path / "local"
    local.mkdir()
    ids = np.random.default_rng(0).integers(0, 300, 5 * SHARD_IDS)
    for index, name in enumerate(["train_0", "train_1", "train_2", "train_3", "val_0"]):
        write_llmc_shard(local / f"{name}.bin", ids[index * SHARD_IDS:(index + 1) * SHARD_IDS])
    remote = f"s3://{s3.bucket}/{tmp_path.name}"
    fsspec.filesystem("s3", skip_instance_cache=True).put(f"{local}/", f"{remote}/", recursive=True)
    return local, remote


def data(path: str, tokenizer, **settings) -> DataConfig:
    return DataConfig(path=f"{path}/train_*.bin", val_path=f"{path}/val_0.bin", tokenizer=str(tokenizer),
                      block_size=16, **settings)


def batches(config: DataConfig, watch=lambda: None) -> list[torch.Tensor]:
    """Every training batch of an epoch, as the Trainer's loader gives them (0 workers)."""
    train, test = split_dataset(open_corpus(config), config, seed=0, validation=open_corpus(config, True))
    loader = rank_loader(train, 32, 1, 0, 0, 0, ONE_RANK, ())
    loader.sampler.set_epoch(1)
    read = []
    for batch in loader:
        read.append(batch)
        watch()
    return read


def test_remote_shards_give_the_batches_of_the_same_shards_on_disk_within_the_cache_bound(
        shard_sets, tokenizer, tmp_path):
    local, remote = shard_sets
    bound = 3 * SHARD_BYTES  # the group being read and the next (2 x 1 shard), and one more
    copies = tmp_path / "cache" / FOLDER
    used = []

    def cache_use():
        used.append(sum(path.stat().st_size for path in copies.glob("*.bin")))

    settings = {"shards_at_once": 1, "shard_cache_gb": bound / 1e9}
    on_disk = batches(data(str(local), tokenizer, **settings))
    from_s3 = batches(data(remote, tokenizer, **settings), watch=cache_use)
    assert len(from_s3) == len(on_disk) > 0
    assert all(torch.equal(a, b) for a, b in zip(from_s3, on_disk))
    assert max(used) <= bound and used[-1] > 0
    assert len(list(copies.glob("*.bin"))) == 3  # four shards read through a cache of three
    assert not list(copies.glob(".*.part"))  # every fetch finished, written whole


def test_a_full_cache_evicts_the_least_recently_used_copy(tmp_path):
    """Room for two copies: the third shard's fetch deletes the copy used longest ago, not the newest,
    and a copy read again since its fetch counts as used then. (Local files stand for the store: the
    cache fetches any fsspec URL alike.)"""
    store = tmp_path / "store"
    store.mkdir()
    for name in ("a", "b", "c"):
        write_llmc_shard(store / f"{name}.bin", range(SHARD_IDS))
    cache = ShardCache(tmp_path / "cache", 2 * SHARD_BYTES, "data_config.path")

    def read(name: str) -> Path:
        url = str(store / f"{name}.bin")
        return cache.copy_of(url, SHARD_BYTES, cache.folder / copy_name(url, "1"))

    a, b = read("a"), read("b")
    now = time.time()  # a fetched 20 s ago, b 10 s ago: further apart than a file system's clock ticks
    os.utime(a, (now - 20, now - 20))
    os.utime(b, (now - 10, now - 10))
    assert read("a") == a  # read again: a is now the most recently used
    c = read("c")
    assert a.exists() and c.exists() and not b.exists()


def test_a_remote_folder_trains_and_a_local_file_evaluates(shard_sets, tokenizer):
    """Mixed: path a folder's URL (its .bin files, through the cache), val_path a shard on disk."""
    local, remote = shard_sets
    mixed = DataConfig(path=f"{remote}/", val_path=str(local / "val_0.bin"), tokenizer=str(tokenizer),
                       block_size=16)
    train, validation = open_corpus(mixed), open_corpus(mixed, validation=True)
    assert [Path(shard.url).name for shard in train.shards.shards] == [f"{name}.bin" for name in
                                                                       ["train_0", "train_1", "train_2",
                                                                        "train_3", "val_0"]]
    assert train.shards.cache is not None and validation.shards.cache is None
    assert np.array_equal(train.shards[np.arange(4 * SHARD_IDS, 5 * SHARD_IDS)],
                          validation.shards[np.arange(SHARD_IDS)])


def test_a_copy_evicted_by_another_process_before_its_map_is_fetched_again(shard_sets, tokenizer,
                                                                            monkeypatch):
    """Between one process's fetch of a copy and its map, another making room may delete it."""
    _, remote = shard_sets
    stream = open_corpus(data(remote, tokenizer, shards_at_once=1)).shards
    fetched = []
    copy_of = ShardCache.copy_of

    def evicted_after_the_first_fetch(cache, url, size, local):
        path = copy_of(cache, url, size, local)
        fetched.append(url)
        if len(fetched) == 1:
            path.unlink()  # as another process's _make_room would
        return path

    monkeypatch.setattr(ShardCache, "copy_of", evicted_after_the_first_fetch)
    assert np.array_equal(stream[np.arange(5)], np.fromfile(stream.shards[0].path, "<u2", 5, offset=1024))
    assert fetched == [stream.shards[0].url] * 2


def test_bad_remote_shards_are_one_line(shard_sets, tokenizer, s3):
    _, remote = shard_sets
    nothing = r"^data_config.path: the glob s3://\S+/nothing_\*\.bin matches no file"
    with pytest.raises(DataError, match=nothing):
        open_corpus(DataConfig(path=f"{remote}/nothing_*.bin", tokenizer=str(tokenizer), block_size=16))
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.pipe(f"{remote}/train_9.bin", b"not a shard")
    with pytest.raises(DataError, match=r"^data_config.path: s3://\S+/train_9\.bin is not an llm.c shard"):
        open_corpus(data(remote, tokenizer, format="llmc"))
    fs.rm(f"{remote}/train_9.bin")
    too_small = r"^data_config.shard_cache_gb: 3e-06 GB holds fewer than the 4 shards"
    with pytest.raises(ConfigError, match=too_small):
        open_corpus(data(remote, tokenizer, shard_cache_gb=3e-6))
    with pytest.raises(ConfigError, match=r"^data_config.shards_at_once: remote shards are read a few"):
        open_corpus(data(remote, tokenizer, shards_at_once=0))
    too_small_for_val = DataConfig(path=f"{remote}/train_*.bin", val_path=f"{remote}/[tv]*_[0-3].bin",
                                   tokenizer=str(tokenizer), block_size=16,
                                   shard_cache_gb=4.5 * SHARD_BYTES / 1e9)
    with pytest.raises(ConfigError, match=r"cannot hold val_path's 5 remote shards"):
        open_corpus(too_small_for_val, validation=True)
