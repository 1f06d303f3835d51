"""tokens/text_ranges.py: a large text prepared in ranges, each range a token file of its own, gives
exactly the ids of its one token file (a tokenizer.json's, and a BPE trained on the text), shared by the
machine's processes as a set's files are."""
import re

import numpy as np
import pytest
from helpers import make_text

from mingpt import prepare_data
from mingpt.char_dataset import DataConfig, open_corpus, prepare_corpus, split_dataset
from mingpt.common.errors import DataError
from mingpt.tokens import text_ranges
from mingpt.tokens.tokenizer import train_bpe


@pytest.fixture
def large_text(tmp_path):
    """A text of about 20 KB, each version in its own folder (one token file, and ranges)."""
    text = make_text(20_000, seed=3)
    paths = []
    for name in ("whole", "ranges"):
        (tmp_path / name).mkdir()
        paths.append(tmp_path / name / "corpus.txt")
        paths[-1].write_text(text)
    return paths


def all_ids(dataset) -> np.ndarray:
    return dataset.token_ids(np.arange(dataset.num_chars)).numpy()


@pytest.mark.parametrize("tokenizer", ["tokenizer.json", "bpe"])
def test_a_text_in_ranges_has_the_ids_of_its_one_token_file(large_text, tmp_path, monkeypatch, tokenizer):
    whole, ranged = large_text
    if tokenizer == "tokenizer.json":
        tokenizer = str(tmp_path / "tokenizer.json")
        train_bpe(iter([make_text(6000)]), vocab_size=300).save(tokenizer)
    settings = {"tokenizer": tokenizer, "bpe_vocab_size": 300, "block_size": 16}
    one_file = DataConfig(path=str(whole), **settings)
    prepare_corpus(one_file)
    expected = open_corpus(one_file)
    monkeypatch.setattr(text_ranges, "RANGE_BYTES", 3000)  # about 7 ranges
    in_ranges = DataConfig(path=str(ranged), **settings)
    prepare_corpus(in_ranges)
    dataset = open_corpus(in_ranges)
    parts = sorted(p.name for p in ranged.parent.glob("corpus.txt.part*.bpe.tokens"))
    assert len(parts) >= 5 and dataset.shards.describe() == f"{len(parts)} text shards"
    assert np.array_equal(all_ids(dataset), all_ids(expected))
    assert dataset.vocabulary.tokens == expected.vocabulary.tokens
    train, test = split_dataset(dataset, in_ranges, seed=0)
    expected_train, _ = split_dataset(expected, one_file, seed=0)
    assert np.array_equal(train[np.arange(50)].numpy(), expected_train[np.arange(50)].numpy())
    if tokenizer == "bpe":  # trained once, beside the ranges; gone, it is one line
        trained, = ranged.parent.glob("corpus.txt.bpe-*.tokenizer.json")
        trained.unlink()
        with pytest.raises(DataError, match=r"^data_config.path: \S+corpus.txt's BPE \S+ is missing"):
            open_corpus(in_ranges)


def test_prepare_data_prepares_the_ranges_with_two_processes(large_text, tmp_path, monkeypatch, capfd):
    """Two processes of the command share the ranges, each made once; a job's process (not the local
    main) then finds them all current."""
    _, ranged = large_text
    tokenizer = str(tmp_path / "tokenizer.json")
    train_bpe(iter([make_text(6000)]), vocab_size=300).save(tokenizer)
    monkeypatch.setattr(text_ranges, "RANGE_BYTES", 3000)
    prepare_data.main([str(ranged), "--tokenizer", tokenizer, "--processes", "2"])
    out = capfd.readouterr().out
    parts = sorted(p.name for p in ranged.parent.glob("corpus.txt.part*.bpe.tokens"))
    made = sorted(re.findall(r"^prepared .*/(corpus\.txt\.part\d+\.bpe\.tokens):", out, re.M))
    assert len(parts) >= 5 and made == parts, out  # each range once
    assert re.search(rf"in ranges: {len(parts)} prepared now, [\d.]+ MB/s with 2 processes", out), out
    times = {p: p.stat().st_mtime_ns for p in ranged.parent.glob("corpus.txt.part*.bpe.tokens")}
    config = DataConfig(path=str(ranged), tokenizer=tokenizer, block_size=16)
    prepare_corpus(config, local_main=False)
    assert {p: p.stat().st_mtime_ns for p in times} == times
    assert open_corpus(config).num_chars > 0
