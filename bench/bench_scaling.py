"""DDP scaling on one machine: N processes x 1 thread against 1 process x N threads, same global batch.

    python bench/bench_scaling.py [--nproc 2] [--global-batch 8] [--steps 10]

Both runs train the default model (8 layers, 8 heads, 512 wide, block 128) through the project's
Trainer with the same global batch, so they do the same arithmetic on the same cores; the
efficiency ratio, tokens/s(N x 1) / tokens/s(1 x N), shows what gradient all-reduce (overlapped
with the backward pass by DDP's buckets) and process overheads cost. 1.0 is perfect.
"""
import argparse
from pathlib import Path

from common import (
    RESULTS,
    add_shared_arguments,
    benchmark_trainer,
    emit,
    run_workers,
    save_json,
    shared_flags,
    timed_steps,
)


def worker(args: argparse.Namespace) -> None:
    from process_group import distributed_session

    with distributed_session() as env:
        batch = args.global_batch // env.world_size
        with benchmark_trainer(env, args.layers, args.heads, args.embd, args.block_size,
                               batch_size=batch) as trainer:
            elapsed = timed_steps(trainer, args.warmup, args.steps)
            if env.is_main:
                tokens = args.steps * args.global_batch * args.block_size
                emit({"ranks": env.world_size, "tokens_per_s": tokens / elapsed})
            del trainer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes (and threads of the one-process run)")
    parser.add_argument("--global-batch", type=int, default=8)
    add_shared_arguments(parser, layers=8, heads=8, embd=512, steps=10)
    parser.add_argument("--json", type=Path, default=RESULTS / "scaling.json")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    flags = ["--global-batch", str(args.global_batch), *shared_flags(args)]
    one = run_workers(__file__, 1, args.nproc, flags)
    many = run_workers(__file__, args.nproc, 1, flags)
    efficiency = many["tokens_per_s"] / one["tokens_per_s"]
    print(f"1 process x {args.nproc} threads: {one['tokens_per_s']:8.0f} tokens/s")
    print(f"{args.nproc} processes x 1 thread: {many['tokens_per_s']:8.0f} tokens/s")
    print(f"DDP scaling efficiency: {efficiency:.3f}")
    save_json(args.json, {"settings": vars(args), "one_process": one, "processes": many,
                          "efficiency": efficiency})


if __name__ == "__main__":
    main()
