"""tokens/windows.py: the train and test splits of a dataset's windows (the original's seeded random
split with its sample counts, the contiguous one that shares no character), and an evaluation's
windows spread over its split. Through char_dataset.split_dataset, the original's call, which hands
DataConfig's keys to split_windows."""
import pytest
import torch
from helpers import make_text

from mingpt.char_dataset import CharDataset, DataConfig, inputs_and_targets, split_dataset
from mingpt.common.errors import DataError


def dataset_of(text: str, block_size: int = 8) -> CharDataset:
    return CharDataset(text, block_size)


def config(**overrides) -> DataConfig:
    return DataConfig(**{"path": "unused", "block_size": 8, **overrides})


def test_random_split_is_seeded_and_keeps_the_original_counts():
    ds = dataset_of(make_text(2000))
    train, test = split_dataset(ds, config(train_split=0.9), seed=3)
    again, _ = split_dataset(ds, config(train_split=0.9), seed=3)
    other, _ = split_dataset(ds, config(train_split=0.9), seed=4)
    assert len(train) == int(len(ds) * 0.9) and len(test) == len(ds) - len(train)
    starts = train.starts(torch.arange(len(train))).tolist()
    test_starts = test.starts(torch.arange(len(test))).tolist()
    assert starts == again.starts(torch.arange(len(train))).tolist()
    assert starts != other.starts(torch.arange(len(train))).tolist()
    assert sorted(starts + test_starts) == list(range(len(ds)))  # disjoint, and nothing left out


def test_contiguous_split_shares_no_character():
    text = make_text(2000)
    ds = dataset_of(text, block_size=8)
    train, test = split_dataset(ds, config(split="contiguous", train_split=0.75), seed=0)
    cut = int(len(text) * 0.75)
    train_starts = train.starts(torch.arange(len(train)))
    test_starts = test.starts(torch.arange(len(test)))
    last_train_char = int(train_starts.max()) + 8  # the last target of the last train window
    first_test_char = int(test_starts.min())
    assert last_train_char < cut <= first_test_char
    assert int(test_starts.max()) == len(ds) - 1


def test_a_bounded_evaluation_of_a_stretch_of_text_reads_windows_spread_over_it_without_overlap():
    """A contiguous test split (as a val_path) bounded to 40 windows: block_size apart at least (a
    window's last target is at most the next one's first input), from its start to near its end;
    asked for more than it holds, every such window, tiling it as llm.c's validation reads it."""
    text = make_text(5000)
    ds = dataset_of(text, block_size=8)
    _, test = split_dataset(ds, config(split="contiguous", train_split=0.5), seed=0)
    spread = test.spread(40)
    starts = spread.starts(torch.arange(len(spread)))
    assert len(spread) == 40 and int(starts[0]) == int(test.starts(0))
    assert int(torch.diff(starts).min()) >= 8
    assert int(starts[-1]) > int(starts[0]) + 0.9 * len(test)  # its last stretch too, not its first 40
    x, y = inputs_and_targets(spread[torch.tensor([3])])
    assert ds.decode(x[0]) == text[int(starts[3]):int(starts[3]) + 8]
    assert ds.decode(y[0]) == text[int(starts[3]) + 1:int(starts[3]) + 9]
    every = test.spread(10**6)
    assert every.starts(torch.arange(len(every))).tolist() == list(range(int(test.starts(0)), len(ds), 8))


def test_consecutive_windows_are_spread_as_they_lie_and_the_random_split_is_not_spread():
    ds = dataset_of(make_text(3000), block_size=8)
    _, random_test = split_dataset(ds, config(), seed=0)
    assert random_test.spread(10) is None  # a seeded subset of its permutation instead (data_loader.py)
    ds.in_consecutive_windows()
    _, test = split_dataset(ds, config(split="contiguous", train_split=0.5), seed=0)
    spread = test.spread(10)
    first = int(test.starts(0))
    assert spread.step == 1  # these windows do not overlap already: evenly spaced among them
    assert spread.starts(torch.arange(10)).tolist() == [first + n * len(test) // 10 for n in range(10)]


def test_split_that_leaves_a_side_empty_is_refused():
    ds = dataset_of("abcdefghijk", block_size=8)  # 3 samples
    with pytest.raises(DataError, match="train_split"):
        split_dataset(ds, config(train_split=0.1), seed=0)
