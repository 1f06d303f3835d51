"""What the checks of a run's health cost: the divergence watch, every step, and the byte counting of
every write of the run's files.

    python bench/bench_step_checks.py [--batch 8] [--threads 2] [--mb 300]

- The watch's work per step (DivergenceWatch.observe, then the host's reads after the step:
  diverged_since and health), three versions each timed alone many times over: before the spike
  rule (git's f5479f2: the non-finite test, on the device), with the spike rule judged on the device
  (git's 236da7c, issue 47), and today's (issue 55: spikes that settle and slow rises, judged on the
  host from a copy of two numbers), in turn and best of 5, so that a machine busy with other work
  slows each alike; beside the default model's step at `--batch`, measured here, for their share.
- A snapshot-sized write (`--mb` of bytes, the default model's state is about 300 MB) through
  files.write_atomically to the local disk, with the byte counting (common/files.py's _Counted,
  which also cuts a large write into 8 MB pieces) and without it, alternated, best of 5 each.
"""
import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from common import REPO, RESULTS, benchmark_trainer, save_json

from mingpt.common import files
from mingpt.distributed import divergence
from mingpt.distributed.process_group import distributed_session
from mingpt.model import GPTConfig

BEFORE = ("f5479f2", "mingpt/distributed/control.py")
"""The commit before the spike rule, and where its DivergenceWatch was: the baseline."""
ON_DEVICE = ("236da7c", "mingpt/distributed/divergence.py")
"""The last commit whose DivergenceWatch judged the spike rule on the device."""


def watch_at(commit: str, path: str) -> type:
    """DivergenceWatch as it was at commit, from git's copy of its module."""
    source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"watch_{commit}", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DivergenceWatch


def watch_us(watch, repeats: int) -> float:
    """Microseconds per step of the watch's work: observe, then the host's reads after the step."""
    loss, norm = torch.tensor(2.5), torch.tensor(1.0)
    reads = [watch.diverged_since] + ([watch.health] if hasattr(watch, "health") else [])
    start = time.perf_counter()
    for step in range(1, repeats + 1):
        watch.observe(step, loss, norm)
        for read in reads:
            read()
    return 1e6 * (time.perf_counter() - start) / repeats


def step_ms(env, batch: int, rounds: int = 6) -> float:
    default = GPTConfig()
    with benchmark_trainer(env, default.n_layer, default.n_head, default.n_embd, 128, batch_size=batch) as trainer:
        batches = iter(trainer.train_loader)
        times = []
        for _ in range(rounds + 1):
            inputs, targets = trainer.to_device(next(batches))
            start = time.perf_counter()
            trainer._run_batch(inputs, targets)
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def write_seconds(megabytes: int, rounds: int = 5) -> dict[str, float]:
    data = bytes(megabytes << 20)
    timed: dict[str, list[float]] = {"counted": [], "uncounted": []}
    with tempfile.TemporaryDirectory(dir=REPO) as folder:
        target = str(Path(folder) / "snap.pt")
        for _ in range(rounds):
            for kind in timed:
                counting = mock.patch.object(files, "_Counted", lambda f, under_way: f) if kind == "uncounted" \
                    else mock.patch.object(files, "WRITE_PIECE", files.WRITE_PIECE)
                with counting:
                    start = time.perf_counter()
                    files.write_atomically(target, lambda f: f.write(data))
                    timed[kind].append(time.perf_counter() - start)
    return {kind: min(seconds) for kind, seconds in timed.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="samples per step of the default model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20_000, help="steps of the watch timed alone")
    parser.add_argument("--mb", type=int, default=300, help="megabytes of the timed write")
    parser.add_argument("--json", type=Path, default=RESULTS / "step_checks.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    watches = {"before": watch_at(*BEFORE), "on_device": watch_at(*ON_DEVICE),
               "after": divergence.DivergenceWatch}
    timed: dict[str, list[float]] = {name: [] for name in watches}
    for _ in range(5):
        for name, watch in watches.items():
            timed[name].append(watch_us(watch(device, scaled=False), args.repeats))
    before, on_device, after = (min(timed[name]) for name in watches)
    with distributed_session() as env:
        step = step_ms(env, args.batch)
    writes = write_seconds(args.mb)
    result = {"watch_us_before": before, "watch_us_on_device": on_device, "watch_us_after": after,
              "added_us": after - before,
              "step_ms": step, "added_share_of_step": (after - before) / 1e3 / step,
              "write_s": writes, "write_ratio": writes["counted"] / writes["uncounted"]}
    print(f"divergence watch per step: {before:.1f} us before the spike rule, {on_device:.1f} us with it on "
          f"the device, {after:.1f} us today ({after - before:+.1f} us against the first, "
          f"{result['added_share_of_step']:+.4%} of the default model's {step:.0f} ms step at batch {args.batch})")
    print(f"a {args.mb} MB write: {writes['uncounted']:.3f} s uncounted, {writes['counted']:.3f} s counted "
          f"(x{result['write_ratio']:.3f}, best of 5)")
    save_json(args.json, {"settings": vars(args), "result": result})


if __name__ == "__main__":
    sys.exit(main())
