"""char_dataset.py, the original's file: the vocabulary of sorted characters, every position a sample
(x and y shifted by one), a batch gathered at once, DataConfig's refusals naming the key, truncation
keeping its own vocabulary, and a corpus read through fsspec or refused in one line. The splits and
an evaluation's windows: tests/tokens/test_windows.py."""
import numpy as np
import pytest
import torch
from helpers import make_text, serving

from mingpt.char_dataset import (
    CharDataset,
    DataConfig,
    open_corpus,
    prepare_corpus,
)
from mingpt.common.errors import ConfigError, DataError


def dataset_of(text: str, block_size: int = 8) -> CharDataset:
    return CharDataset(text, block_size)


def test_vocabulary_is_the_sorted_characters():
    ds = dataset_of("hello world")
    assert ds.vocab == sorted(set("hello world"))
    assert ds.decode(ds.token_ids(np.arange(11))) == "hello world"
    assert torch.equal(ds.encode("lol"), torch.tensor([ds.vocab.index(ch) for ch in "lol"]))


def test_unicode_text_round_trips():
    text = "naïve café — ünïcödé ✓ 𝄞 " * 3
    ds = dataset_of(text)
    assert ds.decode(ds.token_ids(np.arange(len(text)))) == text and ds.vocab == sorted(set(text))


def test_every_position_is_a_sample_of_shifted_slices():
    text = make_text(500)
    ds = dataset_of(text, block_size=8)
    assert len(ds) == len(text) - 8
    x, y = ds[len(ds) - 1]
    assert ds.decode(x) == text[-9:-1] and ds.decode(y) == text[-8:]
    x, y = ds[3]
    assert ds.decode(x) == text[3:11] and ds.decode(y) == text[4:12]


def test_a_batch_of_starts_is_gathered_at_once():
    """Encoded once, one byte per character: a batch is one gather from the ids."""
    text = make_text(500)
    ds = dataset_of(text)
    assert ds.ids.dtype == np.uint8
    x, y = ds[torch.tensor([3, 100, 491])]
    assert x.shape == y.shape == (3, 8) and x.dtype == torch.int64
    assert [ds.decode(row) for row in x] == [text[3:11], text[100:108], text[491:499]]
    assert torch.equal(y[:, :-1], x[:, 1:])
    with pytest.raises(IndexError):
        ds[torch.tensor([492])]


def config(**overrides) -> DataConfig:
    return DataConfig(**{"path": "unused", "block_size": 8, **overrides})


@pytest.mark.parametrize("overrides, key", [
    (dict(train_split=1.0), "data_config.train_split"),
    (dict(train_split=0.0), "data_config.train_split"),
    (dict(block_size=0), "data_config.block_size"),
    (dict(truncate=0.0), "data_config.truncate"),
    (dict(split="shuffled"), "data_config.split"),
    (dict(bpe_vocab_size=256), "data_config.bpe_vocab_size"),  # the byte tokens alone: no merge
    (dict(bpe_vocab_size=2**32 + 1), "data_config.bpe_vocab_size"),  # more than uint32 ids hold
    (dict(tokenizer=""), "data_config.tokenizer"),
    (dict(bpe_sample_mb=0), "data_config.bpe_sample_mb"),
])
def test_bad_data_configs_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        config(**overrides)
    assert error.value.key == key


def corpus(path, **overrides) -> CharDataset:
    """What main.py does: prepare the token file, then open it."""
    data_config = config(path=str(path), **overrides)
    prepare_corpus(data_config)
    return open_corpus(data_config)


def test_truncating_keeps_the_leading_text_and_its_own_vocabulary(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abab" * 250 + "xyz" * 100)
    ds = corpus(path, truncate=0.25)
    assert ds.num_chars == 325 and len(ds) == 325 - 8
    assert ds.vocab == ["a", "b"]  # the original's: the characters of the text it trains on
    x, _ = ds[torch.tensor([0])]
    assert ds.decode(x[0]) == "abababab" and int(x.max()) == 1
    assert corpus(path).vocab == ["a", "b", "x", "y", "z"]


def test_a_bpe_corpus_keeps_its_tokenizers_vocabulary_whatever_is_truncated(tmp_path):
    """The tokens are the tokenizer's ids (its vocabulary, even of a share without some of them);
    a window decodes to its text."""
    path = tmp_path / "t.txt"
    path.write_text(make_text(8000))
    whole = corpus(path, tokenizer="bpe", bpe_vocab_size=300)
    assert not whole.vocabulary.is_char and whole.vocab_size == 300 and whole.unit == "tokens"
    part = corpus(path, tokenizer="bpe", bpe_vocab_size=300, truncate=0.01)
    assert len(np.unique(part.ids)) < 100 and part.vocabulary == whole.vocabulary  # few tokens, all kept
    positions = np.arange(part.num_chars)
    assert torch.equal(part.token_ids(positions), whole.token_ids(positions))  # ids as they are
    first = whole.decode(whole.windows(torch.tensor([0]))[0])
    assert path.read_text().startswith(first) and len(whole.encode(first)) == whole.block_size + 1


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe not utf-8", "not UTF-8"),
    (b"short", "not smaller than the text"),
])
def test_unusable_text_is_refused(tmp_path, content, message):
    path = tmp_path / "t.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        corpus(path)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        corpus(tmp_path / "absent.txt")


def test_a_url_is_read_through_fsspec_like_any_text(tmp_path):
    body = make_text(3000)
    with serving(body.encode()) as (url, _):
        config = DataConfig(path=url, block_size=16, cache_dir=str(tmp_path))
        prepare_corpus(config)
    dataset = open_corpus(config)  # from the token file in the cache folder, the server gone
    assert dataset.decode(dataset.token_ids(range(len(body)))) == body


def test_an_unreachable_url_says_what_to_do(tmp_path):
    with pytest.raises(DataError) as error:
        prepare_corpus(DataConfig(path="http://127.0.0.1:9/input.txt", cache_dir=str(tmp_path)))
    assert str(error.value) == (
        "data_config.path: cannot fetch http://127.0.0.1:9/input.txt (not there, or no network); check "
        "the URL, or download the text and point data_config.path at the copy")
    assert list(tmp_path.iterdir()) == []
