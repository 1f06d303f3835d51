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
- private memory: the largest sum, over the run's processes (main.py and its DataLoader worker), of
  their private pages (Private_Clean + Private_Dirty of /proc/<pid>/smaps_rollup: psutil's USS) from
  the first step on, against the same run on the committed 1 MB corpus (data/input.txt, copied and
  tokenized with the same tokenizer, so that the model, and its 50,257-wide logits, are the same);
- the training step's consumption: tokens/s of that run's steps after its first (from the loss lines'
  arrival times), against the loader alone: tokens/s of batches of the same shape read through the
  Trainer's DataLoader (make_dataloader over the training split, 0 and 1 workers), from cold pages.
Targets (issue 40, for 10 GB): start-up under 10 s, private memory within 50 MB of the 1 MB corpus's,
the loader at least 10x the step's consumption. Figures printed and written as JSON (--json).
"""
import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import psutil
import torch
from bench_data import run_child
from common import REPO, RESULTS, emit, save_json
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

TARGETS = {"startup_s": 10.0,  # below
           "extra_private_mb": 50.0,  # at most, over the 1 MB corpus's run
           "loader_over_step": 10.0}  # at least

FIRST_STEP = re.compile(r"\[GPU0\] Epoch \d+ \| Iter 0 \| Train Loss")
STEP = re.compile(r"\[GPU0\] Epoch \d+ \| Iter (\d+) \| Train Loss")
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
    p.add_argument("--loader-batches", type=int, default=500, help="batches timed per loader measurement")
    p.add_argument("--poll-s", type=float, default=0.2, help="seconds between memory samples")
    p.add_argument("--memory-cap-gb", type=float, default=4.0, help="RLIMIT_DATA of every child (0: none)")
    p.add_argument("--timeout-s", type=float, default=600, help="per child process")
    p.add_argument("--json", type=Path, default=RESULTS / "shards.json", help="where to write the figures")
    p.add_argument("--measure-loader", nargs=3, metavar=("PATH", "VAL_PATH", "TOKENIZER"),
                   help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    for name in ("gb", "tokens_per_shard", "steps", "batch_size", "block_size", "loader_batches", "poll_s"):
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
        for first in range(0, n_tokens, CHUNK_TOKENS):
            f.write(rng.integers(0, GPT2_VOCAB, min(CHUNK_TOKENS, n_tokens - first), dtype="<u2").tobytes())
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
    """These files' pages out of the page cache (theirs only; the machine's other files stay)."""
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
    kib = {name: int(value) for name, value in re.findall(r"^(Private_\w+):\s+(\d+) kB", rollup, re.M)}
    return {"clean": kib.get("Private_Clean", 0) * 1024 / MB,
            "dirty": kib.get("Private_Dirty", 0) * 1024 / MB}


class PrivateMemory:
    """The largest private memory of a run's processes together (the capping parent excluded), from
    its first step on."""

    def __init__(self):
        self.peak = {"private": 0.0, "clean": 0.0, "dirty": 0.0, "processes": 0}

    def sample(self, root: int, training: bool) -> None:
        if not training:
            return
        try:
            processes = psutil.Process(root).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        found = [figures for figures in (private_mb(p.pid) for p in processes) if figures]
        if not found:
            return
        clean, dirty = sum(f["clean"] for f in found), sum(f["dirty"] for f in found)
        if clean + dirty > self.peak["private"]:
            self.peak = {"private": clean + dirty, "clean": clean, "dirty": dirty, "processes": len(found)}


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
            "private_mb": memory.peak, "peak_rss_mb": run.peak_rss_mb,
            "data_line": next((line for _, line in run.lines if line.startswith("Data")), None),
            "error": run.error()}


def loader_speed(path: str, val_path: str, tokenizer: str, workers: int, args) -> dict:
    """Tokens/s of the Trainer's training DataLoader alone, for one rank, from its first batch on."""
    config = DataConfig(path=path, val_path=val_path, tokenizer=tokenizer, block_size=args.block_size,
                        truncate=1.0)
    dataset = open_corpus(config)
    train_set, _ = split_dataset(dataset, config, SEED, open_corpus(config, validation=True))
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                  backend="gloo")
    loader = make_dataloader(train_set, args.batch_size, workers, env, shuffle=True, seed=SEED + workers)
    start = time.perf_counter()
    batches = iter(loader)
    for _ in range(args.loader_batches):
        windows = next(batches)
    seconds = time.perf_counter() - start
    return {"workers": workers, "batches": args.loader_batches, "batch_shape": list(windows.shape),
            "seconds": seconds,
            "tokens_per_s": args.loader_batches * args.batch_size * args.block_size / seconds}


def loader_child(args) -> None:
    torch.set_num_threads(1)
    path, val_path, tokenizer = args.measure_loader
    emit([loader_speed(path, val_path, tokenizer, workers, args) for workers in (0, 1)])


def measure_loader(path: str, val_path: str, tokenizer: Path, shards: list[Path], args) -> dict:
    """The loader in a capped child process, the shards' pages dropped from the cache first."""
    drop_from_cache(shards)
    command = [sys.executable, Path(__file__).resolve(), "--measure-loader", path, val_path, tokenizer,
               "--loader-batches", args.loader_batches, "--batch-size", args.batch_size,
               "--block-size", args.block_size]
    run = run_child(command, REPO, args)
    found = [line for _, line in run.lines if line.startswith("RESULT ")]
    return {"runs": json.loads(found[-1][len("RESULT "):]) if found else [], "error": run.error()}


# ---------------------------------------------------------------------------------------------- report

def verdicts(report: dict) -> dict[str, Optional[bool]]:
    """Each target met (True), missed (False), or not measured (None)."""
    startup, extra, ratio = report["startup_s"], report["extra_private_mb"], report["loader_over_step"]
    return {"startup_s": startup < TARGETS["startup_s"] if startup is not None else None,
            "extra_private_mb": extra <= TARGETS["extra_private_mb"] if extra is not None else None,
            "loader_over_step": ratio >= TARGETS["loader_over_step"] if ratio is not None else None}


def print_report(report: dict) -> None:
    shards, small, v = report["shards_run"], report["small_run"], report["verdicts"]
    mark = {True: "ok", False: "MISSED", None: "-"}
    corpus = report["corpus"]
    print(f"\n{corpus['shards']} llm.c shards, {corpus['tokens']:,} tokens ({corpus['bytes'] / GB:.1f} GB), "
          f"vocabulary of {GPT2_VOCAB:,}; a 2-layer, 64-wide model, batch {report['settings']['batch_size']} "
          f"x {report['settings']['block_size']}")
    fmt = lambda value, unit: "-" if value is None else f"{value:,.1f} {unit}"  # noqa: E731
    rows = [
        ("start-up to the first step, shards", fmt(report["startup_s"], "s") +
         f" (data mapped {fmt(shards['data_loaded_s'], 's')})", f"< {TARGETS['startup_s']:.0f} s",
         mark[v["startup_s"]]),
        ("start-up to the first step, 1 MB corpus", fmt(small["first_step_s"], "s"), "", ""),
        ("private memory, shards", fmt(shards["private_mb"]["private"], "MB") +
         f" (dirty {shards['private_mb']['dirty']:,.1f}, clean {shards['private_mb']['clean']:,.1f}, "
         f"{shards['private_mb']['processes']} processes)", "", ""),
        ("private memory, 1 MB corpus", fmt(small["private_mb"]["private"], "MB") +
         f" (dirty {small['private_mb']['dirty']:,.1f}, clean {small['private_mb']['clean']:,.1f})", "", ""),
        ("  shards over the 1 MB corpus", fmt(report["extra_private_mb"], "MB"),
         f"<= {TARGETS['extra_private_mb']:.0f} MB", mark[v["extra_private_mb"]]),
        ("training step's consumption", fmt(shards["step_tokens_per_s"], "tokens/s"), "", ""),
    ]
    for run in report["loader"]["runs"]:
        rows.append((f"loader alone, {run['workers']} worker(s), cold pages",
                     fmt(run["tokens_per_s"], "tokens/s"), "", ""))
    rows.append(("  loader over the step", fmt(report["loader_over_step"], "x"),
                 f">= {TARGETS['loader_over_step']:.0f}x", mark[v["loader_over_step"]]))
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

    print("start-up and memory on the shards ...", flush=True)
    drop_from_cache(shards)
    shards_run = measure_run(overrides(train_glob, val_shard, tokenizer, workdir / "run_shards", args),
                             workdir, args)
    print("the same on the 1 MB corpus ...", flush=True)
    prepare = [sys.executable, REPO / "mingpt" / "prepare_data.py", small, "--tokenizer", tokenizer]
    run_child(prepare, REPO, args)  # its token file made before the run, as the shards need none
    small_run = measure_run(overrides(str(small), None, tokenizer, workdir / "run_small", args), workdir,
                            args)
    print("the loader alone ...", flush=True)
    loader = measure_loader(train_glob, val_shard, tokenizer, shards, args)

    extra = (shards_run["private_mb"]["private"] - small_run["private_mb"]["private"]
             if shards_run["error"] is None and small_run["error"] is None else None)
    fastest_loader = max((run["tokens_per_s"] for run in loader["runs"]), default=None)
    step = shards_run["step_tokens_per_s"]
    report = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "corpus": {"shards": count, "tokens": count * args.tokens_per_shard,
                         "bytes": sum(path.stat().st_size for path in shards), "write_s": write_s},
              "shards_run": shards_run, "small_run": small_run, "loader": loader,
              "startup_s": shards_run["first_step_s"], "extra_private_mb": extra,
              "loader_over_step": fastest_loader / step if fastest_loader and step else None,
              "targets": TARGETS,
              "errors": {"shards_run": shards_run["error"], "small_run": small_run["error"],
                         "loader": loader["error"]}}
    report["verdicts"] = verdicts(report)
    return report


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.measure_loader:
        loader_child(args)
        return
    temporary = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="bench_shards_")) if temporary else args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        report = run_benchmark(args, workdir)
    finally:
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)
    print_report(report)
    save_json(args.json, report)


if __name__ == "__main__":
    main()
