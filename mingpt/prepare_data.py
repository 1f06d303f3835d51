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
(tokens/text_ranges.py). Which of these PATH is, training and this command decide alike
(tokens/sources.py).
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
from mingpt.tokens.shards import AUTO, FORMATS
from mingpt.tokens.sources import (
    PATH_KEY,
    OneText,
    SetOfTexts,
    Shards,
    SourceSettings,
    TextInRanges,
    source_of,
)
from mingpt.tokens.text_ranges import range_paths
from mingpt.tokens.text_set import DEFAULT_TEXT_FIELD
from mingpt.tokens.token_file import Report, fingerprint, open_token_file, read_header
from mingpt.tokens.tokenizer import CHAR, DEFAULT_SAMPLE_MB, DEFAULT_VOCAB_SIZE, TokenizerChoice, Vocabulary


def summary(path: Path) -> str:
    tokens = open_token_file(path)
    return f"{path}: {tokens.n_tokens:,} tokens, vocabulary of {tokens.vocab_size}"


def prepare_text(text: OneText, processes: int) -> str:
    """A text's token file, made (or found up to date) by this process."""
    start = time.perf_counter()
    made = []
    text.prepare(True, lambda source, path, now: made.append((path, now)))
    [(path, built)] = made
    seconds = time.perf_counter() - start
    if not built:
        return f"up to date: {summary(path)}"
    size = fingerprint(text.path).get("size") or 0
    return f"prepared {summary(path)}, {size / 1e6 / max(seconds, 1e-9):.1f} MB/s"


def prepare_text_in_ranges(text: TextInRanges, processes: int) -> str:
    """A large text's ranges, made by this process and processes - 1 others (in_processes)."""
    start = time.perf_counter()
    paths = range_paths(text.path, text.cache_dir, text.tokenizer)  # the text's BPE trained first, here
    made = in_processes(functools.partial(text.prepare, True), processes, paths, "ranges")
    mb_per_s = fingerprint(text.path)["size"] / 1e6 / (time.perf_counter() - start)
    return (f"{text.path} in ranges: {made:,} prepared now, {mb_per_s:.1f} MB/s with {processes} "
            f"process{'es' if processes > 1 else ''}")


def check_shards(shards: Shards, processes: int) -> str:
    """Shards are read as they lie: their headers (and a small set's ids) checked, nothing made."""
    choice = shards.settings.tokenizer
    stream = shards.stream(len(Vocabulary.made_by(choice)) if choice.file else None)
    checked = "headers and ids checked" if stream.scanned else "headers checked"
    return (f"nothing to prepare: {shards.path} is {stream.describe()}, {len(stream):,} tokens, read as they "
            f"lie ({checked})")


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


def prepare_text_set(texts: SetOfTexts, processes: int) -> str:
    """The set prepared by this process and processes - 1 others, together (in_processes)."""
    start = time.perf_counter()
    text_set = texts.texts
    paths = text_set.token_files(text_set.tokenizer(make=True))  # its BPE trained (characters counted) here
    made = in_processes(functools.partial(texts.prepare, True), processes, paths, "files")
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


PREPARING = {OneText: prepare_text, TextInRanges: prepare_text_in_ranges, SetOfTexts: prepare_text_set,
             Shards: check_shards}
"""What the command does, and says, for each kind of data (tokens/sources.py)."""


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
    settings = SourceSettings(choice, args.format, args.text_field, args.cache_dir)
    source = source_of(args.path, PATH_KEY, settings)
    print(PREPARING[type(source)](source, args.processes))

if __name__ == "__main__":
    main()
