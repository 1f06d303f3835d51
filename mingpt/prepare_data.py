"""Prepare the training text once as a token file that every rank memory-maps (see tokens/token_file.py).

    python mingpt/prepare_data.py PATH [--cache-dir DIR]     PATH: a local path or any fsspec URL
    python mingpt/prepare_data.py PATH --tokenizer bpe [--bpe-vocab-size N]   or a tokenizer.json

Training makes the token file itself when it is missing, older than the text or of other tokenizer
settings; this command makes it ahead of time (a 1 GB text takes seconds to a minute), for example
once on a shared disk before a Slurm job. Give it the data_config settings training will have.
Pre-tokenized shards (llm.c's, nanoGPT's: a .bin file, a folder or a glob) need nothing: it checks
their headers and says so (and their ids, when a small set is given its --tokenizer tokenizer.json).
"""
import time
from pathlib import Path
from typing import Optional

from mingpt.common.errors import OneLineArgumentParser, command
from mingpt.common.files import CACHE_DIR_ENV
from mingpt.tokens.shards import AUTO, FORMATS, names_shards, open_shards
from mingpt.tokens.token_file import fingerprint, open_token_file, prepare
from mingpt.tokens.tokenizer import CHAR, DEFAULT_SAMPLE_MB, DEFAULT_VOCAB_SIZE, TokenizerChoice, Vocabulary


def summary(path: Path) -> str:
    tokens = open_token_file(path)
    return f"{path}: {tokens.n_tokens:,} tokens, vocabulary of {tokens.vocab_size}"


def check_shards(path: str, format: str, choice: TokenizerChoice) -> str:
    """Shards are read as they lie: their headers (and a small set's ids) checked, nothing made."""
    vocab_size = len(Vocabulary.from_json(choice.file.json)) if choice.file else None
    stream = open_shards(path, format, vocab_size, "data_config.path")
    checked = "headers and ids checked" if stream.scanned else "headers checked"
    return (f"nothing to prepare: {path} is {stream.describe()}, {len(stream):,} tokens, read as they lie "
            f"({checked})")


@command
def main(argv: Optional[list[str]] = None) -> None:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a local path or an fsspec URL of a UTF-8 text file, or shards")
    parser.add_argument("--cache-dir", default=None,
                        help=f"folder for token files of remote sources (default: ${CACHE_DIR_ENV} "
                             "or ~/.cache/mingpt-ddp)")
    parser.add_argument("--tokenizer", default=CHAR,
                        help="char, bpe (trained on the text), or a byte-level BPE's tokenizer.json "
                             "(data_config.tokenizer; default char)")
    parser.add_argument("--bpe-vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help=f"data_config.bpe_vocab_size (default {DEFAULT_VOCAB_SIZE})")
    parser.add_argument("--bpe-sample-mb", type=float, default=DEFAULT_SAMPLE_MB,
                        help=f"data_config.bpe_sample_mb (default {DEFAULT_SAMPLE_MB:g})")
    parser.add_argument("--format", default=AUTO, choices=FORMATS,
                        help=f"data_config.format (default {AUTO})")
    args = parser.parse_args(argv)
    choice = TokenizerChoice.of(args.tokenizer, args.bpe_vocab_size, args.bpe_sample_mb)
    if names_shards(args.path, args.format):
        print(check_shards(args.path, args.format, choice))
        return
    start = time.perf_counter()
    path, built = prepare(args.path, args.cache_dir, choice)
    seconds = time.perf_counter() - start
    if built:
        size = fingerprint(args.path).get("size") or 0
        print(f"prepared {summary(path)}, {size / 1e6 / max(seconds, 1e-9):.1f} MB/s")
    else:
        print(f"up to date: {summary(path)}")


if __name__ == "__main__":
    main()
