"""Shards behind an S3 server read through the bounded cache: start-up, waits for data, disk used.

    python bench/bench_remote_shards.py [--shards 8] [--tokens-per-shard 10000000] [--cache-shards 3]

Writes llm.c shards (bench_shards.py's synthetic ones, GPT-2-sized ids) and puts them in a bucket of
a real S3 server on loopback (moto's server mode, as the tests use: the store is this machine's, so
fetches are as fast as moto serves, about what a fast link to S3 gives a node), then:
- start-up: `main.py` on `s3://.../fineweb_train_*.bin` (a tiny model, bench_shards.py's), seconds
  to its first step, against the issue's 15 s; the cache empty at the start;
- steady state: one rank's training loader over the S3 set, through the cache (empty at the start),
  consumed at the pace of GPT-2's step on an H100 (32 x 1024 tokens every 58 ms: 563,735 tokens/s),
  for a whole epoch: the share of batches the loader made the step wait for (over 10 ms), the total
  wait, and the most disk the copies took at any time, against data_config.shard_cache_gb; the same
  for the same shards on this machine's disk, the baseline.
Figures printed and written as JSON (--json).
"""
import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import fsspec
import torch
from bench_shards import (
    GPT2_SHAPE,
    H100_GPT2_TOKENS_PER_S,
    gpt2_sized_tokenizer,
    measure_run,
    overrides,
    write_shards,
)
from common import RESULTS, save_json
from s3_server import start_s3_server

from mingpt.char_dataset import DataConfig, open_corpus, split_dataset
from mingpt.distributed.process_group import DistEnv
from mingpt.tokens.data_loader import rank_loader
from mingpt.tokens.shard_cache import FOLDER

WAITED_S = 0.010
"""A batch the step waited for longer than this counts as one the loader held up (taking a batch
from a DataLoader worker costs a few milliseconds whatever the data: the same shards read from
disk are measured alike, as the baseline)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shards", type=int, default=8, help="training shards (one more for validation)")
    p.add_argument("--tokens-per-shard", type=int, default=10_000_000,
                   help="FineWeb's are 100M; smaller ones make a group change every few seconds at "
                        "the H100's pace, which is what is measured")
    p.add_argument("--cache-shards", type=int, default=3, help="data_config.shard_cache_gb, in shards")
    p.add_argument("--steps", type=int, default=5, help="steps of the start-up run")
    p.add_argument("--batch-size", type=int, default=8, help="the start-up run's batch")
    p.add_argument("--block-size", type=int, default=128, help="the start-up run's block")
    p.add_argument("--memory-cap-gb", type=float, default=4.0)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--poll-s", type=float, default=0.2)
    p.add_argument("--json", type=Path, default=RESULTS / "remote_shards.json")
    return p.parse_args(argv)


def disk_used(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.glob("*") if path.is_file())


class DiskWatch:
    """The most the cache's copies (and partial fetches) took, sampled every 50 ms."""

    def __init__(self, folder: Path):
        self.folder, self.most, self._stop = folder, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            if self.folder.exists():
                self.most = max(self.most, disk_used(self.folder))

    def __enter__(self) -> "DiskWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()


def steady_state(config: DataConfig, cache: Path) -> dict:
    """An epoch of the training loader at an H100 gpt2 step's pace: the batches that made it wait."""
    batch, block = GPT2_SHAPE
    config = replace(config, block_size=block)
    train, test = split_dataset(open_corpus(config), config, seed=0, validation=open_corpus(config, True))
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                  backend="gloo")
    loader = rank_loader(train, batch, 1, 0, 1, 0, env, ())
    loader.sampler.set_epoch(1)
    step_s = batch * block / H100_GPT2_TOKENS_PER_S
    waits = []
    with DiskWatch(cache) as disk:
        read = iter(loader)
        for _ in range(len(loader)):
            asked = time.perf_counter()
            next(read)
            waits.append(time.perf_counter() - asked)
            time.sleep(step_s)  # the step, on the GPU
    steady = waits[1:]  # the first batch waits for the first shard's fetch and the worker's start
    return {"batches": len(waits), "step_s": step_s, "first_batch_s": waits[0],
            "waited_share": sum(w > WAITED_S for w in steady) / len(steady),
            "waited_s": sum(steady), "longest_wait_s": max(steady),
            "median_wait_s": statistics.median(steady),
            "most_disk_bytes": disk.most}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_remote_shards_") as scratch:
        work = Path(scratch)
        server, process = start_s3_server(work / "moto.log")
        try:
            os.environ.update(server.env())
            shards, _ = write_shards(work / "fineweb", args.shards + 1, args.tokens_per_shard)
            start = time.perf_counter()
            remote = f"s3://{server.bucket}/fineweb"
            fsspec.filesystem("s3", skip_instance_cache=True).put([str(p) for p in shards],
                                                                   f"{remote}/")
            upload_s = time.perf_counter() - start
            tokenizer = gpt2_sized_tokenizer(work / "tokenizer.json")
            shard_bytes = shards[0].stat().st_size
            cache_gb = args.cache_shards * shard_bytes / 1e9
            os.environ["MINGPT_CACHE_DIR"] = str(work / "cache")
            train_glob, val = f"{remote}/fineweb_train_*.bin", str(shards[0])
            settings = ["data_config.shards_at_once=1", f"data_config.shard_cache_gb={cache_gb}"]
            command = [*overrides(train_glob, val, tokenizer, work / "run", args), *settings]
            run = measure_run(command, work, args)
            for copy in (work / "cache" / FOLDER).glob("*"):
                copy.unlink()  # the steady state starts from an empty cache too
            config = DataConfig(path=train_glob, val_path=val, tokenizer=str(tokenizer), truncate=1.0,
                                shards_at_once=1, shard_cache_gb=cache_gb)
            steady = steady_state(config, work / "cache" / FOLDER)
            local = replace(config, path=str(work / "fineweb" / "fineweb_train_*.bin"))
            baseline = steady_state(local, work / "cache" / FOLDER)
        finally:
            process.kill()
    report = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "shard_bytes": shard_bytes, "cache_bytes": int(cache_gb * 1e9), "upload_s": upload_s,
              "startup_run": run, "steady_state": steady, "steady_state_local": baseline,
              "targets": {"first_step_s": 15.0, "disk_bytes_at_most": int(cache_gb * 1e9)}}
    first_step = run.get("first_step_s")
    print(f"{args.shards} shards of {args.tokens_per_shard:,} tokens ({shard_bytes / 1e6:.0f} MB) on S3 "
          f"(moto, loopback), a cache of {args.cache_shards} shards:")
    print(f"  start-up to the first step: {first_step:.1f} s (target < 15 s)" if first_step else
          f"  start-up run failed: {run.get('error')}")
    print(f"  an epoch at an H100 gpt2 step's pace ({steady['step_s'] * 1e3:.0f} ms per 32 x 1024 batch, "
          f"{steady['batches']} batches): {steady['waited_share']:.1%} of batches waited over 10 ms "
          f"(all waits {steady['waited_s']:.2f} s, longest {steady['longest_wait_s'] * 1e3:.0f} ms); "
          f"first batch {steady['first_batch_s']:.2f} s")
    print(f"  the same shards on this disk: {baseline['waited_share']:.1%} waited over 10 ms (all waits "
          f"{baseline['waited_s']:.2f} s, longest {baseline['longest_wait_s'] * 1e3:.0f} ms)")
    print(f"  most disk the copies took: {steady['most_disk_bytes'] / 1e6:.0f} MB of the cache's "
          f"{cache_gb * 1e3:.0f} MB")
    save_json(args.json, report)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
