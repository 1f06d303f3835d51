"""tokens/token_file.py: the token file made once per machine, its format, its damage and its concurrency."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
from helpers import make_text
from tokenizers import Tokenizer

from mingpt.common.errors import DataError
from mingpt.common.files import CACHE_DIR_ENV
from mingpt.tokens import token_file
from mingpt.tokens.token_file import (
    encode_text,
    id_dtype,
    open_token_file,
    prepare,
    read_header,
    token_file_for,
)
from mingpt.tokens.tokenizer import TokenizerChoice

MIXED = "naïve café — ünïcödé ✓ 𝄞 ж中文\n"
"""Characters of 1, 2, 3 and 4 UTF-8 bytes."""


def write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def assert_matches(path: Path, text: str) -> None:
    """The token file holds exactly what encode_text gives, and decodes back to the text."""
    tokens = open_token_file(path)
    ids, vocab = encode_text(text)
    assert tokens.vocab == vocab == sorted(set(text))
    assert tokens.ids.dtype == ids.dtype and np.array_equal(tokens.ids, ids)
    assert "".join(tokens.vocab[i] for i in tokens.ids.tolist()) == text


def touch_later(path: Path) -> None:
    """Move the modification time on: a rewrite within one clock tick would keep it."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_streaming_equals_in_memory_encoding_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(token_file, "CHUNK_BYTES", 7)  # odd: multi-byte characters straddle chunks
    text = MIXED * 40 + make_text(300)
    source = write(tmp_path / "input.txt", text)
    path, built = prepare(source)
    assert built and path == tmp_path / "input.txt.tokens"
    assert_matches(path, text)
    assert open_token_file(path).ids.dtype == np.uint8
    assert prepare(source) == (path, False)


def test_ids_are_a_read_only_mapping_of_aligned_data(tmp_path):
    source = write(tmp_path / "input.txt", make_text(1000))
    path, _ = prepare(source)
    tokens = open_token_file(path)
    assert isinstance(tokens.ids, np.memmap) and tokens.ids.ndim == 1 and tokens.n_tokens == 1000
    assert read_header(path)["data_offset"] % token_file.ALIGN == 0
    with pytest.raises(ValueError):
        tokens.ids[0] = 1


def test_id_type_is_the_narrowest_that_holds_the_vocabulary():
    assert [id_dtype(n) for n in (1, 256, 257, 65536, 65537)] == \
        [np.uint8, np.uint8, np.uint16, np.uint16, np.uint32]


def test_wide_vocabulary_takes_uint16_ids_and_round_trips(tmp_path, monkeypatch):
    monkeypatch.setattr(token_file, "CHUNK_BYTES", 1000)
    cjk = "".join(chr(0x4E00 + i) for i in range(400))
    text = (cjk + "\n" + make_text(200)) * 3
    path, _ = prepare(write(tmp_path / "cjk.txt", text))
    assert open_token_file(path).ids.dtype == np.uint16 and len(open_token_file(path).vocab) > 256
    assert_matches(path, text)


def test_vocabulary_over_65536_characters_takes_uint32_ids(tmp_path):
    text = "".join(chr(c) for c in range(0x20000, 0x20000 + 70000)) + "ab"
    path, _ = prepare(write(tmp_path / "wide.txt", text))
    assert open_token_file(path).ids.dtype == np.uint32
    assert_matches(path, text)


def test_changed_source_is_rebuilt(tmp_path):
    source = tmp_path / "input.txt"
    write(source, "aaaa bbbb\n")
    path, _ = prepare(str(source))
    write(source, "cccc dddd\n")  # same size: only the modification time tells
    touch_later(source)
    assert prepare(str(source)) == (path, True)
    assert_matches(path, "cccc dddd\n")
    write(source, "a longer text now\n")
    assert prepare(str(source)) == (path, True)
    assert_matches(path, "a longer text now\n")


def test_truncated_token_file_is_refused_by_open_and_rebuilt_by_prepare(tmp_path):
    text = make_text(5000)
    source = write(tmp_path / "input.txt", text)
    path, _ = prepare(source)
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(DataError, match="truncated.*prepare the data again"):
        open_token_file(path)
    assert prepare(source) == (path, True)
    assert_matches(path, text)


def test_corrupted_token_file_is_rebuilt(tmp_path):
    text = make_text(5000)
    source = write(tmp_path / "input.txt", text)
    path, _ = prepare(source)
    offset = read_header(path)["data_offset"] + 1234
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))
    assert prepare(source) == (path, True)
    assert_matches(path, text)


def test_garbage_under_the_final_name_is_refused_and_rebuilt(tmp_path):
    source = write(tmp_path / "input.txt", "some text\n")
    path = token_file_for(source)
    path.write_bytes(b"not a token file at all")
    with pytest.raises(DataError, match="not a token file"):
        open_token_file(path)
    assert prepare(source) == (path, True)
    assert_matches(path, "some text\n")


def test_missing_token_file_says_to_prepare(tmp_path):
    with pytest.raises(DataError, match="does not exist; prepare the data first"):
        open_token_file(tmp_path / "x.tokens")


def slowed_preparation(chunk_bytes: int, pause_s: float) -> str:
    """The start of a child script whose token_file writes chunk_bytes at a time, pausing after each."""
    return f"""
import json, os, sys, time
from mingpt.tokens import token_file
token_file.CHUNK_BYTES = {chunk_bytes}
write = token_file.write_ids
def slow(chunks):
    for ids in chunks:
        time.sleep({pause_s})
        yield ids
token_file.write_ids = lambda out, chunks: write(out, slow(chunks))
"""


KILLABLE = slowed_preparation(64, 0.01) + """
token_file.prepare(sys.argv[1])
"""


def start_slow_preparation(source: str) -> subprocess.Popen:
    """A preparation whose writing takes several seconds (64-byte chunks, 10 ms each)."""
    return subprocess.Popen([sys.executable, "-c", KILLABLE, source], stdout=subprocess.PIPE,
                            text=True)


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_killed_preparation_leaves_no_partial_file(tmp_path):
    text = make_text(20000)
    source = write(tmp_path / "input.txt", text)
    path = token_file_for(source)
    child = start_slow_preparation(source)
    leftovers = lambda: list(tmp_path.glob("input.txt.tokens.*.tmp"))  # noqa: E731
    try:
        wait_for(lambda: leftovers() and leftovers()[0].stat().st_size > 0)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert leftovers() and not path.exists()  # killed mid-write: the partial file kept its own name
    assert prepare(source) == (path, True)
    assert_matches(path, text)
    assert not leftovers()


CONCURRENT = slowed_preparation(256, 0.002) + """
source, ready, go = sys.argv[1:]
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.005)
path, built = token_file.prepare(source)
print(json.dumps([str(path), built]), flush=True)
"""


@pytest.mark.slow
def test_concurrent_preparations_build_once(tmp_path):
    text = make_text(60000)
    source = write(tmp_path / "input.txt", text)
    go = tmp_path / "go"
    children = [subprocess.Popen([sys.executable, "-c", CONCURRENT, source, tmp_path / f"ready{i}", go],
                                 stdout=subprocess.PIPE, text=True) for i in range(2)]
    wait_for(lambda: all((tmp_path / f"ready{i}").exists() for i in range(2)))
    go.touch()  # both start preparing at the same moment
    results = [json.loads(child.communicate(timeout=60)[0]) for child in children]
    assert all(child.returncode == 0 for child in children)
    assert {path for path, _ in results} == {str(token_file_for(source))}
    assert sorted(built for _, built in results) == [False, True]
    assert_matches(token_file_for(source), text)


@pytest.mark.parametrize("content, problem", [
    (b"good text then \xff bad", r"is not UTF-8 text \(invalid start byte at byte 15\)"),
    (b"cut short \xe2\x9c", r"is not UTF-8 text \(unexpected end of data at byte 10\)"),
    (b"", r"is empty"),
])
def test_unusable_text_names_the_config_key(tmp_path, monkeypatch, content, problem):
    monkeypatch.setattr(token_file, "CHUNK_BYTES", 4)  # the byte counts hold across chunks
    source = tmp_path / "bad.txt"
    source.write_bytes(content)
    with pytest.raises(DataError, match=f"^data_config.path: {re.escape(str(source))} {problem}") as info:
        prepare(str(source))
    assert "\n" not in str(info.value)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bad.txt"]  # no token file, lock or temporary


def test_missing_source_names_the_config_key(tmp_path):
    with pytest.raises(DataError, match="^data_config.path: no such file .*point data_config.path"):
        prepare(str(tmp_path / "missing.txt"))
    assert list(tmp_path.iterdir()) == []


def test_folder_as_source_cannot_be_read(tmp_path):
    with pytest.raises(DataError, match="^data_config.path: cannot read"):
        prepare(str(tmp_path))


def test_full_disk_is_a_data_error_and_leaves_nothing(tmp_path, monkeypatch):
    def disk_full(out, chunks):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(token_file, "write_ids", disk_full)
    source = write(tmp_path / "input.txt", "some text\n")
    with pytest.raises(DataError, match="^cannot write the token file .*No space left on device"):
        prepare(source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["input.txt"]  # no lock left either


def test_url_source_is_cached_in_the_cache_folder(tmp_path):
    fs = fsspec.filesystem("memory")
    key = f"/corpus-{uuid.uuid4().hex}/input.txt"
    text = MIXED * 10
    fs.pipe(key, text.encode("utf-8"))
    source = f"memory:/{key}"
    try:
        path, built = prepare(source, cache_dir=str(tmp_path / "cache"))
        assert built and path.parent == tmp_path / "cache"
        assert re.fullmatch(r"input\.txt-[0-9a-f]{16}\.tokens", path.name)
        assert_matches(path, text)
        assert prepare(source, cache_dir=str(tmp_path / "cache")) == (path, False)
        fs.pipe(key, (MIXED * 11).encode("utf-8"))
        assert prepare(source, cache_dir=str(tmp_path / "cache")) == (path, True)
        assert_matches(path, MIXED * 11)
    finally:
        fs.rm(key)


def test_cache_folder_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "env-cache"))
    assert token_file_for("s3://bucket/data/input.txt").parent == tmp_path / "env-cache"
    assert token_file_for("s3://bucket/other/input.txt") != token_file_for("s3://bucket/data/input.txt")
    assert token_file_for("s3://b/x.txt", str(tmp_path / "given")).parent == tmp_path / "given"
    assert token_file_for(f"file://{tmp_path}/a.txt") == tmp_path / "a.txt.tokens"


def test_read_only_folder_sends_a_local_source_to_the_cache(tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    source = write(folder / "input.txt", "read only\n")
    # chmod would not stop root, who runs these tests in some places
    monkeypatch.setattr(token_file, "folder_is_writable", lambda f: Path(f) != folder)
    path, _ = prepare(source, cache_dir=str(tmp_path / "cache"))
    assert path.parent == tmp_path / "cache" and re.fullmatch(r"input\.txt-[0-9a-f]{16}\.tokens", path.name)
    assert_matches(path, "read only\n")
    assert sorted(p.name for p in folder.iterdir()) == ["input.txt"]


def test_a_bpe_token_file_holds_the_tokenizers_ids_and_the_tokenizer(tmp_path):
    """Beside the characters' file, a file of its own; its ids are the tokenizer's, streamed."""
    text = make_text(8000) + MIXED
    source = write(tmp_path / "input.txt", text)
    chars, _ = prepare(source)
    path, built = prepare(source, choice=TokenizerChoice("bpe", vocab_size=300))
    assert built and path == tmp_path / "input.txt.bpe.tokens" and chars.exists()
    tokens = open_token_file(path)
    tokenizer = Tokenizer.from_str(tokens.tokenizer)
    assert tokens.ids.dtype == np.uint16 and len(tokens.vocab) == 300
    assert tokens.settings == {"kind": "bpe", "vocab_size": 300, "sample_bytes": 8_000_000, "recipe": 1}
    assert tokens.ids.tolist() == tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(tokens.ids.tolist()) == text


def test_other_tokenizer_settings_or_another_tokenizer_file_make_the_file_again(tmp_path):
    source = write(tmp_path / "input.txt", make_text(8000))
    bpe = TokenizerChoice("bpe", vocab_size=300)
    path, _ = prepare(source, choice=bpe)
    assert prepare(source, choice=TokenizerChoice("bpe", vocab_size=300)) == (path, False)
    assert prepare(source, choice=TokenizerChoice("bpe", vocab_size=290)) == (path, True)
    given = tmp_path / "tokenizer.json"
    given.write_text(open_token_file(path).tokenizer)
    assert prepare(source, choice=TokenizerChoice(str(given))) == (path, True)
    assert prepare(source, choice=TokenizerChoice(str(given))) == (path, False)
    given.write_text(json.dumps({**json.loads(given.read_text()), "truncation": None}, indent=1))  # new bytes
    assert prepare(source, choice=TokenizerChoice(str(given))) == (path, True)


def test_a_version_1_file_of_characters_is_read_and_not_made_again(tmp_path):
    """Token files written before BPE stay usable: same ids, no rebuild of a large corpus."""
    text = make_text(2000)
    source = write(tmp_path / "input.txt", text)
    path, _ = prepare(source)
    header = read_header(path)
    old = {k: v for k, v in header.items() if k not in ("tokenizer", "vocab_size")}
    body = token_file.header_bytes({**old, "version": 1})
    with open(path, "r+b") as f:
        f.write(body + b"\0" * (header["data_offset"] - len(body)))
    assert read_header(path)["tokenizer"] == {"kind": "char"}
    assert prepare(source) == (path, False)
    assert_matches(path, text)


def test_an_empty_text_is_refused_for_a_bpe_too(tmp_path):
    source = write(tmp_path / "empty.txt", "")
    with pytest.raises(DataError, match="is empty"):
        prepare(source, choice=TokenizerChoice("bpe", vocab_size=300))
    assert not (tmp_path / "empty.txt.bpe.tokens").exists()
