"""What a large corpus costs the data path: preparation, start-up, memory per rank, loader speed.

    python bench/bench_data.py                                   # a 1 GB synthetic text (and a 1 MB one)
    python bench/bench_data.py --mb 100 --workdir /tmp/corpus    # texts kept there, reused next time

The benchmark writes its own texts (seeded word salad, mostly ASCII with a few multi-byte characters:
a vocabulary of about 80 characters, like a real corpus; no network) and measures each part in a
fresh process, as a user would run it:
- preparation: `python mingpt/prepare_data.py TEXT` from scratch, then again with the token file up
  to date: wall time, MB/s of text, and the process's peak resident memory (wait4's ru_maxrss);
  and from scratch in BPE tokens (`--tokenizer bpe`: the BPE trained on an 8 MB sample of the text,
  then the whole text encoded), with the same figures;
- start-up: `python mingpt/main.py` with a tiny model, from process start to its first training
  step's loss line, and on the way when it had loaded the data and built the Trainer;
- memory per rank under `torchrun --nproc_per_node=2`: each worker's unique set size (USS: its
  private pages, psutil's memory_full_info) and PSS, its DataLoader workers included, polled while
  the run lasts and the largest kept; for the big text and for a small one, whose difference is
  what the corpus costs a rank;
- the DataLoader alone: samples/s of batches of the default config's size (216 x 128), with 0 and
  1 workers, built as the Trainer builds it (make_dataloader over the random split, one rank).
The figures are printed beside the targets for a 1 GB corpus and written as JSON (--json).

Every child process runs with a cap on its private memory (--memory-cap-gb, RLIMIT_DATA): a data
path that grows with the corpus then fails that one measurement with an allocation error, which the
report shows, instead of taking the memory of a machine shared with others.
"""
import argparse
import contextlib
import json
import operator
import os
import random
import re
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import psutil
import torch
from common import REPO, RESULTS, emit, save_json, scratch_folder

from mingpt.char_dataset import DataConfig, inputs_and_targets, open_corpus, split_dataset
from mingpt.distributed.process_group import DistEnv
from mingpt.tokens.data_loader import make_dataloader
from mingpt.tokens.token_file import CHUNK_BYTES, open_token_file, token_file_for
from mingpt.tokens.token_file import prepare as prepare_text
from mingpt.tokens.tokenizer import TokenizerChoice

MAIN = REPO / "mingpt" / "main.py"
PREPARE = REPO / "mingpt" / "prepare_data.py"
MB = 1e6
SEED = 1337
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
NPROC = 2

TARGETS = {
    "prepare_mb_per_s": 50.0,  # at least
    "prepare_peak_mb": 1000.0,  # below
    "bpe_prepare_mb_per_s": 20.0,  # at least
    "bpe_prepare_peak_mb": 1000.0,  # below
    "startup_s": 10.0,  # below
    "extra_private_mb_per_rank": 300.0,  # at most, over the small-text run
}

FIRST_STEP = re.compile(r"\[RANK0\] Epoch 1 \| Iter 0 \| Train Loss")
# main.py's own lines on the way to the first step: the data is mapped, then the Trainer is built.
MILESTONES = {"data_loaded_s": re.compile(r"Data has \d+ characters"),
              "trainer_built_s": re.compile(r"^Model: GPT"),
              "first_step_s": FIRST_STEP}
PROJECT_FRAME = re.compile(r'File "[^"]*/mingpt/([\w.]+)", line (\d+), in (\w+)')  # traceback lines
ALLOCATION_FAILED = re.compile(
    r"tried to allocate \d+ bytes|MemoryError|Cannot allocate memory|std::bad_alloc")
EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception)\w*:.*)$", re.M)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mb", type=float, default=1024, help="size of the big synthetic text, MB (1e6 bytes)")
    p.add_argument("--small-mb", type=float, default=1.0,
                   help="size of the small text the memory figures are compared with (tiny-shakespeare's)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="folder for the texts, token files and runs; kept, and a text of the right size "
                        "already there is reused (default: a temporary folder, removed unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--steps", type=int, default=20, help="training steps of each main.py run")
    p.add_argument("--loader-batches", type=int, default=200, help="batches timed per loader measurement")
    p.add_argument("--loader-batch-size", type=int, default=216, help="the default config's batch")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--bpe-vocab-size", type=int, default=8192,
                   help="the BPE's vocabulary (prepare_data.py's)")
    p.add_argument("--poll-s", type=float, default=0.5, help="seconds between memory samples")
    p.add_argument("--memory-cap-gb", type=float, default=4.0,
                   help="RLIMIT_DATA of every child process (0: none)")
    p.add_argument("--timeout-s", type=float, default=1200, help="per child process")
    p.add_argument("--json", "--out", type=Path, default=RESULTS / "data.json",
                   help="where to write the figures")
    p.add_argument("--measure-loader", type=Path, help=argparse.SUPPRESS)  # child mode: a text's loader
    args = p.parse_args(argv)
    for name in ("mb", "small_mb", "steps", "loader_batches", "loader_batch_size", "block_size", "poll_s",
                 "timeout_s", "bpe_vocab_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.memory_cap_gb < 0:
        p.error("--memory-cap-gb must not be negative")
    return args


# ------------------------------------------------------------------------------------------ the texts

MULTIBYTE_WORDS = (
    "café", "naïve", "señor", "über", "déjà", "cœur", "façade", "—", "“so”", "Zoë")


def line_pool(rng: random.Random, lines: int = 20_000) -> list[bytes]:
    """Lines of word salad: a few thousand made-up words with English letter frequencies, capitals,
    punctuation, speaker lines as in a play, and now and then a word with multi-byte characters."""
    letters = string.ascii_lowercase
    weights = [8.2, 1.5, 2.8, 4.3, 12.7, 2.2, 2.0, 6.1, 7.0, 0.2, 0.8, 4.0, 2.4, 6.7, 7.5, 1.9, 0.1, 6.0,
               6.3, 9.1, 2.8, 1.0, 2.4, 0.2, 2.0, 0.1]
    words = ["".join(rng.choices(letters, weights, k=rng.randint(1, 9))) for _ in range(3000)]
    pool = []
    for _ in range(lines):
        if rng.random() < 0.1:
            pool.append(f"{rng.choice(words).upper()} {rng.choice(words).upper()}:\n".encode())
            continue
        line = []
        for _ in range(rng.randint(3, 14)):
            word = rng.choice(MULTIBYTE_WORDS) if rng.random() < 0.01 else rng.choice(words)
            if rng.random() < 0.08:
                word = word.capitalize()
            if rng.random() < 0.03:
                word += "'" + rng.choice("sdt")
            line.append(word + (rng.choice(",;:-") if rng.random() < 0.06 else ""))
        pool.append((" ".join(line).capitalize() + rng.choice(".!?,;") + "\n").encode())
    return pool


def write_text(path: Path, n_bytes: int, seed: int = SEED) -> None:
    """n_bytes of UTF-8 word salad, written a chunk of random lines at a time (about 100 MB/s);
    ends with a whole line. Atomic: a text of the right size at path is a whole one."""
    pool = line_pool(random.Random(seed))
    pick = np.random.default_rng(seed)
    lines_per_chunk = CHUNK_BYTES // (sum(map(len, pool)) // len(pool))
    part = path.with_name(path.name + ".part")
    written = 0
    with open(part, "wb") as out:
        while written < n_bytes:
            chunk = b"".join(operator.itemgetter(*pick.integers(len(pool), size=lines_per_chunk))(pool))
            chunk = chunk[: n_bytes - written]
            if written + len(chunk) == n_bytes and not chunk.endswith(b"\n"):
                # Cut at the last whole line (never inside a character) and fill up with one line.
                cut = chunk.rfind(b"\n") + 1
                chunk = chunk[:cut] + b"." * (len(chunk) - cut - 1) + b"\n"
            out.write(chunk)
            written += len(chunk)
    os.replace(part, path)


def text_of(folder: Path, mb: float) -> tuple[Path, dict]:
    """The synthetic text of this size in folder: written now, or reused when one is there."""
    path = folder / f"text_{mb:g}mb.txt"
    n_bytes = int(mb * MB)
    reused = path.is_file() and path.stat().st_size == n_bytes
    start = time.perf_counter()
    if not reused:
        write_text(path, n_bytes)
    return path, {"path": str(path), "bytes": n_bytes, "reused": reused,
                  "write_s": None if reused else time.perf_counter() - start}


# -------------------------------------------------------------------------------------- child processes

@dataclass
class Finished:
    """A child process that ran to its end (or was stopped at the timeout)."""

    returncode: int
    seconds: float
    peak_rss_mb: Optional[float]
    """Its own peak resident set, or its largest waited-for descendant's (wait4's ru_maxrss)."""
    lines: list[tuple[float, str]]
    """Its stdout lines, each with the seconds from its start to when it arrived."""
    stderr: str
    timed_out: bool = False
    cpu_s: Optional[float] = None
    """CPU seconds it and its waited-for descendants used (user and system): on a machine others
    load too, what the wall time would be on a free core."""

    def first(self, pattern: re.Pattern) -> Optional[float]:
        """Seconds from start to the first stdout line matching pattern."""
        return next((t for t, line in self.lines if pattern.search(line)), None)

    def error(self) -> Optional[str]:
        """None if it succeeded, else a line saying why not (an allocation failure named as such)."""
        if self.returncode == 0 and not self.timed_out:
            return None
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        found = ALLOCATION_FAILED.search(self.stderr)
        frames = PROJECT_FRAME.findall(self.stderr)
        where = f" in {frames[-1][0]}:{frames[-1][1]} ({frames[-1][2]})" if frames else ""
        if found:
            return f"exit {self.returncode}: allocation failed under the memory cap ({found.group(0)}){where}"
        raised = EXCEPTION_LINE.findall(self.stderr)
        written = [line for line in self.stderr.splitlines() if line.strip()]
        tail = raised[-1:] or written[-1:] or ["(no stderr)"]
        return f"exit {self.returncode}: {tail[0][-300:]}{where}"


def child_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


# The parent of every measured command: a small Python (no imports) that caps the command's private
# memory (RLIMIT_DATA, inherited), runs it and writes its peak resident set (wait4's ru_maxrss, KiB)
# to a file. Not the benchmark itself: a child's ru_maxrss counts the memory of the process it was
# forked from (the kernel records the old address space's peak at exec), and this process has torch.
# Its own start (some 20 ms) is inside the times measured.
CAP_AND_RUN = """
import os, resource, subprocess, sys
cap, report, command = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
if cap:
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    soft = cap if hard == resource.RLIM_INFINITY else min(cap, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
child = subprocess.Popen(command)
_, status, usage = os.wait4(child.pid, 0)
child.returncode = code = os.waitstatus_to_exitcode(status)
with open(report, "w") as f:
    f.write(f"{usage.ru_maxrss} {usage.ru_utime + usage.ru_stime}")
sys.exit(code if code >= 0 else 128 - code)
"""


def run_child(command: list, cwd: Path, args, poll: Optional[Callable[[int, bool], None]] = None) -> Finished:
    """Run command (capped) to its end, collecting its stdout lines as they come. poll(root,
    training) is called every --poll-s while it runs, root being the pid its processes descend from;
    training: its first step has been logged."""
    start = time.perf_counter()
    lines: list[tuple[float, str]] = []
    with tempfile.TemporaryFile("w+") as stderr, tempfile.NamedTemporaryFile("r") as peak:
        wrapped = [sys.executable, "-S", "-c", CAP_AND_RUN, str(int(args.memory_cap_gb * 2**30)), peak.name,
                   *map(str, command)]
        proc = subprocess.Popen(wrapped, cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=stderr,
                                text=True, start_new_session=True)

        def read() -> None:
            for line in proc.stdout:
                lines.append((time.perf_counter() - start, line.rstrip("\n")))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        timed_out, next_poll = False, start
        try:
            while proc.poll() is None:
                now = time.perf_counter()
                if now - start > args.timeout_s and not timed_out:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)  # its session: the workers go with it
                if poll is not None and now >= next_poll:
                    poll(proc.pid, any(FIRST_STEP.search(line) for _, line in lines))
                    next_poll = now + args.poll_s
                time.sleep(0.01)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        seconds = time.perf_counter() - start
        reader.join(timeout=10)
        stderr.seek(0)
        peak_kib, cpu_s = (peak.read().split() + [None, None])[:2]
        return Finished(proc.returncode, seconds, int(peak_kib) * 1024 / MB if peak_kib else None, lines,
                        stderr.read(), timed_out, float(cpu_s) if cpu_s else None)


# ------------------------------------------------------------------------------------------ preparation

def measure_prepare(text: Path, args) -> dict:
    """prepare_data.py from scratch (any token file removed first), then with the file up to date."""
    tokens = token_file_for(str(text))
    tokens.unlink(missing_ok=True)
    size_mb = text.stat().st_size / MB
    result = {}
    for name in ("from_scratch", "up_to_date"):
        run = run_child([sys.executable, PREPARE, text], REPO, args)
        said = " ".join(line for _, line in run.lines)
        tool_rate = re.search(r"([\d.]+) MB/s", said)
        result[name] = {"seconds": run.seconds, "mb_per_s": size_mb / run.seconds,
                        "peak_rss_mb": run.peak_rss_mb,
                        "tool_mb_per_s": float(tool_rate.group(1)) if tool_rate else None,
                        "output": said, "error": run.error()}
    if result["from_scratch"]["error"] is None:
        result["vocab_size"] = open_token_file(tokens).vocab_size
    return result


def measure_prepare_bpe(text: Path, args) -> dict:
    """prepare_data.py --tokenizer bpe from scratch (its token file removed first)."""
    choice = TokenizerChoice("bpe", args.bpe_vocab_size)
    token_file_for(str(text), choice=choice).unlink(missing_ok=True)
    command = [sys.executable, PREPARE, text, "--tokenizer", "bpe", "--bpe-vocab-size", args.bpe_vocab_size]
    load = os.getloadavg()[0]  # others' work on the machine slows the wall time, not the CPU time
    run = run_child(command, REPO, args)
    said = " ".join(line for _, line in run.lines)
    tool_rate = re.search(r"([\d.]+) MB/s", said)
    result = {"seconds": run.seconds, "mb_per_s": text.stat().st_size / MB / run.seconds,
              "cpu_s": run.cpu_s, "load_before": load, "peak_rss_mb": run.peak_rss_mb,
              "tool_mb_per_s": float(tool_rate.group(1)) if tool_rate else None,
              "output": said, "error": run.error()}
    if result["error"] is None:
        tokens = open_token_file(token_file_for(str(text), choice=choice))
        result.update(vocab_size=tokens.vocab_size, n_tokens=tokens.n_tokens,
                      bytes_per_token=text.stat().st_size / tokens.n_tokens)
    return result


# -------------------------------------------------------------------------------------------- main.py

def train_overrides(text: Path, run_dir: Path, args) -> list[str]:
    """A tiny model on the whole text: start-up and the data path dominate, not the steps."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a snapshot left there would be resumed from
    run_dir.mkdir(parents=True)
    return [f"data_config.path={text}", "data_config.truncate=1.0",
            f"data_config.block_size={args.block_size}",
            "gpt_config.n_layer=2", "gpt_config.n_head=2", "gpt_config.n_embd=64",
            "trainer_config.batch_size=8", f"trainer_config.max_steps={args.steps}",
            "trainer_config.log_every=1", "trainer_config.eval_every_steps=1000000000",
            "trainer_config.eval_batches=1", f"trainer_config.snapshot_path={run_dir}/snapshot.pt",
            "trainer_config.use_amp=False", "trainer_config.data_loader_workers=1"]


def measure_startup(text: Path, workdir: Path, args) -> dict:
    """One process: seconds from its start to the data mapped, the Trainer built, the first step."""
    run = run_child([sys.executable, MAIN, *train_overrides(text, workdir / "startup", args)], workdir, args)
    result = {name: run.first(pattern) for name, pattern in MILESTONES.items()}
    return {**result, "total_s": run.seconds, "peak_rss_mb": run.peak_rss_mb, "error": run.error()}


MEMORY_FIELDS = ("uss", "pss", "rss")
"""psutil's memory_full_info: USS (private to the process: Private_Clean + Private_Dirty), PSS (its
private pages plus its share of pages it shares) and RSS."""


def memory_of(process: psutil.Process) -> Optional[dict[str, float]]:
    """MB of each MEMORY_FIELDS figure of a process, None if it has gone."""
    try:
        info = process.memory_full_info()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return {key: getattr(info, key) / MB for key in MEMORY_FIELDS}


def rank_of(process: psutil.Process) -> Optional[int]:
    """RANK from a process's environment (torchrun sets it for each worker)."""
    try:
        value = process.environ().get("RANK")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return int(value) if value is not None else None


def ranks_below(root: int) -> dict[psutil.Process, int]:
    """The torchrun workers among root's descendants, with their ranks: the processes with RANK in
    their environment whose parent has none (their DataLoader workers inherit it)."""
    try:
        descendants = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    workers = {}
    for process in descendants:
        rank = rank_of(process)
        with contextlib.suppress(psutil.NoSuchProcess):
            parent = process.parent()
            if rank is not None and (parent is None or rank_of(parent) is None):
                workers[process] = rank
    return workers


def process_tree(process: psutil.Process) -> list[psutil.Process]:
    """process and all its descendants (none if it has gone)."""
    try:
        return [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@dataclass
class RankMemory:
    """The largest figures seen per rank (each field's maximum on its own): over the whole run, and
    from the first logged step on."""

    whole: dict[int, dict[str, float]] = field(default_factory=dict)
    training: dict[int, dict[str, float]] = field(default_factory=dict)
    samples: int = 0

    def sample(self, root: int, training: bool) -> None:
        for worker, rank in ranks_below(root).items():
            tree = [f for f in map(memory_of, process_tree(worker)) if f is not None]
            if not tree:
                continue
            total = {key: sum(f[key] for f in tree) for key in MEMORY_FIELDS}
            total["processes"] = len(tree)
            for peaks in (self.whole, self.training) if training else (self.whole,):
                old = peaks.setdefault(rank, {})
                for key, value in total.items():
                    old[key] = max(old.get(key, 0.0), value)
        self.samples += 1


def measure_memory(text: Path, run_dir: Path, args) -> dict:
    """main.py under torchrun with NPROC ranks; per rank the largest USS and PSS while it ran."""
    memory = RankMemory()
    command = [*TORCHRUN, f"--nproc_per_node={NPROC}", MAIN, *train_overrides(text, run_dir, args)]
    run = run_child(command, run_dir.parent, args, poll=memory.sample)
    return {"ranks": dict(sorted(memory.whole.items())),
            "ranks_training": dict(sorted(memory.training.items())),
            "samples": memory.samples,
            "seconds": run.seconds, "error": run.error()}


# --------------------------------------------------------------------------------------- the loader

def endless(loader):
    epoch = 1
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def loader_speed(text: Path, workers: int, args) -> dict:
    """Samples/s of the Trainer's training DataLoader for one rank, after its first batch."""
    config = DataConfig(path=str(text), block_size=args.block_size, truncate=1.0)
    train_set, _ = split_dataset(open_corpus(config), config, SEED)
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                  backend="gloo")
    start = time.perf_counter()
    loader = make_dataloader(train_set, args.loader_batch_size, workers, env, shuffle=True, seed=SEED)
    batches = endless(loader)
    next(batches)
    first_batch_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.loader_batches):
        inputs, _ = inputs_and_targets(next(batches))
    seconds = time.perf_counter() - start
    return {"workers": loader.num_workers, "first_batch_s": first_batch_s,
            "samples_per_s": args.loader_batches * args.loader_batch_size / seconds,
            "batch_shape": list(inputs.shape)}


def measure_loader(text: Path, args) -> dict:
    """The loader measurements in a capped child process (it maps the whole text, as a rank does)."""
    command = [sys.executable, Path(__file__).resolve(), "--measure-loader", text,
               "--loader-batches", args.loader_batches, "--loader-batch-size", args.loader_batch_size,
               "--block-size", args.block_size]
    run = run_child(command, REPO, args)
    found = [line for _, line in run.lines if line.startswith("RESULT ")]
    results = json.loads(found[-1][len("RESULT "):]) if found else []
    return {"runs": results, "peak_rss_mb": run.peak_rss_mb, "error": run.error()}


def loader_child(args) -> None:
    torch.set_num_threads(1)
    emit([loader_speed(args.measure_loader, workers, args) for workers in (0, 1)])


# ---------------------------------------------------------------------------------------------- report

def extra_per_rank(big: dict, small: dict, key: str) -> dict[int, Optional[float]]:
    return {rank: (big["ranks"][rank][key] - small["ranks"][rank][key]
                   if rank in big["ranks"] and rank in small["ranks"] else None) for rank in range(NPROC)}


def verdicts(report: dict) -> dict[str, Optional[bool]]:
    """Each target met (True), missed (False), or not measured (None)."""
    cold, bpe = report["prepare"]["from_scratch"], report["prepare_bpe"]
    extra = [v for v in report["memory"]["extra_uss_mb"].values()]
    startup = report["startup"]["first_step_s"]
    ok = cold["error"] is None
    return {
        "prepare_mb_per_s": cold["mb_per_s"] >= TARGETS["prepare_mb_per_s"] if ok else None,
        "prepare_peak_mb": cold["peak_rss_mb"] < TARGETS["prepare_peak_mb"] if cold["peak_rss_mb"] else None,
        "bpe_prepare_mb_per_s": (bpe["mb_per_s"] >= TARGETS["bpe_prepare_mb_per_s"]
                                 if bpe["error"] is None else None),
        "bpe_prepare_peak_mb": (bpe["peak_rss_mb"] < TARGETS["bpe_prepare_peak_mb"]
                                if bpe["peak_rss_mb"] else None),
        "startup_s": startup < TARGETS["startup_s"] if startup is not None else False,
        "extra_private_mb_per_rank": (all(v <= TARGETS["extra_private_mb_per_rank"] for v in extra)
                                      if all(v is not None for v in extra) else False),
    }


def mark(verdict: Optional[bool]) -> str:
    return {True: "ok", False: "MISSED", None: "-"}[verdict]


def fmt_s(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f} s"


def fmt_mb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.0f} MB"


def memory_cell(memory: dict, key: str) -> str:
    if not memory["ranks"]:
        return "-"
    cell = ", ".join(f"rank {rank}: {figures[key]:,.0f}" for rank, figures in sorted(memory["ranks"].items()))
    return cell + (" (until it failed)" if memory["error"] else "")


def differences_cell(by_rank: dict) -> str:
    return ", ".join(f"rank {r}: {'-' if d is None else f'{d:+,.0f}'}" for r, d in by_rank.items())


def table(report: dict, args) -> list[tuple[str, str, str, str]]:
    prep, startup, memory, loader = report["prepare"], report["startup"], report["memory"], report["loader"]
    bpe = report["prepare_bpe"]
    cold, warm = prep["from_scratch"], prep["up_to_date"]
    v = report["verdicts"]
    tool = f", {cold['tool_mb_per_s']:.0f} MB/s in prepare()" if cold["tool_mb_per_s"] else ""
    big_mb, small_mb = report["corpus"]["bytes"] / MB, report["small_corpus"]["bytes"] / MB
    rows = [
        ("prepare, from scratch", f"{cold['seconds']:.1f} s, {cold['mb_per_s']:.0f} MB/s{tool}",
         f">= {TARGETS['prepare_mb_per_s']:.0f} MB/s", mark(v["prepare_mb_per_s"])),
        ("  its peak memory", fmt_mb(cold["peak_rss_mb"]), f"< {TARGETS['prepare_peak_mb']:,.0f} MB",
         mark(v["prepare_peak_mb"])),
        ("prepare, up to date", f"{warm['seconds']:.1f} s, peak {fmt_mb(warm['peak_rss_mb'])}", "", ""),
        (f"prepare in BPE tokens ({args.bpe_vocab_size:,}), from scratch",
         f"{bpe['seconds']:.1f} s, {bpe['mb_per_s']:.0f} MB/s" + (
             f", {bpe['bytes_per_token']:.2f} bytes per token" if bpe.get("bytes_per_token") else "") + (
             f"; {bpe['cpu_s']:.0f} CPU-s, load {bpe['load_before']:.1f} before" if bpe.get("cpu_s") else ""),
         f">= {TARGETS['bpe_prepare_mb_per_s']:.0f} MB/s", mark(v["bpe_prepare_mb_per_s"])),
        ("  its peak memory", fmt_mb(bpe["peak_rss_mb"]), f"< {TARGETS['bpe_prepare_peak_mb']:,.0f} MB",
         mark(v["bpe_prepare_peak_mb"])),
        ("start-up to the first step (1 process)",
         f"{fmt_s(startup['first_step_s'])} (data mapped {fmt_s(startup['data_loaded_s'])}, "
         f"Trainer built {fmt_s(startup['trainer_built_s'])})",
         f"< {TARGETS['startup_s']:.0f} s", mark(v["startup_s"])),
        (f"USS per rank, {big_mb:g} MB text (MB)", memory_cell(memory["big"], "uss"), "", ""),
        (f"USS per rank, {small_mb:g} MB text (MB)", memory_cell(memory["small"], "uss"), "", ""),
        ("  USS difference per rank (MB)",
         differences_cell(memory["extra_uss_mb"]),
         f"<= {TARGETS['extra_private_mb_per_rank']:.0f} MB", mark(v["extra_private_mb_per_rank"])),
        (f"PSS per rank, {big_mb:g} MB text (MB)", memory_cell(memory["big"], "pss"), "", ""),
        ("  PSS difference per rank (MB)",
         differences_cell(memory["extra_pss_mb"]),
         "", ""),
    ]
    for run in loader["runs"]:
        batch = f"{args.loader_batch_size} x {args.block_size}"
        speed = f"{run['samples_per_s']:,.0f} samples/s (first batch {run['first_batch_s']:.2f} s)"
        rows.append((f"loader alone, {run['workers']} worker(s), {batch}", speed, "", ""))
    if loader["error"]:
        rows.append(("loader alone", "-", "", ""))
    return rows


def print_report(report: dict, args) -> None:
    corpus = report["corpus"]
    print(f"\ndata path: {corpus['bytes'] / MB:g} MB synthetic text, vocabulary of "
          f"{report['prepare'].get('vocab_size', '?')}; {report['machine_cores']} cores "
          f"(targets are for a 1 GB text)")
    rows = table(report, args)
    headers = ("measure", "value", "target", "")
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(4)]
    for row in [headers, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    errors = {name: error for name, error in report["errors"].items() if error}
    for name, error in errors.items():
        print(f"FAILED {name}: {error}")


def run_benchmark(args, workdir: Path) -> dict:
    text, corpus = text_of(workdir, args.mb)
    small, small_corpus = text_of(workdir, args.small_mb)
    for meta in (corpus, small_corpus):
        written = "reused" if meta["reused"] else f"written in {meta['write_s']:.1f} s"
        print(f"text {meta['path']}: {meta['bytes'] / MB:g} MB, {written}", flush=True)
    print("preparing ...", flush=True)
    prepare = measure_prepare(text, args)
    print("preparing in BPE tokens ...", flush=True)
    prepare_bpe = measure_prepare_bpe(text, args)
    prepare_text(str(small))  # the small text's token file, for its runs
    print("start-up ...", flush=True)
    startup = measure_startup(text, workdir, args)
    print(f"memory under torchrun, {NPROC} ranks ...", flush=True)
    big = measure_memory(text, workdir / "ranks_big", args)
    small_run = measure_memory(small, workdir / "ranks_small", args)
    print("loader ...", flush=True)
    loader = measure_loader(text, args)
    memory = {"big": big, "small": small_run,
              "extra_uss_mb": extra_per_rank(big, small_run, "uss"),
              "extra_pss_mb": extra_per_rank(big, small_run, "pss")}
    report = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "corpus": corpus, "small_corpus": small_corpus, "prepare": prepare, "prepare_bpe": prepare_bpe,
              "startup": startup,
              "memory": memory, "loader": loader, "targets": TARGETS, "machine_cores": os.cpu_count(),
              "errors": {"prepare": prepare["from_scratch"]["error"] or prepare["up_to_date"]["error"],
                         "prepare_bpe": prepare_bpe["error"],
                         "startup": startup["error"], "memory_big": big["error"],
                         "memory_small": small_run["error"], "loader": loader["error"]}}
    report["verdicts"] = verdicts(report)
    return report


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.measure_loader:
        loader_child(args)
        return
    with scratch_folder("bench_data_", given=args.workdir, keep=args.keep) as workdir:
        report = run_benchmark(args, workdir)
    print_report(report, args)
    save_json(args.json, report)


if __name__ == "__main__":
    main()
