"""What the run watchdog and the straggler timing cost a step of the default model.

    python bench/bench_watchdog.py [--batch 8] [--rounds 15] [--threads 2]

On every step the training thread tells its watchdog where it is (RunWatchdog.at, five times) and
its StepClock times the data wait and the computation up to the embeddings' gradients (two
post-accumulate-grad hooks). This alternates Trainer steps with all of that on and with it off
(RunWatchdog.at and the hooks' work patched out), step by step in one process so that both see the
same machine, and prints the median step of each and the median of the per-round ratios. It also
times the added work alone, many times over, for a bound that noise cannot hide: its microseconds
over the step's milliseconds. (The watchdog's thread, which posts every few seconds under a
launcher only, was measured in a whole 2-rank run: bench/results/watchdog_overhead.md.)
"""
import argparse
import statistics
import time
from pathlib import Path
from unittest import mock

import torch
from common import RESULTS, benchmark_trainer, save_json

from mingpt.distributed.process_group import distributed_session
from mingpt.distributed.stragglers import StepClock
from mingpt.distributed.watchdog import RunWatchdog
from mingpt.model import GPTConfig
from mingpt.trainer import Trainer

BLOCK = 128  # the default model's


def one_step(trainer: Trainer, batches) -> float:
    """A step as Trainer._run_epoch takes it: its data, then _run_batch (which says where it is)."""
    start = time.perf_counter()
    trainer.guard.watch.at("data", 1)
    inputs, targets = trainer.to_device(next(batches))
    trainer._run_batch(inputs, targets)
    return time.perf_counter() - start


def added_work_us(trainer: Trainer, repeats: int = 20_000) -> float:
    """Microseconds of the watchdog's and the clock's work in one step, timed alone."""
    watch, clock = trainer.guard.watch, trainer.guard.watch.clock
    start = time.perf_counter()
    for _ in range(repeats):
        watch.at("data", 1)
        watch.at("forward", 1, 0)
        watch.at("backward", 1, 0)
        clock._arrived()
        clock._arrived()
        watch.at("optimizer", 1)
    return 1e6 * (time.perf_counter() - start) / repeats


def compare(env, batch: int, rounds: int) -> dict:
    default = GPTConfig()
    with benchmark_trainer(env, default.n_layer, default.n_head, default.n_embd, BLOCK,
                           batch_size=batch) as trainer:
        # As under a launcher with other ranks (the thread, which posts every few seconds, aside).
        trainer.guard.watch.active = True
        trainer.guard.time_arrivals(trainer.model.input_parameters())
        batches = iter(trainer.train_loader)
        watched, unwatched = [], []
        for _ in range(rounds + 1):
            watched.append(one_step(trainer, batches))
            with mock.patch.object(RunWatchdog, "at", lambda *args: None), \
                    mock.patch.object(StepClock, "_arrived", lambda self: None):
                unwatched.append(one_step(trainer, batches))
        added_us = added_work_us(trainer)
    watched, unwatched = watched[1:], unwatched[1:]  # the first round warms the allocator up
    step_ms = 1e3 * statistics.median(unwatched)
    result = {"batch_size": batch, "block_size": BLOCK, "ms_watched": 1e3 * statistics.median(watched),
              "ms_unwatched": step_ms, "ratio": statistics.median(w / u for w, u in zip(watched, unwatched)),
              "added_us_per_step": added_us, "added_share": added_us / 1e3 / step_ms,
              "rounds_ms": {"watched": [1e3 * s for s in watched], "unwatched": [1e3 * s for s in unwatched]}}
    print(f"default model, batch {batch}: {result['ms_unwatched']:.1f} ms/step without the watchdog and the "
          f"straggler timing, {result['ms_watched']:.1f} with them (paired ratio {result['ratio']:.3f}); "
          f"their work alone: {added_us:.1f} us per step, {result['added_share']:.4%} of the step")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch", type=int, default=8,
                        help="samples per step (the default config's 216 takes most of a minute on 2 cores; "
                             "the added work is the same per step, so a larger batch only shrinks its share)")
    parser.add_argument("--rounds", type=int, default=15, help="timed pairs of steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "watchdog.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with distributed_session() as env:
        result = compare(env, args.batch, args.rounds)
    save_json(args.json, {"settings": vars(args), "result": result})


if __name__ == "__main__":
    main()
