"""tokens/sources.py: the kind of data a path names, decided in one place (source_of), and every kind
behind the same two steps, prepare on each machine and open into ids and a Vocabulary."""
import json

import numpy as np
import pytest
from helpers import make_text, write_llmc_shard

from mingpt.common.errors import DataError
from mingpt.tokens import text_ranges
from mingpt.tokens.sources import (
    PATH_KEY,
    VAL_PATH_KEY,
    OneText,
    SetOfTexts,
    Shards,
    SourceSettings,
    TextInRanges,
    TokenIds,
    source_of,
)
from mingpt.tokens.tokenizer import TokenizerChoice, train_bpe


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TokenizerChoice:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe(iter([make_text(6000)]), vocab_size=300).save(str(path))
    return TokenizerChoice(str(path))


@pytest.fixture
def corpora(tmp_path, monkeypatch) -> dict:
    """One path of each shape: a text, a text over RANGE_BYTES (made small), a folder and a glob of
    texts, a JSON lines file, a shard, a folder and a glob of shards, a .bin file read as a text."""
    monkeypatch.setattr(text_ranges, "RANGE_BYTES", 4000)
    (tmp_path / "text.txt").write_text(make_text(3000))
    (tmp_path / "large.txt").write_text(make_text(9000, seed=1))
    (tmp_path / "texts").mkdir()
    for i in range(2):
        (tmp_path / "texts" / f"part_{i}.txt").write_text(make_text(800, seed=i))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": make_text(300, seed=s)}) + "\n"
                                                 for s in range(3)))
    (tmp_path / "shards").mkdir()
    for i in range(2):
        write_llmc_shard(tmp_path / "shards" / f"train_{i}.bin", np.arange(100) % 300)
    paths = {name: tmp_path / name for name in ("text.txt", "large.txt", "texts", "docs.jsonl", "shards")}
    paths.update({"texts/*.txt": tmp_path / "texts" / "*.txt", "shards/*.bin": tmp_path / "shards" / "*.bin",
                  "one shard": tmp_path / "shards" / "train_0.bin"})
    return {name: str(path) for name, path in paths.items()}


KINDS = {"text.txt": OneText, "large.txt": TextInRanges, "texts": SetOfTexts, "texts/*.txt": SetOfTexts,
         "docs.jsonl": SetOfTexts, "shards": Shards, "shards/*.bin": Shards, "one shard": Shards}


@pytest.mark.parametrize("name", KINDS)
def test_each_shape_of_path_is_one_kind_and_reads_through_the_same_two_steps(corpora, tokenizer, name):
    """A BPE's tokenizer.json for all (shards need it; a large text is prepared in ranges only under a
    BPE): the kind, then prepare and open give ids and the tokenizer's vocabulary, whatever the kind."""
    source = source_of(corpora[name], PATH_KEY, SourceSettings(tokenizer))
    assert type(source) is KINDS[name] and source.key == PATH_KEY
    source.prepare(local_main=True)
    data = source.open()
    assert isinstance(data, TokenIds) and len(data.ids) > 0 and len(data.vocabulary) == 300
    assert int(np.asarray(data.ids[np.arange(len(data.ids))]).max()) < 300


def test_the_format_and_the_tokenizer_change_the_kind_as_they_say(corpora, tokenizer):
    """format=text reads a .bin file as a text; characters keep a large text in one token file (they
    need the whole text's characters before any id)."""
    as_text = source_of(corpora["one shard"], PATH_KEY, SourceSettings(tokenizer, format="text"))
    assert type(as_text) is OneText
    assert type(source_of(corpora["large.txt"], PATH_KEY, SourceSettings())) is OneText
    assert type(source_of(corpora["shards"], PATH_KEY, SourceSettings(tokenizer, format="llmc"))) is Shards


@pytest.mark.parametrize("name", ["text.txt", "texts"])
def test_a_val_path_text_or_set_of_characters_is_refused_before_anything_is_made(corpora, tmp_path, name):
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(DataError, match=r"^data_config.val_path: a text of its own needs data_config.tok"):
        source_of(corpora[name], VAL_PATH_KEY, SourceSettings())
    assert sorted(tmp_path.rglob("*")) == before


def test_only_local_rank_zero_makes_a_texts_token_file(corpora, tmp_path, tokenizer):
    """A text is made by one process per machine; a set by every process (each takes its share)."""
    text = source_of(corpora["text.txt"], PATH_KEY, SourceSettings())
    text.prepare(local_main=False)
    assert not (tmp_path / "text.txt.tokens").exists()
    text.prepare(local_main=True)
    assert (tmp_path / "text.txt.tokens").exists()
    texts = source_of(corpora["texts"], PATH_KEY, SourceSettings(tokenizer))
    texts.prepare(local_main=False)
    assert len(list((tmp_path / "texts").glob("*.txt.bpe.tokens"))) == 2
