"""Prepare the training text once as a token file that every rank memory-maps (see tokens/token_file.py).

    python mingpt/prepare_data.py PATH [--cache-dir DIR]     PATH: a local path or any fsspec URL

Training makes the token file itself when it is missing or older than the text; this command makes
it ahead of time (a 1 GB text takes minutes), for example once on a shared disk before a Slurm job.
"""
import time
from pathlib import Path
from typing import Optional

from mingpt.reporting.errors import OneLineArgumentParser, command
from mingpt.storage.files import CACHE_DIR_ENV
from mingpt.tokens.token_file import fingerprint, open_token_file, prepare


def summary(path: Path) -> str:
    tokens = open_token_file(path)
    return f"{path}: {tokens.n_tokens:,} tokens, vocabulary of {tokens.vocab_size}"


@command
def main(argv: Optional[list[str]] = None) -> None:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a local path or an fsspec URL of a UTF-8 text file")
    parser.add_argument("--cache-dir", default=None,
                        help=f"folder for token files of remote sources (default: ${CACHE_DIR_ENV} "
                             "or ~/.cache/mingpt-ddp)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path, built = prepare(args.path, args.cache_dir)
    seconds = time.perf_counter() - start
    if built:
        size = fingerprint(args.path).get("size") or 0
        print(f"prepared {summary(path)}, {size / 1e6 / max(seconds, 1e-9):.1f} MB/s")
    else:
        print(f"up to date: {summary(path)}")


if __name__ == "__main__":
    main()
