"""tokens/shards.py and its wiring in char_dataset.py: llm.c's and nanoGPT's pre-tokenized shards,
written here in each format's exact byte layout, read as one stream; and each bad input, one line."""
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_text, refused_leaving_nothing, write_llmc_shard, write_nanogpt_shard
from torch.utils.data import DataLoader

from mingpt.char_dataset import DataConfig, open_corpus, prepare_corpus, split_dataset
from mingpt.common.errors import ConfigError, DataError, own_line
from mingpt.distributed.process_group import DistEnv
from mingpt.tokens import shards
from mingpt.tokens.data_loader import rank_loader
from mingpt.tokens.shards import names_shards, open_shards
from mingpt.tokens.tokenizer import train_bpe

VOCAB = 300
ONE_RANK = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                   backend="gloo")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE of 300 tokens, saved as a tokenizer.json (what made the shards)."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe(iter([make_text(6000)]), vocab_size=VOCAB).save(str(path))
    return path


@pytest.fixture(scope="module")
def ids(tokenizer) -> np.ndarray:
    """About 2,500 ids of a text under that tokenizer."""
    from tokenizers import Tokenizer

    return np.array(Tokenizer.from_file(str(tokenizer)).encode(make_text(6000, seed=1)).ids, dtype=np.uint16)


def llmc_set(folder: Path, ids: np.ndarray, sizes=(500, 500, 500), name: str = "train") -> Path:
    """The ids cut into llm.c shards of these sizes, written last first (the set's order is the names')."""
    folder.mkdir(parents=True, exist_ok=True)
    cuts = np.cumsum([0, *sizes])
    for i in reversed(range(len(sizes))):
        write_llmc_shard(folder / f"{name}_{i:06d}.bin", ids[cuts[i]:cuts[i + 1]])
    return folder


def config(path, tokenizer_json, **overrides) -> DataConfig:
    return DataConfig(**{"path": str(path), "tokenizer": str(tokenizer_json), "block_size": 16, **overrides})


def test_an_llmc_shard_is_read_as_written(tmp_path, ids):
    shard = write_llmc_shard(tmp_path / "fineweb_val_000000.bin", ids)
    stream = open_shards(str(shard), "auto", VOCAB, "data_config.path")
    assert len(stream) == len(ids) and stream.dtype == np.uint16 and stream.describe() == "1 llm.c shard"
    assert np.array_equal(stream[np.arange(len(ids))], ids)
    assert np.array_equal(stream[np.array([[5, 3], [7, 0]])], ids[[[5, 3], [7, 0]]])  # any shape


def test_llmc_uint32_shards_of_their_documented_kind_are_read(tmp_path):
    """llm.c's data_common.py: magic 20240801, version 7, uint32 ids (LLaMA 3's)."""
    big = np.array([0, 70_000, 128_000, 5])
    shard = write_llmc_shard(tmp_path / "a.bin", big, magic=20240801, version=7, id_format="I")
    stream = open_shards(str(shard), "llmc", 128_256, "data_config.path")
    assert stream.dtype == np.uint32 and np.array_equal(stream[np.arange(4)], big)


def test_a_nanogpt_file_is_read_by_its_suffix_or_when_named(tmp_path, ids):
    train = write_nanogpt_shard(tmp_path / "train.bin", ids)
    stream = open_shards(str(train), "auto", VOCAB, "data_config.path")
    assert stream.describe() == "1 nanoGPT shard" and np.array_equal(stream[np.arange(len(ids))], ids)
    other = write_nanogpt_shard(tmp_path / "train.ids", ids)
    assert names_shards(str(other), "nanogpt") and not names_shards(str(other), "auto")
    assert np.array_equal(open_shards(str(other), "nanogpt", VOCAB, "k")[np.arange(9)], ids[:9])


def test_a_text_keeps_meaning_a_text(tmp_path):
    """Under auto only a .bin file, a folder or a glob are shards; a text named with glob characters
    is still a text, and format=text reads a .bin file as one."""
    odd = tmp_path / "notes[1].txt"
    odd.write_text("hello")
    assert not names_shards(str(odd), "auto") and not names_shards(str(tmp_path / "input.txt"), "auto")
    assert names_shards(str(tmp_path / "x.bin"), "auto") and not names_shards(str(tmp_path / "x.bin"), "text")
    assert names_shards(str(tmp_path), "auto") and names_shards(str(tmp_path / "*.bin"), "auto")
    assert not names_shards("https://host/input.txt?raw=true", "auto")


def test_windows_straddle_shards_in_sorted_name_order(tmp_path, ids, tokenizer):
    """Three shards, written last first, are one stream in name order: a window across a boundary is
    the concatenated ids, and a batch over all three is gathered at once."""
    folder = llmc_set(tmp_path / "set", ids)
    dataset = open_corpus(config(folder, tokenizer))
    assert dataset.shards.describe() == "3 llm.c shards" and dataset.num_chars == 1500
    assert len(dataset) == 1500 - 16 and dataset.vocab_size == VOCAB and dataset.unit == "tokens"
    starts = np.array([490, 995, 0, 1483, 250])  # 490 and 995 straddle a boundary
    windows = dataset.windows(starts)
    assert windows.shape == (5, 17) and windows.dtype == torch.int64
    for row, start in zip(windows, starts):
        assert np.array_equal(row.numpy(), ids[start:start + 17])
    x, y = dataset[torch.tensor([495])]
    decoded = dataset.decode(x[0]) + dataset.decode(y[0][-1:])
    assert decoded == dataset.vocabulary.decode(ids[495:512].tolist())


def test_a_glob_and_a_folder_name_the_same_set(tmp_path, ids, tokenizer):
    """A folder's shards are its .bin files (nothing else in it is read)."""
    folder = llmc_set(tmp_path / "set", ids)
    (folder / "README.md").write_text("not a shard")
    by_folder = open_corpus(config(folder, tokenizer))
    by_glob = open_corpus(config(folder / "train_*.bin", tokenizer))
    everything = np.arange(by_folder.num_chars)
    assert np.array_equal(by_folder.token_ids(everything), by_glob.token_ids(everything))
    assert [s.path.name for s in by_glob.shards.shards] == [f"train_{i:06d}.bin" for i in range(3)]


def test_truncate_keeps_the_leading_share_and_maps_only_its_shards(tmp_path, ids, tokenizer):
    dataset = open_corpus(config(llmc_set(tmp_path / "set", ids), tokenizer, truncate=0.5))
    assert dataset.num_chars == 750 and dataset.text_length == 1500
    assert dataset.shards.describe() == "2 llm.c shards"
    assert np.array_equal(dataset.token_ids(np.arange(750)).numpy(), ids[:750])
    with pytest.raises(IndexError):
        dataset.shards[np.array([750])]


def test_val_path_is_the_whole_test_split_and_path_the_whole_training_one(tmp_path, ids, tokenizer):
    folder = llmc_set(tmp_path / "set", ids)
    val = write_llmc_shard(tmp_path / "val_000000.bin", ids[1500:])
    data = config(folder / "train_*.bin", tokenizer, val_path=str(val), train_split=0.5, split="contiguous")
    prepare_corpus(data)
    dataset, validation = open_corpus(data), open_corpus(data, validation=True)
    train, test = split_dataset(dataset, data, seed=0, validation=validation)
    assert len(train) == len(dataset) == 1500 - 16 and len(test) == len(validation) == len(ids) - 1500 - 16
    assert np.array_equal(test[torch.tensor([0])].numpy()[0], ids[1500:1517])
    assert train.dataset is dataset and test.dataset is validation


def test_without_val_path_shards_are_split_as_a_text_is(tmp_path, ids, tokenizer):
    data = config(llmc_set(tmp_path / "set", ids), tokenizer, train_split=0.9)
    train, test = split_dataset(open_corpus(data), data, seed=0)
    assert len(train) == int(1484 * 0.9) and len(train) + len(test) == 1484


def test_a_stream_pickles_as_its_shards_not_its_ids(tmp_path, ids):
    """A worker started by spawn gets the stream pickled: a few hundred bytes, mapped again there."""
    stream = open_shards(str(llmc_set(tmp_path / "set", ids)), "auto", VOCAB, "k")
    data = pickle.dumps(stream)
    assert len(data) < 2000
    assert np.array_equal(pickle.loads(data)[np.arange(1500)], ids[:1500])


def bad_set(tmp_path: Path, ids: np.ndarray, case: str) -> tuple[str, dict]:
    """The data path (and config keys) of one kind of bad input (of 1,000 ids where it has ids)."""
    ids = ids[:1000]
    shard = tmp_path / "set" / "train_000000.bin"
    shard.parent.mkdir()
    if case == "wrong magic":
        write_nanogpt_shard(shard, ids)
        return str(shard), {"format": "llmc"}
    if case == "unknown version":
        write_llmc_shard(shard, ids, version=2)
    elif case == "truncated":
        write_llmc_shard(shard, ids, count=len(ids) + 1)
    elif case == "longer than its header":
        write_llmc_shard(shard, ids, count=len(ids) - 1)
    elif case == "shorter than a header":
        shard.write_bytes(write_llmc_shard(shard, ids).read_bytes()[:100])
    elif case == "odd length":
        shard.write_bytes(write_nanogpt_shard(shard, ids).read_bytes()[:-1])
    elif case == "empty shard":
        write_llmc_shard(shard, [])
    elif case == "empty folder":
        (shard.parent / "notes.md").write_text("no shards here, and no texts (a .txt would be a set of one)")
        return str(shard.parent), {}
    elif case == "glob matching nothing":
        return str(shard.parent / "fineweb_train_*.bin"), {}
    elif case == "mixed formats":
        write_llmc_shard(shard, ids)
        write_nanogpt_shard(shard.parent / "train_000001.bin", ids)
        return str(shard.parent), {}
    elif case == "llm.c shard named nanogpt":
        write_llmc_shard(shard, ids)
        return str(shard), {"format": "nanogpt"}
    elif case == "a text among shards":
        write_llmc_shard(shard, ids)
        (shard.parent / "notes.txt").write_text("a text")
        return str(shard.parent / "*"), {}
    elif case == "too short for one window":
        write_llmc_shard(shard, ids[:16])
    elif case == "ids beyond the vocabulary":
        write_llmc_shard(shard, np.concatenate([ids[:7], [VOCAB], ids[8:]]))
    elif case == "char tokenizer":
        write_llmc_shard(shard, ids)
        return str(shard), {"tokenizer": "char"}
    return str(shard), {}


BAD_INPUTS = {
    "wrong magic": "{shard} is not an llm.c shard: its header starts with ",
    "unknown version": "{shard} is of version 2 of llm.c's format (magic 20240520), which this project does "
                       "not read; it reads version 1 (uint16 ids)",
    "truncated": "{shard} is 3,024 bytes where its header says 3,026 (1,024 + 1,001 ids of 2 bytes): "
                 "truncated; fetch it again",
    "longer than its header": "{shard} is 3,024 bytes where its header says 3,022 (1,024 + 999 ids of 2 "
                              "bytes): longer than its header says: damaged; fetch it again",
    "shorter than a header": "{shard} is 100 bytes, shorter than llm.c's 1,024-byte header: a truncated "
                             "shard",
    "odd length": "{shard} is 1,999 bytes, an odd length where nanoGPT's .bin holds 2-byte ids",
    "empty shard": "{shard} holds no tokens",
    "empty folder": "the folder {folder} holds no .bin shards",
    "glob matching nothing": "the glob {folder}/fineweb_train_*.bin matches no file",
    "mixed formats": "mixed formats in one set: {shard} is llm.c (uint16 ids), {folder}/train_000001.bin "
                     "nanoGPT (uint16 ids); give the shards of one format",
    "llm.c shard named nanogpt": "{shard} starts with llm.c's magic 20240520: it is an llm.c shard, not raw "
                                 "nanoGPT ids; use data_config.format=llmc (or auto)",
    "a text among shards": "{folder}/notes.txt is neither an llm.c shard (no magic number) nor a .bin file "
                           "of nanoGPT's",
    "too short for one window": "{shard} (1 llm.c shard, 16 tokens) is too short for one window of "
                                "data_config.block_size=16 + 1 tokens",
    "ids beyond the vocabulary": "{shard} holds the id 300 (at token 7), beyond the vocabulary of 300 of "
                                 "data_config.tokenizer; give the tokenizer.json that made the shards",
    "char tokenizer": "pre-tokenized shards hold token ids, and char would make a vocabulary of a text; set "
                      "data_config.tokenizer to the tokenizer.json that made the shards",
}
"""What each bad input is refused with, after the key it names (data_config.path; the tokenizer's)."""


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_shards_are_one_line_and_nothing_is_written(tmp_path, ids, tokenizer, case):
    """Each bad input is a DataError (one line, exit 1) naming the file, met before anything is made:
    the data's folder is left as it was."""
    path, overrides = bad_set(tmp_path, ids, case)
    message = refused_leaving_nothing(tmp_path, config(path, tokenizer, **overrides))
    folder = tmp_path / "set"
    key = "data_config.tokenizer" if case == "char tokenizer" else "data_config.path"
    expected = BAD_INPUTS[case].format(shard=folder / "train_000000.bin", folder=folder)
    assert message.startswith(f"{key}: {expected}")


def test_a_val_text_needs_a_tokenizer_json(tmp_path, ids, tokenizer):
    val = tmp_path / "val.txt"
    val.write_text(make_text(500))
    data = DataConfig(path=str(llmc_set(tmp_path / "set", ids)), val_path=str(val), block_size=16)
    with pytest.raises(DataError, match=r"^data_config.val_path: a text of its own needs data_config.tok"):
        prepare_corpus(data)
    assert not list(tmp_path.glob("val.txt.*"))  # no token file made before the refusal


def test_ids_beyond_the_vocabulary_in_a_large_set_are_found_as_batches_read_them(tmp_path, ids, tokenizer,
                                                                                 monkeypatch):
    """A set too large to scan at start-up opens; the batch holding the bad id fails, naming the shard,
    in one line also when a DataLoader worker process read it (torch wraps its errors in a traceback)."""
    monkeypatch.setattr(shards, "SCAN_LIMIT_BYTES", 0)
    bad = ids.copy()
    bad[1200] = VOCAB + 5
    data = config(llmc_set(tmp_path / "set", bad), tokenizer)
    dataset = open_corpus(data)
    dataset.windows(np.arange(0, 1000, 7))  # the good part reads
    expected = (f"data_config.path: {tmp_path / 'set' / 'train_000002.bin'} holds the id 305 (at token 200), "
                "beyond the vocabulary of 300")
    with pytest.raises(DataError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")):
        dataset.windows(np.array([3, 1190]))
    train, _ = split_dataset(dataset, data, seed=0)
    loader = DataLoader(train, batch_size=None, sampler=[torch.arange(len(train))], num_workers=1)
    in_worker = first_error(loader)
    assert "\n" in str(in_worker) and own_line(in_worker).startswith(expected)


def first_error(loader: DataLoader) -> DataError:
    """The error of the loader's first batch, without its traceback, which would keep the loader's
    iterator, and with it its worker process, alive."""
    try:
        next(iter(loader))
    except DataError as error:
        return error.with_traceback(None)
    raise AssertionError("the batch was read")


def test_shards_trained_whole_are_read_a_few_at_a_time_in_consecutive_windows(tmp_path, ids, tokenizer):
    """data_config.shards_at_once: the training split of shards read whole (val_path, or a contiguous
    split) is a block per shard for the loader's BlockOrder, of consecutive windows (sample i at
    i x block_size: an epoch is one pass over the tokens); a random split, 0 (local shards' default),
    or a text: none, and a window at every position."""
    folder = llmc_set(tmp_path / "set", ids)
    val = write_llmc_shard(tmp_path / "val_000000.bin", ids[1500:])
    data = config(folder, tokenizer, val_path=str(val), shards_at_once=2)
    dataset, validation = open_corpus(data), open_corpus(data, validation=True)
    train, test = split_dataset(dataset, data, seed=0, validation=validation)
    assert len(train) == (1500 - 1) // 16 and len(test) == len(validation) == len(ids) - 1500 - 16
    assert np.array_equal(train[torch.tensor([2, 31])].numpy(), np.stack([ids[32:49], ids[496:513]]))
    blocks = train.blocks()  # windows starting in each shard: at 0..496, 512..992, 1008..1472
    assert blocks.sizes == [32, 31, 30] and blocks.at_once == 2 and test.blocks() is None
    blocks.warm([0, 2])  # asks the kernel to read them ahead; nothing to wait for
    train_loader = rank_loader(train, 8, 1, 0, 0, 0, ONE_RANK, ())
    test_loader = rank_loader(test, 8, None, 0, 0, 0, ONE_RANK, ())
    assert train_loader.sampler.blocks.sizes == blocks.sizes and test_loader.sampler.blocks is None
    contiguous = config(folder, tokenizer, split="contiguous", train_split=0.5, shards_at_once=1)
    train, test = split_dataset(open_corpus(contiguous), contiguous, seed=0)
    assert len(train) == 46 and test.first == 47  # windows ending by token 750, starting from it
    assert train.blocks().sizes == [32, 14, 0]  # block i is shard i's windows
    assert train.blocks().at_once == 1
    for off in (config(folder, tokenizer), config(folder, tokenizer, val_path=str(val))):
        dataset = open_corpus(off)
        assert split_dataset(dataset, off, seed=0, validation=open_corpus(off, validation=True)
                             if off.val_path else None)[0].blocks() is None
    assert len(dataset) == 1500 - 16  # local shards' default: a window at every position
    with pytest.raises(ConfigError, match="data_config.shards_at_once: must be 0"):
        config(folder, tokenizer, shards_at_once=-1)
