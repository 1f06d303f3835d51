"""Prepare the training text once as a token file that every rank memory-maps (see tokens/token_file.py).

    python mingpt/prepare_data.py PATH [--cache-dir DIR]     PATH: a local path or any fsspec URL
    python mingpt/prepare_data.py PATH --tokenizer bpe [--bpe-vocab-size N]   or a tokenizer.json
    python mingpt/prepare_data.py FOLDER_OR_GLOB --tokenizer bpe [--processes N] [--text-field text]

Training makes the token file itself when it is missing, older than the text or of other tokenizer
settings; this command makes it ahead of time (a 1 GB text takes seconds to a minute), for example
once on a shared disk before a Slurm job. Give it the data_config settings training will have.
Pre-tokenized shards (llm.c's, nanoGPT's: a .bin file, a folder or a glob) need nothing: it checks
their headers and says so (and their ids, when a small set is given its --tokenizer tokenizer.json).
A set of texts (a folder or glob of .txt, .jsonl and .parquet files: tokens/text_set.py) is prepared
file by file by --processes processes of this machine, each file once (a progress bar on a terminal,
else a line for each file made); a training job's processes share the work the same way, so this only
does it ahead of the job. So is a text larger than 256 MB under a BPE, range by range
(tokens/text_ranges.py).
"""
import contextlib
import functools
import multiprocessing
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Optional

from mingpt.common.errors import OneLineArgumentParser, command
from mingpt.common.files import CACHE_DIR_ENV
from mingpt.tokens.shards import AUTO, FORMATS, names_shards, open_shards
from mingpt.tokens.text_ranges import is_ranged, prepare_ranges, range_paths
from mingpt.tokens.text_set import DEFAULT_TEXT_FIELD, Report, TextSet, prepare_set, set_files
from mingpt.tokens.token_file import fingerprint, open_token_file, prepare, read_header
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


def say_line(line: str) -> None:
    """A line in one write to the output, which the preparers of a set share: print's two writes (the
    line, then its end) let another process's line in between."""
    try:
        out = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # an output with no file (a test's capture)
        print(line, flush=True)
        return
    sys.stdout.flush()
    os.write(out, f"{line}\n".encode())


_done = None
"""Which of a preparation's token files are done, by any of the command's processes: a flag each (a
multiprocessing Array, inherited by the forked ones), at its position in _position: a progress bar's
count."""
_position: dict[str, int] = {}


def prepare_share(prepare_telling: Callable[[Report], object], quiet: bool) -> int:
    """This process's share of a preparation (a set's files, a large text's ranges: prepare_telling
    tells of each token file it is done with), flagged in _done; a line for each one it makes, unless
    quiet (a progress bar shows them); how many it made."""
    made = []

    def said(source: str, path: Path, now: bool) -> None:
        _done[_position[str(path)]] = 1
        if now:
            made.append(path)
            if not quiet:
                say_line(f"prepared {path}: {read_header(path)['n_tokens']:,} tokens")

    prepare_telling(said)
    return len(made)


def in_processes(prepare_telling: Callable[[Report], object], processes: int, paths: list[Path],
                 unit: str) -> int:
    """prepare_share in this process and processes - 1 others, together, for these token files; how
    many they made. The others are forked: no thread has started yet (the encoders' threads start
    with the first file, the progress bar's once they are forked), and a spawned process would spend
    a second of a core importing what this one has (a tenth of a 200 MB set's work). On a terminal, a
    progress bar of the token files done (stderr) stands for the lines of the files made."""
    global _done, _position
    context = multiprocessing.get_context("fork")
    _done = context.Array("b", len(paths), lock=False)  # each flag set by one process or several alike
    _position = {str(path): index for index, path in enumerate(paths)}
    bar = sys.stderr.isatty()
    share = functools.partial(prepare_share, prepare_telling, bar)
    shown = functools.partial(progress_bar, len(paths), unit) if bar else contextlib.nullcontext
    if processes == 1:
        with shown():
            return share()
    with ProcessPoolExecutor(processes - 1, mp_context=context) as pool:
        others = [pool.submit(share) for _ in range(processes - 1)]
        with shown():
            return share() + sum(other.result() for other in others)


@contextlib.contextmanager
def progress_bar(total: int, unit: str) -> Iterator[None]:
    """`412/1,000 files [############..................] 41%`, redrawn on stderr four times a second
    from _done while the block runs, and once more at its end."""
    finished = threading.Event()

    def draw() -> None:
        done = sum(_done)
        filled = done * BAR_WIDTH // max(total, 1)
        sys.stderr.write(f"\r{done:,}/{total:,} {unit} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                         f"{100 * done // max(total, 1)}%")
        sys.stderr.flush()

    def redraw() -> None:
        while not finished.wait(0.25):
            draw()

    drawer = threading.Thread(target=redraw, daemon=True)
    drawer.start()
    try:
        yield
    finally:
        finished.set()
        drawer.join()
        draw()
        sys.stderr.write("\n")


BAR_WIDTH = 30


def prepare_text_set(text_set: TextSet, processes: int) -> str:
    """The set prepared by this process and processes - 1 others, together (in_processes)."""
    start = time.perf_counter()
    paths = text_set.token_files(text_set.tokenizer(make=True))  # a set's BPE trained first, here
    made = in_processes(functools.partial(prepare_set, text_set), processes, paths, "files")
    seconds = time.perf_counter() - start
    tokenizer = text_set.tokenizer(make=False)
    paths = text_set.token_files(tokenizer)
    # from the set's index, just written: a BPE's header holds the whole tokenizer.json
    layouts = text_set.index(tokenizer).layouts() or [read_header(path) for path in paths]
    size = sum(fingerprint(source)["size"] for source in text_set.files)
    count = len(text_set.files)
    workers = f"{processes} process{'es' if processes > 1 else ''}"
    return (f"{count:,} file{'s' if count != 1 else ''}: {made:,} prepared now, {count - made:,} up to date; "
            f"{sum(layout['n_tokens'] for layout in layouts):,} tokens, vocabulary of "
            f"{read_header(paths[0])['vocab_size']:,}, "
            f"{size / 1e6 / max(seconds, 1e-9):.1f} MB/s with {workers}")


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
    parser.add_argument("--text-field", default=DEFAULT_TEXT_FIELD,
                        help="a set's JSON lines field and Parquet column of the text "
                             f"(data_config.text_field; default {DEFAULT_TEXT_FIELD})")
    parser.add_argument("--processes", type=int, default=1,
                        help="a set of texts, or a text over 256 MB under a BPE: processes of this machine "
                             "that prepare its files (its ranges) together "
                             "(default 1)")
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error(f"--processes must be 1 or more, got {args.processes}")
    choice = TokenizerChoice.of(args.tokenizer, args.bpe_vocab_size, args.bpe_sample_mb)
    found = set_files(args.path, args.format, "data_config.path")
    if found is not None:
        text_set = TextSet("data_config.path", tuple(found), choice, args.text_field, args.cache_dir)
        if choice.is_char:
            text_set.tokenizer(make=False)  # characters for several texts: refused before anything is made
        print(prepare_text_set(text_set, args.processes))
        return
    if names_shards(args.path, args.format):
        print(check_shards(args.path, args.format, choice))
        return
    if is_ranged(args.path, choice):
        start = time.perf_counter()
        ranges = functools.partial(prepare_ranges, args.path, args.cache_dir, choice)
        made = in_processes(ranges, args.processes, range_paths(args.path, args.cache_dir, choice), "ranges")
        mb_per_s = fingerprint(args.path)["size"] / 1e6 / (time.perf_counter() - start)
        print(f"{args.path} in ranges: {made:,} prepared now, {mb_per_s:.1f} MB/s with {args.processes} "
              f"process{'es' if args.processes > 1 else ''}")
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
