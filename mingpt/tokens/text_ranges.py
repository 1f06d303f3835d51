"""One large text prepared by every process of the machine: cut into ranges of about RANGE_BYTES, each
encoded into a token file of its own (`input.txt.part0000.bpe.tokens`, ...), the ranges read one after
the other as one stream.

A range ends where the BPE encoder itself may cut the text (bpe_encoder's word_cut, or line_cut for a
tokenizer that does not split GPT-2's way): the text's encoding there does not depend on what is on
either side, so the ranges' ids, one after the other, are exactly the ids of the text's one token
file, made by N processes at a time instead of one (each process of the machine takes every range
whose lock is free, as the files of a set: token_file.prepare_in_turn). The cuts are found again at
each start-up, from a window of CUT_WINDOW bytes read at each range's nominal start.

For a BPE only, trained on the text (once, with the recipe of the text's one token file, kept beside
the token files as `input.txt.bpe-<digest>.tokenizer.json`) or given as a tokenizer.json: characters
need the whole text's vocabulary before any id, and keep one token file. A text of RANGE_BYTES or
less keeps its one token file too.
"""
import hashlib
import json
from pathlib import Path
from typing import Optional

from mingpt.common import files
from mingpt.common.errors import DataError
from mingpt.tokens import token_file
from mingpt.tokens.bpe_encoder import line_cut, uses_gpt2_words, word_cut
from mingpt.tokens.shards import ShardStream, open_token_files
from mingpt.tokens.tokenizer import TokenizerChoice, train_bpe

RANGE_BYTES = 256 << 20
"""A range's nominal size: a 10 GB text is 40 ranges, which 8 ranks of a node take 5 each."""
CUT_WINDOW = 1 << 16
"""Bytes read at each nominal cut to find where the encoder may cut (word_cut looks this far first)."""


def is_ranged(source: str, choice: TokenizerChoice) -> bool:
    """Whether this text is prepared in ranges: a BPE's, and larger than RANGE_BYTES."""
    return not choice.is_char and (token_file.fingerprint(source).get("size") or 0) > RANGE_BYTES


def range_tokenizer(source: str, cache_dir: Optional[str], choice: TokenizerChoice,
                    make: bool) -> TokenizerChoice:
    """What makes every range's ids: the tokenizer.json given, or the BPE trained on the text (now,
    under a lock, when make and missing), as the text's one token file would train it."""
    if choice.file is not None:
        return choice
    made_from = {"settings": choice.settings(), "source": token_file.fingerprint(source)}
    digest = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:16]
    tokens = token_file.token_file_for(source, cache_dir, choice)
    path = tokens.with_name(tokens.name.replace(".bpe.tokens", f".bpe-{digest}.tokenizer.json"))
    if make:
        with files.locked(path):
            if not path.exists():
                sample = token_file.bpe_sample(source, made_from["source"]["size"], choice.sample_bytes)
                tokenizer_json = train_bpe(sample, choice.vocab_size).to_str()
                files.write_atomically(str(path), lambda out: out.write(tokenizer_json.encode()))
    elif not path.exists():
        raise DataError(f"data_config.path: {source}'s BPE {path} is missing; prepare the data again "
                        "(python mingpt/prepare_data.py <data_config.path> --tokenizer bpe)")
    return TokenizerChoice(str(path))


def cut_points(source: str, tokenizer: TokenizerChoice) -> list[int]:
    """The ranges' bounds: 0, then the encoder's first cut at or after each multiple of RANGE_BYTES
    (none found in the window there: that range grows), then the text's size."""
    size = token_file.fingerprint(source)["size"]
    cut = word_cut if uses_gpt2_words(json.loads(tokenizer.file.json)) else line_cut
    points = [0]
    with token_file.source_errors(source), files.open_file(source, "rb") as f:
        for nominal in range(RANGE_BYTES, size, RANGE_BYTES):
            f.seek(nominal - 1)  # a cut looks at the byte before it too
            at = cut(f.read(CUT_WINDOW), 1)
            if at is not None and points[-1] < nominal - 1 + at < size:
                points.append(nominal - 1 + at)
    return points + [size]


def members(source: str, tokenizer: TokenizerChoice) -> list[token_file.Member]:
    points = cut_points(source, tokenizer)
    return [(source, token_file.TextRange(start, end), f"part{index:04d}")
            for index, (start, end) in enumerate(zip(points, points[1:]))]


def paths_of(parts: list[token_file.Member], cache_dir: Optional[str], tokenizer: TokenizerChoice
             ) -> list[Path]:
    return [token_file.token_file_for(source, cache_dir, tokenizer, part) for source, _, part in parts]


def range_paths(source: str, cache_dir: Optional[str], choice: TokenizerChoice) -> list[Path]:
    """The ranges' token files (the text's BPE trained now, if need be)."""
    tokenizer = range_tokenizer(source, cache_dir, choice, make=True)
    return paths_of(members(source, tokenizer), cache_dir, tokenizer)


def prepare_ranges(source: str, cache_dir: Optional[str], choice: TokenizerChoice,
                   done: Optional[token_file.Report] = None) -> list[Path]:
    """Every range's token file, made by this process or another of the machine; their paths. done:
    told of each, as by token_file.prepare_in_turn."""
    tokenizer = range_tokenizer(source, cache_dir, choice, make=True)
    parts = members(source, tokenizer)
    token_file.prepare_in_turn(parts, cache_dir, tokenizer, done or (lambda *_: None))
    return paths_of(parts, cache_dir, tokenizer)


def open_ranges(source: str, cache_dir: Optional[str], choice: TokenizerChoice,
                key: str) -> tuple[ShardStream, TokenizerChoice]:
    """The prepared ranges as one stream, and the tokenizer (a tokenizer.json) they share."""
    tokenizer = range_tokenizer(source, cache_dir, choice, make=False)
    paths = paths_of(members(source, tokenizer), cache_dir, tokenizer)
    return open_token_files(paths, key, tokenizer.settings()), tokenizer
