"""DDP scaling on one machine: does adding ranks add throughput?

    python bench/bench_scaling.py [--nproc N] [--global-batch 8] [--steps 10]

Both runs train the default model (8 layers, 8 heads, 512 wide, block 128) through the project's
Trainer. What a fair baseline is depends on the device:
- CPU: N processes x 1 thread against 1 process x N threads with the same global batch: the same
  arithmetic on the same cores, so efficiency = tokens/s(N x 1) / tokens/s(1 x N) shows what the
  gradient all-reduce (overlapped with the backward pass by DDP's buckets) and processes cost.
- GPU: N GPUs against 1 GPU with the same batch per GPU (weak scaling):
  efficiency = tokens/s(N GPUs) / (N x tokens/s(1 GPU)).
1.0 is perfect either way.
"""
import argparse
from pathlib import Path

import torch
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
    from mingpt.distributed.process_group import distributed_session

    with distributed_session() as env:
        with benchmark_trainer(env, args.layers, args.heads, args.embd, args.block_size,
                               batch_size=args.batch) as trainer:
            elapsed = timed_steps(trainer, args.warmup, args.steps)
            if env.is_main:
                global_batch = args.batch * env.world_size
                tokens = args.steps * global_batch * args.block_size
                emit({"ranks": env.world_size, "threads": torch.get_num_threads(),
                      "global_batch": global_batch, "tokens_per_s": tokens / elapsed})


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2,
                        help="processes: one per GPU, or CPU processes (and threads of the one-process run)")
    parser.add_argument("--global-batch", type=int, default=8, help="samples per step of the N-process run")
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)  # per rank, for the workers
    add_shared_arguments(parser, layers=8, heads=8, embd=512, steps=10)
    parser.add_argument("--json", type=Path, default=RESULTS / "scaling.json")
    return parser.parse_args(argv)


def compare(args: argparse.Namespace, on_gpus: bool) -> dict:
    """The N-rank run and its baseline, and the efficiency between them."""
    flags = shared_flags(args)
    per_rank = args.global_batch // args.nproc
    many = run_workers(__file__, args.nproc, 1, ["--batch", per_rank, *flags])
    if on_gpus:
        one = run_workers(__file__, 1, 1, ["--batch", per_rank, *flags])
        return {"baseline": "1 GPU, same batch per GPU", "one": one, "many": many,
                "efficiency": many["tokens_per_s"] / (args.nproc * one["tokens_per_s"])}
    one = run_workers(__file__, 1, args.nproc, ["--batch", args.global_batch, *flags])
    return {"baseline": f"1 process x {args.nproc} threads, same global batch", "one": one, "many": many,
            "efficiency": many["tokens_per_s"] / one["tokens_per_s"]}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    on_gpus = torch.cuda.is_available()
    result = compare(args, on_gpus)
    unit = "GPU(s)" if on_gpus else "process(es)"
    print(f"baseline ({result['baseline']}): {result['one']['tokens_per_s']:8.0f} tokens/s")
    print(f"{args.nproc} {unit}: {result['many']['tokens_per_s']:8.0f} tokens/s")
    print(f"DDP scaling efficiency: {result['efficiency']:.3f}")
    save_json(args.json, {"settings": vars(args), **result})


if __name__ == "__main__":
    main()
