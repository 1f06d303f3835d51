"""Snapshot save and load speed for the default model, locally and on S3, and the training pause.

    python bench/bench_snapshot.py [--repeats 3]

- save / load: write_snapshot and read_snapshot of a full snapshot (model, AdamW state, RNG states)
  to a local folder and to a real S3 server on loopback (moto, as the tests use), in MB/s; and
  torch.load parsing straight from the file object, which read_snapshot avoids by reading first;
- pause: how long Trainer._save_snapshot holds training up (gather, RNG states, write), one process.
"""
import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from common import REPO, RESULTS, benchmark_trainer, save_json

import fsspec  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))  # the tests' S3 server

from parallel import gather_full_state, unwrap  # noqa: E402
from process_group import distributed_session  # noqa: E402
from s3_server import start_s3_server  # noqa: E402
from snapshot import Snapshot, read_snapshot, write_snapshot  # noqa: E402


def best_of(repeats: int, action) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


def snapshot_of(trainer) -> Snapshot:
    """A full snapshot of a trained-one-step model, as the trainer writes it."""
    inputs, targets = (t.to(trainer.env.device) for t in next(iter(trainer.train_loader)))
    trainer.train_step(inputs, targets)
    model_state, optimizer_state = gather_full_state(trainer.model, trainer.optimizer)
    return Snapshot(model_state=model_state, optimizer_state=optimizer_state, vocab=trainer.vocab,
                    model_config=asdict(unwrap(trainer.model).config))


def load_streamed(url: str) -> None:
    """torch.load straight from the (remote) file object: what read_snapshot avoids."""
    with fsspec.open(url, "rb") as f:
        torch.load(f, map_location="cpu", weights_only=True)


def measure(snapshot: Snapshot, url: str, repeats: int) -> dict:
    save_s = best_of(repeats, lambda: write_snapshot(snapshot, url))
    load_s = best_of(repeats, lambda: read_snapshot(url))
    streamed_s = best_of(repeats, lambda: load_streamed(url))
    return {"save_s": save_s, "load_s": load_s, "load_streamed_s": streamed_s}


def measure_s3(snapshot: Snapshot, scratch: Path, repeats: int) -> dict:
    server, process = start_s3_server(scratch / "moto.log")
    try:
        os.environ.update(server.env())
        return measure(snapshot, f"s3://{server.bucket}/bench/snap.pt", repeats)
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
    results = {}
    with distributed_session() as env, \
            benchmark_trainer(env, args.layers, args.heads, args.embd, 128, batch_size=8) as trainer, \
            tempfile.TemporaryDirectory() as scratch:
        snapshot = snapshot_of(trainer)
        local = f"{scratch}/snap.pt"
        results["local"] = measure(snapshot, local, args.repeats)
        size_mb = os.path.getsize(local) / 1e6
        if args.s3:
            results["s3"] = measure_s3(snapshot, Path(scratch), args.repeats)
        results["pause_s"] = best_of(args.repeats, lambda: trainer._save_snapshot("benchmark"))
    print(f"snapshot of a {args.layers} x {args.embd} model: {size_mb:.0f} MB")
    for where in ("local", "s3")[: 1 + args.s3]:
        r = results[where]
        print(f"{where:>5}: save {r['save_s']:.2f} s ({size_mb / r['save_s']:.0f} MB/s), "
              f"load {r['load_s']:.2f} s ({size_mb / r['load_s']:.0f} MB/s); "
              f"parsed from the stream instead: {r['load_streamed_s']:.2f} s")
    print(f"training waits {results['pause_s']:.2f} s for a local snapshot save")
    save_json(args.json, {"settings": vars(args), "size_mb": size_mb, **results})


if __name__ == "__main__":
    main()
