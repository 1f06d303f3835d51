"""What preparing a folder of many texts costs, with 1 and with 2 processes (tokens/text_set.py).

    python bench/bench_text_set.py                              # 100 files, 200 MB in all
    python bench/bench_text_set.py --files 1000 --mb 2000       # the issue's 1,000 files, 2 GB
    python bench/bench_text_set.py --one-text --mb 600 --repeats 1   # one text, prepared in ranges

The benchmark writes its own folder of texts (bench_data.py's seeded word salad, no network), trains a BPE of
--vocab tokens on a sample of it once (a tokenizer.json, outside the timings), then for each process
count runs `python mingpt/prepare_data.py FOLDER --tokenizer tokenizer.json --processes N` from
scratch (every token file removed first), --repeats times, and reports:
- the wall time and MB/s of text (the median of the repeats), and the speed-up of 2 processes over 1
  (target: at least 1.8x);
- each process's peak resident memory (psutil, polled every 50 ms over the command's process tree:
  the command and the processes it starts; target: under 1 GB each);
- the CPU seconds of the command and the processes it started (getrusage of the waited children), and
  so the cores it kept busy, with the load average before each run (other work on the machine);
- that each file was prepared exactly once (the command's lines), and a second run prepared none;
- what a rank's start-up then spends on the prepared set (prepare_corpus, every file current, then
  open_corpus), without the set's index (each token file's header read and its ids checksummed) and
  with it (text_set.SetIndex), the page cache warm in both.
With --one-text, the same for a single text of --mb MB, which is prepared in ranges of 256 MB
(tokens/text_ranges.py) shared by the processes. Results are written to bench/results/text_set.json
(--json; text_ranges.json with --one-text). The machine is named in the results: on
a 2-core machine shared with other work the speed-up is bounded by what the other work leaves.
"""
import argparse
import json
import operator
import os
import platform
import random
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
from bench_data import SEED, line_pool

from mingpt.tokens.tokenizer import END_OF_TEXT, train_bpe

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def write_folder(folder: Path, files: int, total_mb: float) -> int:
    """files texts of about total_mb MB in all, the word salad of bench_data.py (a few thousand made-up
    words, capitals, punctuation, a few multi-byte characters) in a different order in each; kept if
    already there. The bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    per_file = int(total_mb * 1e6 / files)
    pool = line_pool(random.Random(SEED))
    line_bytes = sum(map(len, pool)) / len(pool)
    size = 0
    for i in range(files):
        path = folder / f"part_{i:05d}.txt"
        if not path.exists() or abs(path.stat().st_size - per_file) > per_file // 10:
            pick = np.random.default_rng(i)
            lines = operator.itemgetter(*pick.integers(len(pool), size=int(per_file / line_bytes) + 1))(pool)
            path.write_bytes(b"".join(lines))
        size += path.stat().st_size
    return size


def write_one_text(folder: Path, total_mb: float) -> int:
    """One text of about total_mb MB, of the same word salad; kept if already there. Its bytes."""
    path = folder / "corpus.txt"
    if not path.exists() or abs(path.stat().st_size - total_mb * 1e6) > total_mb * 1e5:
        parts = folder / "parts"
        write_folder(parts, max(int(total_mb // 20), 1), total_mb)
        with open(path, "wb") as out:
            for part in sorted(parts.glob("*.txt")):
                out.write(part.read_bytes())
    return path.stat().st_size


def clean(folder: Path) -> None:
    for made in [*folder.glob("*.tokens*"), *folder.glob("set-*.index.json")]:
        made.unlink()


def start_up(folder: Path, tokenizer: Path) -> dict:
    """Seconds of a start-up on the prepared set, without its index (which it then writes) and with it."""
    from mingpt.char_dataset import DataConfig, open_corpus, prepare_corpus

    config = DataConfig(path=str(folder), tokenizer=str(tokenizer))

    def timed() -> float:
        start = time.perf_counter()
        prepare_corpus(config)
        open_corpus(config)
        return time.perf_counter() - start

    for index in (folder if folder.is_dir() else folder.parent).glob("set-*.index.json"):
        index.unlink()
    without = timed()
    with_index = statistics.median(timed() for _ in range(3))
    print(f"start-up on the prepared set: {without:.2f} s without its index, {with_index:.2f} s with it")
    return {"without_index_s": round(without, 2), "with_index_s": round(with_index, 2)}


def run_measured(command: list[str]) -> dict:
    """The command's wall time, output, and the peak RSS of each process of its tree."""
    peaks: dict[int, int] = {}
    load = os.getloadavg()[0]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = threading.Event()

    def poll() -> None:
        root = psutil.Process(process.pid)
        while not done.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for member in tree:
                try:
                    peaks[member.pid] = max(peaks.get(member.pid, 0), member.memory_info().rss)
                except psutil.NoSuchProcess:
                    pass
            done.wait(0.05)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    out, err = process.communicate()
    seconds = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the forked preparers too: waited for
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    done.set()
    watcher.join()
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed: {err.strip()}")
    # the largest first: the preparers (a small helper process of multiprocessing may be there too)
    preparers = sorted(peaks.values(), reverse=True)
    return {"seconds": seconds, "out": out, "peak_rss_mb": [round(p / 1e6, 1) for p in preparers],
            "cpu_s": cpu, "load_before": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=100)
    parser.add_argument("--mb", type=float, default=200.0)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/mingpt-bench-text-set")
    parser.add_argument("--one-text", action="store_true", help="one text of --mb MB, in ranges")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    if args.one_text:
        folder = workdir / f"text_{args.mb:g}mb"
        folder.mkdir(parents=True, exist_ok=True)
        size = write_one_text(folder, args.mb)
        corpus, made_pattern = folder / "corpus.txt", r"^prepared .*/(corpus\.txt\.part\d+)\.bpe\.tokens"
        args.files = None
    else:
        folder = workdir / f"set_{args.files}x{args.mb:g}mb"
        size = write_folder(folder, args.files, args.mb)
        corpus, made_pattern = folder, r"^prepared .*/(part_\d+\.txt)\.bpe\.tokens"
    tokenizer = workdir / f"tokenizer_{args.vocab}.json"
    if not tokenizer.exists():
        sample = next(folder.rglob("part_00000.txt")).read_text()[:8_000_000]
        train_bpe(iter([sample]), args.vocab, special_tokens=[END_OF_TEXT]).save(str(tokenizer))
    command = [sys.executable, str(REPO / "mingpt" / "prepare_data.py"), str(corpus),
               "--tokenizer", str(tokenizer)]
    cpu = platform.processor() or platform.machine()
    report = {"machine": f"{platform.node()}: {os.cpu_count()} CPUs, {cpu}", "files": args.files,
              "mb": round(size / 1e6, 1), "tokenizer": f"a byte-level BPE of {args.vocab}", "runs": {}}
    for processes in (1, 2):
        runs = []
        for _ in range(args.repeats):
            clean(folder)
            run = run_measured([*command, "--processes", str(processes)])
            made = re.findall(made_pattern, run["out"], re.M)
            expected = sorted(f.name.removesuffix(".bpe.tokens")
                              for f in folder.glob("*.bpe.tokens")) if args.one_text else \
                sorted(f.name for f in folder.glob("*.txt"))
            assert sorted(made) == expected, f"{processes} process(es): a file made twice or not at all"
            runs.append(run)
            print(f"{processes} process(es): {run['seconds']:.1f} s, {size / 1e6 / run['seconds']:.1f} MB/s, "
                  f"{run['cpu_s']:.1f} CPU s ({run['cpu_s'] / run['seconds']:.2f} cores busy; load before "
                  f"{run['load_before']:.2f}), peak RSS per process {run['peak_rss_mb']} MB", flush=True)
        again = run_measured([*command, "--processes", str(processes)])
        assert (" in ranges: 0 prepared now" if args.one_text else f"{args.files:,} files: 0 prepared now") \
            in again["out"], again["out"]
        seconds = statistics.median(run["seconds"] for run in runs)
        report["runs"][processes] = {
            "seconds": [round(run["seconds"], 2) for run in runs], "median_s": round(seconds, 2),
            "cpu_s": [round(run["cpu_s"], 2) for run in runs],
            "cores_busy": [round(run["cpu_s"] / run["seconds"], 2) for run in runs],
            "load_average_before": [round(run["load_before"], 2) for run in runs],
            "mb_per_s": round(size / 1e6 / seconds, 1),
            "peak_rss_mb_per_process": max((run["peak_rss_mb"] for run in runs), key=max),
            "second_run_s": round(again["seconds"], 2),
        }
    report["start_up"] = start_up(corpus, tokenizer)
    speedup = report["runs"][1]["median_s"] / report["runs"][2]["median_s"]
    peak = max(max(run["peak_rss_mb_per_process"]) for run in report["runs"].values())
    report["speedup_2_over_1"] = round(speedup, 2)
    report["targets"] = {"speedup_at_least_1.8": speedup >= 1.8, "peak_rss_under_1gb": peak < 1000}
    print(f"speed-up of 2 processes over 1: {speedup:.2f}x (target 1.8x); largest peak RSS {peak:.0f} MB "
          "(target under 1,000 MB)")
    report_path = Path(args.json or RESULTS / ("text_ranges.json" if args.one_text else "text_set.json"))
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
