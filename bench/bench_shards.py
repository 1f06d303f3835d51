"""What pre-tokenized shards cost a run: start-up, private memory, and the loader against a step.

    python bench/bench_shards.py                  # 2 GB of synthetic llm.c shards (less if the disk is short)
    python bench/bench_shards.py --gb 10          # issue 40's 10 GB: 5B tokens in 50 shards

The benchmark writes its own shards in llm.c's exact layout (a 1,024-byte header: magic 20240520,
version 1, the token count; then uint16 ids), 100M tokens each as FineWeb's are, the first one named
as FineWeb's validation shard, in a temporary folder it deletes. The ids are seeded random ids of a
byte-level BPE of GPT-2's size (50,257 tokens) that the benchmark makes too (GPT-2's own tokenizer.json
would need the network). What it measures, each in a process of its own as a user runs it, with the
shards' pages dropped from the page cache first (posix_fadvise on these files only: as on a machine
that has not read them yet):
- start-up: `python mingpt/main.py` with a tiny model on the shards (data_config.path a glob,
  data_config.val_path the validation shard), seconds from process start to its first training
  step's loss line;
- private memory: the sum, over the run's processes (main.py and its DataLoader worker), of their
  private pages (Private_Clean + Private_Dirty of /proc/<pid>/smaps_rollup: psutil's USS), sampled
  from the first step on (median and peak), against the same run on the committed 1 MB corpus
  (data/input.txt, copied and tokenized with the same tokenizer, so that the model, and its
  50,257-wide logits, are the same);
- the training step's consumption: tokens/s of that run's steps after its first (from the loss lines'
  arrival times), against the loader alone: tokens/s of batches read through the Trainer's DataLoader
  (make_dataloader over the training split, 0 and 1 workers), of the run's shape and of GPT-2's on an
  H100 (32 x 1024, whose step consumes H100_GPT2_TOKENS_PER_S), first from cold pages, then the same
  batches again from the page cache; each in the training order's default (data_config.shards_at_once=2:
  two shards at a time, the next read ahead) and in one permutation of the whole set (0).
Each main.py run is made --repeats times, alternating shards and corpus; the verdicts take the medians.
Targets (issue 40, for 10 GB): start-up under 10 s, private memory within 50 MB of the 1 MB corpus's,
the loader at least 10x the step's consumption. Figures printed and written as JSON (--json).
"""
import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import psutil
import torch
from bench_data import run_child
from common import REPO, RESULTS, emit, save_json, scratch_folder
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from mingpt.char_dataset import DataConfig, open_corpus, split_dataset
from mingpt.distributed.process_group import DistEnv
from mingpt.tokens.data_loader import make_dataloader
from mingpt.tokens.shards import GPT2_MAGIC, HEADER_INTS
from mingpt.tokens.tokenizer import BYTE_ALPHABET, END_OF_TEXT

MAIN = REPO / "mingpt" / "main.py"
SMALL_CORPUS = REPO / "data" / "input.txt"
GB = 1e9
MB = 1e6
GPT2_VOCAB = 50_257
SEED = 1337
CHUNK_TOKENS = 10_000_000
"""Ids generated and written at a time (20 MB): the writer's memory stays small whatever the size."""
DISK_LEFT_GB = 5.0
"""Free space the benchmark leaves on the disk it writes to."""

H100_GPT2_TOKENS_PER_S = 563_735
"""gpt2 (124M), bf16, compiled, batch 32 x 1024 on one H100: bench/results/gpu/h100_gpt2_bf16_compile.log."""
GPT2_SHAPE = (32, 1024)
TARGETS = {"startup_s": 10.0,  # below
           "extra_private_mb": 50.0,  # at most, over the 1 MB corpus's run
           "loader_over_step": 10.0}  # at least

FIRST_STEP = re.compile(r"\[RANK0\] Epoch \d+ \| Iter 0 \| Train Loss")
STEP = re.compile(r"\[RANK0\] Epoch \d+ \| Iter (\d+) \| Train Loss")
MILESTONES = {"data_loaded_s": re.compile(r"^Data: \d+ llm\.c shards?|^Data has \d+ tokens"),
              "trainer_built_s": re.compile(r"^Model: GPT"),
              "first_step_s": FIRST_STEP}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0,
                   help="GB (1e9 bytes) of shards to write; fewer if the disk has not the room")
    p.add_argument("--tokens-per-shard", type=int, default=100_000_000, help="FineWeb's")
    p.add_argument("--workdir", type=Path, default=None,
                   help="folder for the shards and runs; kept, and shards of the right size there reused "
                        "(default: a temporary folder, removed)")
    p.add_argument("--steps", type=int, default=20, help="training steps of each main.py run")
    p.add_argument("--batch-size", type=int, default=8, help="the runs' (and the loader's) batch")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="main.py runs of each kind (medians compared)")
    p.add_argument("--loader-batches", type=int, default=500,
                   help="batches timed per loader measurement of the run's shape (a fifth as many of "
                        "GPT-2's)")
    p.add_argument("--poll-s", type=float, default=0.2, help="seconds between memory samples")
    p.add_argument("--memory-cap-gb", type=float, default=4.0, help="RLIMIT_DATA of every child (0: none)")
    p.add_argument("--timeout-s", type=float, default=600, help="per child process")
    p.add_argument("--json", type=Path, default=RESULTS / "shards.json", help="where to write the figures")
    p.add_argument("--measure-loader", nargs=3, metavar=("PATH", "VAL_PATH", "TOKENIZER"),
                   help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    for name in ("gb", "tokens_per_shard", "steps", "batch_size", "block_size", "loader_batches", "poll_s",
                 "repeats"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


# ------------------------------------------------------------------------------------------- the data

def gpt2_sized_tokenizer(path: Path) -> Path:
    """A byte-level BPE of GPT-2's size and kind: the 256 byte tokens, 50,000 merges of byte pairs, and
    <|endoftext|> last (id 50,256), with GPT-2's pre-tokenizer. Its merges are not GPT-2's; its size,
    and with it the model's, are."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(alphabet)}
    merges = []
    for i in range(GPT2_VOCAB - BYTE_ALPHABET - 1):
        pair = (alphabet[i // BYTE_ALPHABET], alphabet[i % BYTE_ALPHABET])
        merges.append(pair)
        vocab[pair[0] + pair[1]] = BYTE_ALPHABET + i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True)])
    assert tokenizer.get_vocab_size(with_added_tokens=True) == GPT2_VOCAB
    tokenizer.save(str(path))
    return path


def room_for(folder: Path, gb: float, tokens_per_shard: int) -> int:
    """Shards of the size asked that fit on folder's disk (leaving DISK_LEFT_GB free), at least one."""
    shard_bytes = HEADER_INTS * 4 + 2 * tokens_per_shard
    wanted = max(round(gb * GB / shard_bytes), 1)
    free = shutil.disk_usage(folder).free - DISK_LEFT_GB * GB
    fits = int(free // shard_bytes)
    if fits < 2:
        sys.exit(f"{folder}: {free / GB + DISK_LEFT_GB:.1f} GB free, not enough for two shards")
    if fits < wanted:
        print(f"{folder}: room for {fits} shards of {shard_bytes / GB:.1f} GB, not {wanted}: writing {fits}")
    return min(wanted, fits)


def write_shard(path: Path, n_tokens: int, seed: int) -> None:
    """An llm.c shard: 256 little-endian int32 (magic, version 1, count, zeros), then uint16 ids,
    generated a chunk at a time; fsync'ed, so that its pages can be dropped from the cache."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = GPT2_MAGIC, 1, n_tokens
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.writelines(rng.integers(0, GPT2_VOCAB, min(CHUNK_TOKENS, n_tokens - first), dtype="<u2").tobytes()
                     for first in range(0, n_tokens, CHUNK_TOKENS))
        f.flush()
        os.fsync(f.fileno())


def write_shards(folder: Path, count: int, tokens_per_shard: int) -> tuple[list[Path], float]:
    """FineWeb's names: shard 0 is the validation shard, the others train. Shards of the right size
    already there are kept. Returns the paths and the seconds writing took."""
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    paths = []
    for index in range(count):
        path = folder / f"fineweb_{'val' if index == 0 else 'train'}_{index:06d}.bin"
        if not path.exists() or path.stat().st_size != HEADER_INTS * 4 + 2 * tokens_per_shard:
            write_shard(path, tokens_per_shard, SEED + index)
            print(f"  wrote {path.name}", flush=True)
        paths.append(path)
    return paths, time.perf_counter() - start


def drop_from_cache(paths: list[Path]) -> None:
    """These files' pages out of the page cache (theirs only; the machine's other files stay). Written
    back first: the kernel drops only clean pages, and freshly written shards are dirty ones."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------------- the runs

def overrides(path: str, val_path: Optional[str], tokenizer: Path, run_dir: Path, args) -> list[str]:
    """A tiny model (its vocabulary GPT-2's): start-up and the data path dominate, not the steps."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a snapshot left there would be resumed from
    run_dir.mkdir(parents=True)
    settings = [f"data_config.path={path}", f"data_config.tokenizer={tokenizer}", "data_config.truncate=1.0",
                f"data_config.block_size={args.block_size}",
                "gpt_config.n_layer=2", "gpt_config.n_head=2", "gpt_config.n_embd=64",
                f"trainer_config.batch_size={args.batch_size}", f"trainer_config.max_steps={args.steps}",
                "trainer_config.log_every=1", "trainer_config.eval_every_steps=1000000000",
                "trainer_config.eval_batches=1", f"trainer_config.snapshot_path={run_dir}/snapshot.pt",
                "trainer_config.use_amp=False", "trainer_config.data_loader_workers=1"]
    return settings + ([f"data_config.val_path={val_path}"] if val_path else [])


def private_mb(pid: int) -> Optional[dict[str, float]]:
    """Private_Clean and Private_Dirty of a process (/proc/<pid>/smaps_rollup), MB; None if gone."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    found = re.findall(r"^(Private_\w+):\s+(\d+) kB", rollup, re.MULTILINE)
    kib = {name: int(value) for name, value in found}
    return {"clean": kib.get("Private_Clean", 0) * 1024 / MB,
            "dirty": kib.get("Private_Dirty", 0) * 1024 / MB}


class PrivateMemory:
    """The private memory of a run's processes together (the capping parent excluded), sampled from
    its first step on: the samples' median (its steady state; what the data path adds shows there)
    and their peak (which the step's transient buffers, 50,257-wide logits and their gradient, move
    by tens of MB from one sample to the next)."""

    def __init__(self):
        self.samples: list[dict[str, float]] = []

    def sample(self, root: int, training: bool) -> None:
        if not training:
            return
        try:
            processes = psutil.Process(root).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        found = [figures for figures in (private_mb(p.pid) for p in processes) if figures]
        if found:
            clean, dirty = sum(f["clean"] for f in found), sum(f["dirty"] for f in found)
            self.samples.append({"private": clean + dirty, "clean": clean, "dirty": dirty,
                                 "processes": len(found)})

    def figures(self) -> dict:
        if not self.samples:
            return {"median": None, "peak": None, "samples": 0}
        ordered = sorted(self.samples, key=lambda sample: sample["private"])
        return {"median": ordered[len(ordered) // 2], "peak": ordered[-1], "samples": len(ordered)}


def measure_run(command_args: list[str], workdir: Path, args) -> dict:
    """main.py in one process: its milestones, its steps' tokens/s, its private memory."""
    memory = PrivateMemory()
    run = run_child([sys.executable, MAIN, *command_args], workdir, args, poll=memory.sample)
    steps = [(t, int(m.group(1))) for t, line in run.lines if (m := STEP.search(line))]
    later = steps[1:]  # the first step warms up (allocations, the first batch)
    step_s = (later[-1][0] - later[0][0]) / (later[-1][1] - later[0][1]) if len(later) > 1 else None
    return {**{name: run.first(pattern) for name, pattern in MILESTONES.items()},
            "total_s": run.seconds, "steps_seen": len(steps), "step_s": step_s,
            "step_tokens_per_s": args.batch_size * args.block_size / step_s if step_s else None,
            "private_mb": memory.figures(), "peak_rss_mb": run.peak_rss_mb,
            "data_line": next((line for _, line in run.lines if line.startswith("Data")), None),
            "error": run.error()}


def loader_speed(path: str, val_path: str, tokenizer: str, shape: tuple[int, int], workers: int,
                 batches: int, cold: bool, shards_at_once: int = 2) -> dict:
    """Tokens/s of the Trainer's training DataLoader alone, for one rank, after its first batch; cold:
    the shards' pages dropped from the page cache first (else they hold the same batches' pages).
    shards_at_once: the training order's (0: windows of the whole set in one permutation)."""
    batch_size, block_size = shape
    config = DataConfig(path=path, val_path=val_path, tokenizer=tokenizer, block_size=block_size,
                        truncate=1.0, shards_at_once=shards_at_once)
    dataset = open_corpus(config)
    train_set, _ = split_dataset(dataset, config, SEED, open_corpus(config, validation=True))
    if cold:
        drop_from_cache([shard.path for shard in dataset.shards.shards])
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                  backend="gloo")
    loader = make_dataloader(train_set, batch_size, workers, env, shuffle=True, seed=SEED,
                             blocks=train_set.blocks())  # as rank_loader reads a training split
    start = time.perf_counter()
    read = iter(loader)
    next(read)  # the worker's start, timed apart
    first_batch_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(batches):
        windows = next(read)
    seconds = time.perf_counter() - start
    return {"workers": workers, "pages": "cold" if cold else "cached", "shards_at_once": shards_at_once,
            "batches": batches,
            "batch_shape": list(windows.shape), "first_batch_s": first_batch_s, "seconds": seconds,
            "tokens_per_s": batches * batch_size * block_size / seconds}


def loader_child(args) -> None:
    """Each shape, each worker count: cold pages, then the same batches from the page cache."""
    torch.set_num_threads(1)
    path, val_path, tokenizer = args.measure_loader
    shapes = [((args.batch_size, args.block_size), args.loader_batches),
              (GPT2_SHAPE, max(args.loader_batches // 5, 1))]
    emit([loader_speed(path, val_path, tokenizer, shape, workers, batches, cold, at_once)
          for shape, batches in shapes for workers in (0, 1) for cold in (True, False) for at_once in (2, 0)])


def measure_loader(path: str, val_path: str, tokenizer: Path, args) -> dict:
    """The loader measurements in a capped child process (it maps the shards, as a rank does)."""
    command = [sys.executable, Path(__file__).resolve(), "--measure-loader", path, val_path, tokenizer,
               "--loader-batches", args.loader_batches, "--batch-size", args.batch_size,
               "--block-size", args.block_size]
    run = run_child(command, REPO, args)
    found = [line for _, line in run.lines if line.startswith("RESULT ")]
    return {"runs": json.loads(found[-1][len("RESULT "):]) if found else [], "error": run.error()}


# ---------------------------------------------------------------------------------------------- report

def median(values: list) -> Optional[float]:
    values = sorted(v for v in values if v is not None)
    return float(np.median(values)) if values else None


def loader_best(loader: dict, shape: list[int], pages: str) -> Optional[float]:
    """The faster worker count's tokens/s for a batch shape and page state, in the training order's
    default (two shards at a time)."""
    found = [run["tokens_per_s"] for run in loader["runs"] if run["batch_shape"][0] == shape[0]
             and run["batch_shape"][1] == shape[1] + 1 and run["pages"] == pages
             and run.get("shards_at_once", 2) == 2]
    return max(found, default=None)


def private_of(runs: list[dict], key: str) -> Optional[float]:
    """The median over runs of their private memory's median or peak (key), MB."""
    return median([(run["private_mb"][key] or {}).get("private") for run in runs])


def summarise(report: dict, args) -> None:
    """The medians over the repeats, the comparisons, the verdicts."""
    shards, small = report["shards_runs"], report["small_runs"]
    ok = not any(run["error"] for run in shards + small)
    step = median([run["step_tokens_per_s"] for run in shards])
    cold = loader_best(report["loader"], [args.batch_size, args.block_size], "cold")
    gpt2 = {pages: loader_best(report["loader"], list(GPT2_SHAPE), pages) for pages in ("cold", "cached")}
    report.update(
        startup_s=median([run["first_step_s"] for run in shards]),
        small_startup_s=median([run["first_step_s"] for run in small]),
        private_mb=private_of(shards, "median"), small_private_mb=private_of(small, "median"),
        extra_private_mb=private_of(shards, "median") - private_of(small, "median") if ok else None,
        peak_private_mb=private_of(shards, "peak"), small_peak_private_mb=private_of(small, "peak"),
        step_tokens_per_s=step,
        loader_over_step=cold / step if cold and step else None,
        gpt2_loader_over_h100_step={pages: tokens / H100_GPT2_TOKENS_PER_S if tokens else None
                                    for pages, tokens in gpt2.items()})
    startup, extra, ratio = report["startup_s"], report["extra_private_mb"], report["loader_over_step"]
    report["verdicts"] = {
        "startup_s": startup < TARGETS["startup_s"] if startup is not None else None,
        "extra_private_mb": extra <= TARGETS["extra_private_mb"] if extra is not None else None,
        "loader_over_step": ratio >= TARGETS["loader_over_step"] if ratio is not None else None}


MARKS = {True: "ok", False: "MISSED", None: "-"}


def fmt(value: Optional[float], unit: str) -> str:
    return "-" if value is None else f"{value:,.1f} {unit}".strip()


def each(runs: list[dict], key: str) -> str:
    """One figure of every run: "10.1, 10.0, 9.8"."""
    return ", ".join(fmt(run[key], "") for run in runs)


def private_kinds(runs: list[dict]) -> str:
    """Each run's median private memory as its dirty and clean pages."""
    return "dirty, clean: " + "; ".join(
        f"{run['private_mb']['median']['dirty']:,.1f}, {run['private_mb']['median']['clean']:,.1f}"
        for run in runs if run["private_mb"]["median"])


def table(report: dict) -> list[tuple[str, str, str, str]]:
    v, shards, small = report["verdicts"], report["shards_runs"], report["small_runs"]
    rows = [
        ("start-up to the first step, shards",
         (f"{fmt(report['startup_s'], 's')} (runs: {each(shards, 'first_step_s')}; "
          f"data mapped: {each(shards, 'data_loaded_s')})"),
         f"< {TARGETS['startup_s']:.0f} s", MARKS[v["startup_s"]]),
        ("start-up to the first step, 1 MB corpus",
         (f"{fmt(report['small_startup_s'], 's')} (runs: {each(small, 'first_step_s')}; "
          f"data mapped: {each(small, 'data_loaded_s')})"), "", ""),
        ("private memory while training, shards",
         f"{fmt(report['private_mb'], 'MB')} ({private_kinds(shards)})", "", ""),
        ("private memory while training, 1 MB corpus",
         f"{fmt(report['small_private_mb'], 'MB')} ({private_kinds(small)})", "", ""),
        ("  shards over the 1 MB corpus", fmt(report["extra_private_mb"], "MB"),
         f"<= {TARGETS['extra_private_mb']:.0f} MB", MARKS[v["extra_private_mb"]]),
        ("  peaks: shards, 1 MB corpus",
         f"{fmt(report['peak_private_mb'], 'MB')}, {fmt(report['small_peak_private_mb'], 'MB')}", "", ""),
        ("training step's consumption (this CPU)", fmt(report["step_tokens_per_s"], "tokens/s"), "", ""),
    ]
    for run in report["loader"]["runs"]:
        shape = f"{run['batch_shape'][0]} x {run['batch_shape'][1] - 1}"
        at_once = run.get("shards_at_once", 2)
        order = f"{at_once} shards at once" if at_once else "whole set"
        rows.append((f"loader, {shape}, {run['workers']} worker(s), {run['pages']}, {order}",
                     fmt(run["tokens_per_s"], "tokens/s"), "", ""))
    rows.append(("  loader (cold) over this CPU's step", fmt(report["loader_over_step"], "x"),
                 f">= {TARGETS['loader_over_step']:.0f}x", MARKS[v["loader_over_step"]]))
    h100 = report["gpt2_loader_over_h100_step"]
    rows.append(("  loader 32 x 1024 over an H100's gpt2 step",
                 (f"cold {fmt(h100['cold'], 'x')}, cached {fmt(h100['cached'], 'x')} "
                  f"(of {H100_GPT2_TOKENS_PER_S:,} tokens/s)"), "", ""))
    return rows


def print_report(report: dict) -> None:
    corpus, settings = report["corpus"], report["settings"]
    print(f"\n{corpus['shards']} llm.c shards, {corpus['tokens']:,} tokens ({corpus['bytes'] / GB:.1f} GB), "
          f"vocabulary of {GPT2_VOCAB:,}; a 2-layer, 64-wide model, batch {settings['batch_size']} x "
          f"{settings['block_size']}; medians of {settings['repeats']} run(s) of each kind")
    rows = table(report)
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for name, error in report["errors"].items():
        if error:
            print(f"FAILED {name}: {error}")


def run_benchmark(args, workdir: Path) -> dict:
    count = room_for(workdir, args.gb, args.tokens_per_shard)
    print(f"writing {count} llm.c shards of {args.tokens_per_shard:,} tokens in {workdir} ...", flush=True)
    shards, write_s = write_shards(workdir / "fineweb10B", count, args.tokens_per_shard)
    tokenizer = gpt2_sized_tokenizer(workdir / "tokenizer.json")
    train_glob, val_shard = str(workdir / "fineweb10B" / "fineweb_train_*.bin"), str(shards[0])
    small = workdir / "input.txt"
    shutil.copy(SMALL_CORPUS, small)
    prepare = [sys.executable, REPO / "mingpt" / "prepare_data.py", small, "--tokenizer", tokenizer]
    run_child(prepare, REPO, args)  # the corpus's token file made before its runs: shards need none

    shards_runs, small_runs = [], []
    for repeat in range(args.repeats):
        print(f"start-up and memory, shards then the 1 MB corpus ({repeat + 1} of {args.repeats}) ...",
              flush=True)
        drop_from_cache(shards)
        on_shards = overrides(train_glob, val_shard, tokenizer, workdir / "run_shards", args)
        shards_runs.append(measure_run(on_shards, workdir, args))
        small_runs.append(measure_run(overrides(str(small), None, tokenizer, workdir / "run_small", args),
                                      workdir, args))
    print("the loader alone ...", flush=True)
    loader = measure_loader(train_glob, val_shard, tokenizer, args)
    report = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "corpus": {"shards": count, "tokens": count * args.tokens_per_shard,
                         "bytes": sum(path.stat().st_size for path in shards), "write_s": write_s},
              "shards_runs": shards_runs, "small_runs": small_runs, "loader": loader, "targets": TARGETS,
              "h100_gpt2_tokens_per_s": H100_GPT2_TOKENS_PER_S,
              "errors": {"shards_runs": next((r["error"] for r in shards_runs if r["error"]), None),
                         "small_runs": next((r["error"] for r in small_runs if r["error"]), None),
                         "loader": loader["error"]}}
    summarise(report, args)
    return report


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.measure_loader:
        loader_child(args)
        return
    with scratch_folder("bench_shards_", given=args.workdir) as workdir:
        report = run_benchmark(args, workdir)
    print_report(report)
    save_json(args.json, report)


if __name__ == "__main__":
    main()
