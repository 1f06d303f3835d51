"""tokens/text_set.py and its wiring: a folder or glob of texts, JSON lines and Parquet files, each
prepared once into a token file of its own (by every process of the machine in turn), read as one
stream; each bad input one line, with nothing left written."""
import json
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from helpers import assert_ok, make_text, refused_leaving_nothing, run_main_in_process, tiny_overrides
from tokenizers import Tokenizer

from mingpt import prepare_data
from mingpt.char_dataset import DataConfig, open_corpus, prepare_corpus, split_dataset
from mingpt.common.errors import DataError
from mingpt.tokens import token_file
from mingpt.tokens.text_set import TextSet, prepare_set
from mingpt.tokens.tokenizer import END_OF_TEXT, TokenizerChoice, train_bpe

VOCAB = 300


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE of 300 tokens with <|endoftext|> (id 0), saved as a tokenizer.json."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe(iter([make_text(6000)]), vocab_size=VOCAB, special_tokens=[END_OF_TEXT]).save(str(path))
    return path


def encode(tokenizer: Path, text: str) -> list[int]:
    return Tokenizer.from_file(str(tokenizer)).encode(text, add_special_tokens=False).ids


def texts_folder(folder: Path, count: int = 3, chars: int = 1500) -> list[str]:
    """count texts, written last first (the set's order is their names')."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = [make_text(chars, seed=i) for i in range(count)]
    for i in reversed(range(count)):
        (folder / f"part_{i:03d}.txt").write_text(texts[i])
    return texts


def write_jsonl(path: Path, documents: list[str], field: str = "text") -> Path:
    lines = [json.dumps({"id": i, field: doc}) for i, doc in enumerate(documents)]
    path.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")  # a blank line is skipped
    return path


def write_parquet(path: Path, documents: list[str], field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(documents))), field: documents}), path, row_group_size=2)
    return path


def config(path, tokenizer_json, **overrides) -> DataConfig:
    return DataConfig(**{"path": str(path), "tokenizer": str(tokenizer_json), "block_size": 16, **overrides})


def all_ids(dataset) -> np.ndarray:
    return dataset.token_ids(np.arange(dataset.num_chars)).numpy()


DOCUMENTS = [make_text(120, seed=s) for s in range(10, 15)]


# ------------------------------------------------------------------------------------- reading sets

def test_a_folder_of_texts_is_one_stream_of_its_files_in_name_order(tmp_path, tokenizer):
    """Each text is encoded as it is (no separator added), the token files read one after the other:
    a window straddles two files; a glob names the same set; the split and a batch work as for shards."""
    texts = texts_folder(tmp_path / "set")
    (tmp_path / "set" / "README.md").write_text("not a text of the set")
    data = config(tmp_path / "set", tokenizer)
    prepare_corpus(data)
    dataset = open_corpus(data)
    expected = np.concatenate([encode(tokenizer, text) for text in texts])
    assert dataset.shards.describe() == "3 text shards" and dataset.vocab_size == VOCAB
    assert np.array_equal(all_ids(dataset), expected)
    boundary = len(encode(tokenizer, texts[0]))
    window = dataset.windows(np.array([boundary - 5]))[0].numpy()
    assert np.array_equal(window, expected[boundary - 5:boundary + 12])
    by_glob = config(tmp_path / "set" / "part_*.txt", tokenizer)
    prepare_corpus(by_glob)
    assert np.array_equal(all_ids(open_corpus(by_glob)), expected)
    train, test = split_dataset(dataset, data, seed=0)
    assert len(train) + len(test) == len(expected) - 16
    assert train[torch.arange(4)].shape == (4, 17)


def test_json_lines_documents_end_with_end_of_text_under_their_field(tmp_path, tokenizer):
    """A .jsonl file alone is a set of one: each document (data_config.text_field) encoded on its own,
    then <|endoftext|>; blank lines skipped."""
    source = write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS, field="content")
    data = config(source, tokenizer, text_field="content")
    prepare_corpus(data)
    dataset = open_corpus(data)
    expected = [i for doc in DOCUMENTS for i in encode(tokenizer, doc) + [0]]
    assert dataset.shards is None and all_ids(dataset).tolist() == expected
    assert dataset.decode(torch.tensor(expected)) == "".join(doc + END_OF_TEXT for doc in DOCUMENTS)


def test_parquet_documents_are_read_from_their_column(tmp_path, tokenizer):
    """With a JSON lines file in one folder: one stream, documents ended alike."""
    folder = tmp_path / "set"
    folder.mkdir()
    write_parquet(folder / "a.parquet", DOCUMENTS[:3])
    write_jsonl(folder / "b.jsonl", DOCUMENTS[3:])
    data = config(folder, tokenizer)
    prepare_corpus(data)
    dataset = open_corpus(data)
    assert dataset.shards.describe() == "2 text shards"
    assert all_ids(dataset).tolist() == [i for doc in DOCUMENTS for i in encode(tokenizer, doc) + [0]]


def test_a_remote_set_is_read_as_the_same_set_on_disk(tmp_path, tokenizer, s3, monkeypatch):
    """Texts, JSON lines and Parquet behind a folder's URL (and a glob's), through s3fs: the ids of the
    same files on disk; token files and a trained BPE in the cache folder, nothing written to the store."""
    for key, value in {**s3.env(), "MINGPT_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    local = tmp_path / "set"
    texts_folder(local, count=2)
    write_jsonl(local / "part_002.jsonl", DOCUMENTS[:3])
    write_parquet(local / "part_003.parquet", DOCUMENTS[3:])
    remote = f"s3://{s3.bucket}/{tmp_path.name}"
    store = fsspec.filesystem("s3", skip_instance_cache=True)
    store.put(f"{local}/", f"{remote}/", recursive=True)
    on_disk = config(local, tokenizer)
    prepare_corpus(on_disk)
    for path in (f"{remote}/", f"{remote}/part_*"):
        data = config(path, tokenizer)
        prepare_corpus(data)
        assert open_corpus(data).shards.describe() == "4 text shards"
        assert np.array_equal(all_ids(open_corpus(data)), all_ids(open_corpus(on_disk)))
    bpe = config(f"{remote}/part_*.jsonl", "bpe", bpe_vocab_size=280)
    prepare_corpus(bpe)
    assert open_corpus(bpe).vocab_size <= 280
    assert len(list((tmp_path / "cache").glob("bpe-*.tokenizer.json"))) == 1
    assert sorted(Path(name).name for name in store.ls(remote)) == sorted(p.name for p in local.iterdir()
                                                                          if "part_00" in p.name
                                                                          and "tokens" not in p.name)


def test_characters_of_a_set_of_one_end_documents_with_a_newline(tmp_path):
    data = DataConfig(path=str(write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)), block_size=16)
    prepare_corpus(data)
    dataset = open_corpus(data)
    assert dataset.vocabulary.is_char and dataset.decode(torch.from_numpy(all_ids(dataset))) == \
        "".join(doc + "\n" for doc in DOCUMENTS)


def character_texts(folder: Path) -> list[str]:
    """Three texts of different characters (lower case; upper case; accented letters and digits),
    written last first."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = [make_text(1500, seed=0), make_text(1500, seed=1).upper(),
             make_text(1500, seed=2).replace("a", "ä").replace("o", "ø") + " 0123456789"]
    for i in reversed(range(3)):
        (folder / f"part_{i}.txt").write_text(texts[i])
    return texts


def test_characters_of_a_set_are_one_vocabulary_the_union_of_its_texts(tmp_path, monkeypatch):
    """tokenizer=char (the default) on a folder of texts: one vocabulary, the sorted union of their
    characters, counted once and kept beside them with each file's own; every file's token file of
    it. A changed file is counted and made again alone; a character new to the set makes every file
    again."""
    texts = character_texts(tmp_path / "set")
    data = DataConfig(path=str(tmp_path / "set"), block_size=16)
    prepare_corpus(data)
    dataset = open_corpus(data)
    assert dataset.vocab == sorted(set("".join(texts))) and dataset.unit == "characters"
    assert dataset.shards.describe() == "3 text shards"
    assert dataset.decode(torch.from_numpy(all_ids(dataset))) == "".join(texts)
    made = sorted((tmp_path / "set").glob("*.txt.tokens"))
    assert len(made) == 3 and all(token_file.read_header(p)["vocab"] == dataset.vocab for p in made)
    [record] = (tmp_path / "set").glob("chars-*.json")
    assert [chars for _, chars in json.loads(record.read_text())["files"]] == \
        ["".join(sorted(set(text))) for text in texts]

    counted, said = [], []
    count = token_file.count_codepoints
    monkeypatch.setattr(token_file, "count_codepoints",
                        lambda source, *args: counted.append(Path(source).name) or count(source, *args))
    text_set = TextSet("data_config.path", tuple(map(str, sorted((tmp_path / "set").glob("*.txt")))),
                       data.sources.tokenizer)
    prepare_set(text_set, lambda source, path, now: said.append(now))
    assert counted == [] and said == [False] * 3  # nothing counted or made again

    (tmp_path / "set" / "part_1.txt").write_text(texts[1][::-1])  # other text, the same characters
    prepare_set(text_set, lambda source, path, now: said.append((Path(source).name, now)) if now else None)
    assert counted == ["part_1.txt"] and said[3:] == [("part_1.txt", True)]
    assert open_corpus(data).vocab == dataset.vocab

    (tmp_path / "set" / "part_2.txt").write_text(texts[2] + " ¿")
    prepare_corpus(data)
    grown = open_corpus(data)
    assert grown.vocab == sorted(set("".join(texts) + "¿"))
    assert grown.decode(torch.from_numpy(all_ids(grown))) == texts[0] + texts[1][::-1] + texts[2] + " ¿"
    assert all(token_file.read_header(p)["vocab"] == grown.vocab for p in made)


def test_a_truncated_set_of_characters_has_the_characters_of_its_share(tmp_path):
    """data_config.truncate over a set's stream: the original's vocabulary of the text trained on,
    here the first file and part of the second."""
    texts = character_texts(tmp_path / "set")
    data = DataConfig(path=str(tmp_path / "set"), block_size=16, truncate=0.5)
    prepare_corpus(data)
    dataset = open_corpus(data)
    kept = "".join(texts)[:dataset.num_chars]
    assert dataset.num_chars == len("".join(texts)) // 2 and dataset.vocab == sorted(set(kept))
    assert "ø" not in dataset.vocab and dataset.decode(torch.from_numpy(all_ids(dataset))) == kept


def test_a_character_outside_the_sets_is_refused_not_made_id_0(tmp_path):
    """A file encoded with the set's counted characters that has another one (it changed after the
    count) is refused, and no token file is left."""
    source = tmp_path / "part_0.txt"
    source.write_text("abba cab")
    with pytest.raises(DataError, match=f"^data_config.path: {source} changed while it was being prepared"):
        token_file.prepare(str(source), choice=TokenizerChoice(characters=" ab"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part_0.txt"]


def test_a_sets_bpe_is_trained_once_and_makes_every_file(tmp_path):
    """tokenizer=bpe: one tokenizer.json beside the set, with <|endoftext|>, made before any file;
    every file's token file made with it; a second preparation makes nothing."""
    texts = texts_folder(tmp_path / "set", count=2, chars=3000)
    write_jsonl(tmp_path / "set" / "c.jsonl", DOCUMENTS)
    data = DataConfig(path=str(tmp_path / "set"), tokenizer="bpe", bpe_vocab_size=300, block_size=16)
    prepare_corpus(data)
    [bpe] = (tmp_path / "set").glob("bpe-*.tokenizer.json")
    settings = TokenizerChoice(str(bpe)).settings()
    made = sorted((tmp_path / "set").glob("*.bpe.tokens"))
    assert len(made) == 3 and all(token_file.read_header(p)["tokenizer"] == settings for p in made)
    dataset = open_corpus(data)
    assert dataset.vocabulary.token_id(END_OF_TEXT) == 0
    assert dataset.num_chars == sum(len(encode(bpe, text)) for text in texts) + \
        sum(len(encode(bpe, doc)) + 1 for doc in DOCUMENTS)
    times = [p.stat().st_mtime_ns for p in made]
    text_set_of = TextSet("data_config.path", tuple(sorted(map(str, (tmp_path / "set").glob("*[tl]")))),
                          data.sources.tokenizer)
    said = []
    prepare_set(text_set_of, lambda source, path, now: said.append(now))
    assert said == [False] * 3 and [p.stat().st_mtime_ns for p in made] == times


# ---------------------------------------------------------------------------------------- preparing

def slow_logged_build(log: Path):
    """token_file.build, a quarter second longer (so that two processes meet), logging who made what."""
    build = token_file.build

    def logged(source, path, *args, **kwargs):
        time.sleep(0.25)
        build(source, path, *args, **kwargs)
        with open(log, "a") as out:
            out.write(f"{os.getpid()} {Path(source).name}\n")
    return logged


def prepare_after(barrier, one_set: TextSet) -> None:
    barrier.wait()
    prepare_set(one_set)


def test_two_processes_prepare_a_folder_together_each_file_once(tmp_path, tokenizer, monkeypatch):
    """Two real processes (forked, so they share the slowed build) on a folder of 6 texts: each file is
    made exactly once, and both made some (one took the files the other held)."""
    texts_folder(tmp_path / "set", count=6, chars=800)
    log = tmp_path / "made.log"
    monkeypatch.setattr(token_file, "build", slow_logged_build(log))
    files = tuple(sorted((tmp_path / "set").glob("*.txt")))
    one_set = TextSet("data_config.path", tuple(map(str, files)), TokenizerChoice(str(tokenizer)))
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    workers = [context.Process(target=prepare_after, args=(barrier, one_set)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [worker.exitcode for worker in workers] == [0, 0]
    made = [line.split() for line in log.read_text().splitlines()]
    assert sorted(name for _, name in made) == [f.name for f in files]  # each once
    assert len({pid for pid, _ in made}) == 2
    data = config(tmp_path / "set", tokenizer)
    assert open_corpus(data).num_chars == sum(len(encode(tokenizer, f.read_text())) for f in files)


def test_a_changed_file_is_prepared_again_alone(tmp_path, tokenizer):
    texts_folder(tmp_path / "set")
    data = config(tmp_path / "set", tokenizer)
    prepare_corpus(data)
    changed = tmp_path / "set" / "part_001.txt"
    changed.write_text(make_text(900, seed=7))
    files = tuple(sorted((tmp_path / "set").glob("*.txt")))
    made = []
    prepare_set(TextSet("data_config.path", tuple(map(str, files)), data.sources.tokenizer),
                lambda source, path, now: made.append(Path(source).name) if now else None)
    assert made == ["part_001.txt"]
    assert open_corpus(data).num_chars == sum(len(encode(tokenizer, f.read_text())) for f in files)


def test_a_current_set_starts_from_its_index_reading_no_header(tmp_path, tokenizer, monkeypatch):
    """Once prepared, a set's start-up (prepare, then open) reads no token file's header; a changed
    text is checked file by file and the index written again; a damaged index is ignored."""
    from mingpt.tokens import shards

    texts_folder(tmp_path / "set")
    data = config(tmp_path / "set", tokenizer)
    prepare_corpus(data)
    expected = all_ids(open_corpus(data))
    index, = (tmp_path / "set").glob("set-*.index.json")
    read = []
    for module in (token_file, shards):
        monkeypatch.setattr(module, "read_header", lambda path, real=token_file.read_header:
                            read.append(path) or real(path))

    def start_up() -> np.ndarray:
        prepare_corpus(data)
        return all_ids(open_corpus(data))

    assert np.array_equal(start_up(), expected) and read == []
    (tmp_path / "set" / "part_001.txt").write_text(make_text(900, seed=7))
    changed = start_up()
    assert read and not np.array_equal(changed, expected)
    read.clear()
    assert np.array_equal(start_up(), changed) and read == []
    index.write_text('{"files": [{"torn')
    assert np.array_equal(start_up(), changed) and read
    read.clear()
    assert np.array_equal(start_up(), changed) and read == []


def test_prepare_data_prepares_a_set_with_two_processes(tmp_path, tokenizer, capfd):
    """The command (in this process, one more forked): a line for each file made, each file once."""
    texts_folder(tmp_path / "set", count=4)
    prepare_data.main([str(tmp_path / "set"), "--tokenizer", str(tokenizer), "--processes", "2"])
    lines = capfd.readouterr().out.splitlines()
    made = sorted(re.fullmatch(r"prepared .*/(part_\d+\.txt)\.bpe\.tokens: [\d,]+ tokens", line)[1]
                  for line in lines[:-1])
    assert made == [f"part_{i:03d}.txt" for i in range(4)]
    assert re.fullmatch(r"4 files: 4 prepared now, 0 up to date; [\d,]+ tokens, vocabulary of 300, "
                        r"[\d.]+ MB/s with 2 processes", lines[-1])
    prepare_data.main([str(tmp_path / "set" / "*.txt"), "--tokenizer", str(tokenizer)])
    assert capfd.readouterr().out.startswith("4 files: 0 prepared now, 4 up to date; ")


# -------------------------------------------------------------------------------------- bad input

def bad_set(folder: Path, case: str, monkeypatch) -> tuple[str, dict, str]:
    """The data path, config keys and expected message (after "data_config.path: ") of one bad input;
    where the set has files, the bad one is its last, so that the good ones are made first."""
    folder.mkdir()
    texts_folder(folder, count=2, chars=400)
    overrides = {}
    if case == "empty folder":
        for text in folder.iterdir():
            text.unlink()
        return str(folder), overrides, f"the folder {folder} holds no .bin shards and no texts"
    if case == "glob matching nothing":
        return str(folder / "*.jsonl"), overrides, f"the glob {folder}/*.jsonl matches no file"
    bad = folder / "z.jsonl"
    if case == "a line not JSON":
        bad.write_text('{"text": "one"}\n{"text": "two"\n')
        expected = f"{bad} line 2 is not JSON (Expecting ',' delimiter, column 15)"
    elif case == "a line without the field":
        bad.write_text('{"text": "one"}\n\n{"body": "two"}\n')
        expected = f"{bad} line 3 has no \"text\" field (it has 'body'); set data_config.text_field"
    elif case == "a parquet file without the column":
        bad = write_parquet(folder / "z.parquet", DOCUMENTS, field="body")
        expected = f"{bad} has no column \"text\" (its columns: id, body); set data_config.text_field"
    elif case == "parquet without pyarrow":
        bad = write_parquet(folder / "z.parquet", DOCUMENTS)
        monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
        expected = f"{bad} is Parquet, which needs pyarrow: pip install 'mingpt-ddp[parquet]'"
    elif case == "a text not UTF-8":
        bad = folder / "z.txt"
        bad.write_bytes(b"good text, then \xff bad")
        expected = f"{bad} is not UTF-8 text (invalid start byte at byte 16)"
    elif case == "texts and shards":
        (folder / "train_000000.bin").write_bytes(bytes(2048))
        expected = (f"{folder}/part_000.txt is neither an llm.c shard (no magic number) nor a .bin file of "
                    f"nanoGPT's but a text, and {folder}/train_000000.bin a shard: a set is of texts")
    elif case == "a text not UTF-8 under characters":  # met counting the set's characters, before any file
        overrides["tokenizer"] = "char"
        bad = folder / "z.txt"
        bad.write_bytes(b"good text, then \xff bad")
        expected = f"{bad} is not UTF-8 text (invalid start byte at byte 16)"
    return str(folder), overrides, expected


BAD_INPUTS = ("empty folder", "glob matching nothing", "a line not JSON", "a line without the field",
              "a parquet file without the column", "parquet without pyarrow", "a text not UTF-8",
              "texts and shards", "a text not UTF-8 under characters")


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_sets_are_one_line_and_leave_nothing_written(tmp_path, tokenizer, monkeypatch, case):
    """Each is a DataError (one line, exit 1) naming the file (and line); the token files of the good
    files made before the bad one was met are removed: the folder is left as it was."""
    path, overrides, expected = bad_set(tmp_path / "set", case, monkeypatch)
    message = refused_leaving_nothing(tmp_path, config(path, tokenizer, **overrides))
    assert message.startswith(f"data_config.path: {expected}"), message


def test_the_rollback_spares_files_made_before_this_call(tmp_path, tokenizer):
    """A set prepared once, then given a bad file: the good files' token files stay (made before)."""
    texts_folder(tmp_path / "set", count=2)
    data = config(tmp_path / "set", tokenizer)
    prepare_corpus(data)
    kept = sorted((tmp_path / "set").glob("*.tokens"))
    (tmp_path / "set" / "z.jsonl").write_text("not json\n")
    with pytest.raises(DataError, match=r"z.jsonl line 1 is not JSON"):
        prepare_corpus(data)
    assert sorted((tmp_path / "set").glob("*.tokens")) == kept and len(kept) == 2


# ------------------------------------------------------------------------------------------ a run

@pytest.mark.slow
def test_a_run_on_a_folder_of_texts_of_characters_speaks_every_texts_characters(tmp_path, capsys,
                                                                               one_torch_thread):
    """main.py on a folder of three texts with the default tokenizer (characters): a few steps; the
    snapshot's vocabulary is every text's characters, and generate.py takes a prompt of characters
    from two of them and decodes what the model writes."""
    from mingpt import generate
    from mingpt.storage.snapshot import read_snapshot

    texts = character_texts(tmp_path / "train")
    snapshot = tmp_path / "snap.pt"
    result = run_main_in_process(tiny_overrides(tmp_path / "train", snapshot, trainer_config__max_steps=4),
                                 capsys)
    assert_ok(result)
    vocab = sorted(set("".join(texts)))
    assert re.search(rf"Data: 3 text shards, [\d,]+ characters of a vocabulary of {len(vocab)}\n",
                     result.stdout), result.stdout
    assert read_snapshot(str(snapshot)).vocab == vocab
    prompt = "THE KING ø"  # the second text's letters, the third's
    written = generate.generate(generate.parse_args(["--snapshot", str(snapshot), "--prompt", prompt,
                                                     "--length", "30", "--device", "cpu"]))
    assert written.startswith(prompt) and len(written) == len(prompt) + 30 and set(written) <= set(vocab)


@pytest.mark.slow
def test_a_run_on_a_folder_of_texts_with_its_own_validation(tmp_path, tokenizer, capsys, one_torch_thread):
    """main.py on a folder of 3 texts (prepared by the run itself) and a validation text set: a few
    steps and an evaluation; start-up names the set."""
    texts_folder(tmp_path / "train")
    write_jsonl(tmp_path / "val.jsonl", [make_text(300, seed=s) for s in range(20, 24)])
    settings = dict(data_config__val_path=tmp_path / "val.jsonl", data_config__tokenizer=tokenizer,
                    trainer_config__max_steps=4, trainer_config__eval_every_steps=2,
                    trainer_config__eval_batches=1, trainer_config__batch_size=8)
    result = run_main_in_process(tiny_overrides(tmp_path / "train", tmp_path / "snap", **settings), capsys)
    assert_ok(result)
    assert re.search(r"Data: 3 text shards, [\d,]+ tokens of a vocabulary of 300\n", result.stdout)
    assert re.search(rf"Data: {tmp_path}/train, [\d,]+ tokens in 3 text shards, vocabulary of 300; "
                     rf"validation {tmp_path}/val.jsonl, [\d,]+ tokens; ", result.stdout), result.stdout
    assert "| Eval Loss" in result.stdout
    assert len(list((tmp_path / "train").glob("*.bpe.tokens"))) == 3
