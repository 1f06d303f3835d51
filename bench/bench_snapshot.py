"""Snapshot save and load speed for the default model, locally and on S3, and the training pause.

    python bench/bench_snapshot.py [--repeats 3]

- save / load: write_snapshot and read_snapshot of a full snapshot (model, AdamW state, RNG states)
  to a local folder and to a real S3 server on loopback (moto, as the tests use), in MB/s; and
  torch.load parsing straight from the file object, which read_snapshot avoids by reading first;
- pause, with and without `async_snapshots`, locally and on S3: how long Trainer._save_snapshot
  holds training up (sync: gather and write; async: gather and the copy, the first save also
  allocating the staging memory), and what a save costs training in all: the time from the save
  until it is written with the steps that follow it trained meanwhile, minus those steps alone
  (the writer shares the CPU with training); enough steps to cover a sync save; one process.
"""
import argparse
import math
import os
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
from common import RESULTS, benchmark_trainer, save_json, timed_steps
from s3_server import start_s3_server

from mingpt.common import files
from mingpt.distributed.parallel import gather_full_state, unwrap
from mingpt.distributed.process_group import distributed_session
from mingpt.storage.snapshot import Snapshot, read_snapshot, write_snapshot


def best_of(repeats: int, action) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


def snapshot_of(trainer) -> Snapshot:
    """A full snapshot of a trained-one-step model, as the trainer writes it."""
    inputs, targets = trainer.to_device(next(iter(trainer.train_loader)))
    trainer._run_batch(inputs, targets)
    model_state, optimizer_state = gather_full_state(trainer.model, trainer.optimizer)
    return Snapshot(model_state=model_state, optimizer_state=optimizer_state, vocab=trainer.vocab,
                    model_config=asdict(unwrap(trainer.model).config))


def load_streamed(url: str) -> None:
    """torch.load straight from the (remote) file object: what read_snapshot avoids."""
    with files.open_file(url, "rb") as f:
        torch.load(f, map_location="cpu", weights_only=True)


def measure(snapshot: Snapshot, url: str, repeats: int) -> dict:
    save_s = best_of(repeats, lambda: write_snapshot(snapshot, url))
    load_s = best_of(repeats, lambda: read_snapshot(url))
    streamed_s = best_of(repeats, lambda: load_streamed(url))
    return {"save_s": save_s, "load_s": load_s, "load_streamed_s": streamed_s}


def measure_pauses(env, args, path: str) -> dict:
    """Saves to path from a trainer with and without async_snapshots; see the module docstring."""
    results: dict = {}
    steps_between = 1
    for async_snapshots in (False, True):
        with benchmark_trainer(env, args.layers, args.heads, args.embd, 128, batch_size=8, snapshot_path=path,
                               async_snapshots=async_snapshots) as trainer:
            timed_steps(trainer, warmup=1, steps=0)  # AdamW has state to save
            if async_snapshots:
                results["async_first_pause_s"] = timed_save(trainer, steps=0)[0]
            saves = [timed_save(trainer, steps_between) for _ in range(args.repeats)]
            pause_s, with_steps_s = (min(times) for times in zip(*saves))
            steps_s = min(timed_steps(trainer, warmup=0, steps=steps_between) for _ in range(args.repeats))
        mode = "async" if async_snapshots else "sync"
        results.update({f"{mode}_pause_s": pause_s, f"{mode}_cost_s": with_steps_s - steps_s})
        if not async_snapshots:  # enough steps between saves to hide a write as long as this one
            steps_between = max(1, math.ceil(pause_s / steps_s))
    results.update(step_s=steps_s / steps_between, steps_between_saves=steps_between)
    return results


def timed_save(trainer, steps: int) -> tuple[float, float]:
    """Seconds until _save_snapshot returns, and until it is written with `steps` steps trained
    after it (with async_snapshots, while the background thread writes)."""
    start = time.perf_counter()
    trainer._save_snapshot("benchmark")
    pause = time.perf_counter() - start
    if steps:
        timed_steps(trainer, warmup=0, steps=steps)
    trainer.checkpointer.finish()
    return pause, time.perf_counter() - start


@contextmanager
def s3_server(scratch: Path):
    """The loopback S3 server, with its address and keys in this process's environment."""
    server, process = start_s3_server(scratch / "moto.log")
    try:
        os.environ.update(server.env())
        yield server
    finally:
        process.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8, help="the default model's shape unless given")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the loopback S3 server (needs the test requirements: moto)")
    parser.add_argument("--json", type=Path, default=RESULTS / "snapshot.json")
    args = parser.parse_args()
    results: dict = {}
    with distributed_session() as env, tempfile.TemporaryDirectory() as scratch, \
            (s3_server(Path(scratch)) if args.s3 else nullcontext()) as server:
        with benchmark_trainer(env, args.layers, args.heads, args.embd, 128, batch_size=8) as trainer:
            snapshot = snapshot_of(trainer)
        targets = {"local": f"{scratch}/snap.pt"}
        if server:
            targets["s3"] = f"s3://{server.bucket}/bench/snap.pt"
        for where, path in targets.items():
            results[where] = measure(snapshot, path, args.repeats)
        size_mb = os.path.getsize(targets["local"]) / 1e6
        for where, path in targets.items():
            results[where].update(measure_pauses(env, args, path))
    print(f"snapshot of a {args.layers} x {args.embd} model: {size_mb:.0f} MB")
    for where, r in results.items():
        print(f"{where:>5}: save {r['save_s']:.2f} s ({size_mb / r['save_s']:.0f} MB/s), "
              f"load {r['load_s']:.2f} s ({size_mb / r['load_s']:.0f} MB/s); "
              f"parsed from the stream instead: {r['load_streamed_s']:.2f} s")
        print(f"{where:>5}: training waits {r['sync_pause_s']:.2f} s per save, {r['async_pause_s']:.2f} s "
              f"with async_snapshots (the first {r['async_first_pause_s']:.2f} s); a save costs training "
              f"{r['sync_cost_s']:.2f} s, {r['async_cost_s']:.2f} s async over the "
              f"{r['steps_between_saves']} step(s) of {r['step_s']:.2f} s it overlaps")
    save_json(args.json, {"settings": vars(args), "size_mb": size_mb, **results})


if __name__ == "__main__":
    main()
