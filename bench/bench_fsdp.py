"""Per-rank memory and throughput of DDP against FSDP, on a model where sharding matters.

    python bench/bench_fsdp.py [--nproc 2] [--layers 12] [--embd 768] [--batch-size 4] [--steps 5]
                               [--activation-checkpointing full]
    python bench/bench_fsdp.py --model-type gpt2-large --batch-size 1 --amp \
        --activation-checkpointing full --snapshot --steps 3 --json bench/results/gpt2_large.json

For each method it starts `torchrun --standalone --nproc_per_node=N` on this script's worker mode,
which builds the model and Trainer through the project's own code and times real training steps.
Each rank reports:
- state MB: parameters + gradients + AdamW moments it holds (exact tensor bytes; 1/N under FSDP);
- peak MB: the peak during the timed steps (start-up builds the whole model before sharding): the
  process's resident memory on the CPU (everything: Python, torch, activations, gathered blocks),
  or torch.cuda.max_memory_allocated on a GPU;
- activations MB: the bytes one step's forward pass saves for its backward pass, counted exactly as
  autograd saves them (activation_checkpointing.saved_activations; parameters left out): with
  --activation-checkpointing full, each block's input only;
- tokens/s over all ranks;
- comm %: under FSDP, the share of a step the training thread spends in FSDP's all-gathers and
  reduce-scatters, their copies, and waiting for them (torch.profiler's FSDP:: regions over one
  more step); DDP's all-reduce runs on gloo's or NCCL's own threads while backward computes, and
  is left out;
- with --snapshot, the seconds one sharded snapshot takes (every rank writes its shard) and its size.
A method the memory check refuses (memory.py: parameters, gradients and AdamW state cannot fit) is
reported with its one-line refusal instead of figures: that is how DDP shows it cannot hold a model.
Figures are printed as a table and written as JSON (--json).
"""
import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import (
    RESULTS,
    add_shared_arguments,
    benchmark_trainer,
    emit,
    held_state_bytes,
    peak_memory,
    reset_peak_memory,
    run_workers,
    save_json,
    shared_flags,
    timed_steps,
)

from mingpt.common.errors import MinGPTError
from mingpt.distributed.activation_checkpointing import CHECKPOINTING_MODES, saved_activations
from mingpt.model import PRESETS

COMMUNICATION_REGIONS = ("FSDP::all_gather", "FSDP::post_backward_reduce", "FSDP::post_backward_rs_wait")
"""FSDP2's record_function names around its collectives (all_gather also covers all_gather_copy_out,
where an asynchronous all-gather is waited for); they do not nest in one another."""


def worker(args: argparse.Namespace) -> None:
    """Runs under torchrun: time training steps, then rank 0 emits every rank's figures."""
    from mingpt.distributed.process_group import all_gather_objects, distributed_session

    settings = dict(batch_size=args.batch_size, use_amp=args.amp, amp_dtype="bfloat16",
                    distributed_method=args.method, activation_checkpointing=args.activation_checkpointing,
                    reshard_after_forward=args.method == "ddp" or not args.keep_gathered)
    if args.snapshot_dir:
        settings.update(snapshot_format="sharded", snapshot_path=args.snapshot_dir)
    with distributed_session() as env:
        try:
            with benchmark_trainer(env, args.layers, args.heads, args.embd, args.block_size,
                                   **settings) as trainer:
                mine = measure(trainer, args)
                params = sum(p.numel() for p in trainer.model.parameters())
        except MinGPTError as refused:  # the memory check, before anything was allocated
            if env.is_main:
                emit({"method": args.method, "refused": str(refused)})
            return
        everyone = all_gather_objects(mine)
        if env.is_main:
            emit({"method": args.method, "params": params, "ranks": everyone})


def measure(trainer, args: argparse.Namespace) -> dict:
    """This rank's figures: its start-up peak, then timed steps, then the extra measurements."""
    env = trainer.env
    startup_peak = peak_memory(env.device)
    elapsed = timed_steps(trainer, args.warmup, args.steps, lambda: reset_peak_memory(env.device))
    tokens = args.steps * args.batch_size * args.block_size * env.world_size
    mine = {"rank": env.rank, "state_mb": held_state_bytes(trainer) / 1e6,
            "startup_peak_mb": startup_peak / 1e6, "peak_mb": peak_memory(env.device) / 1e6,
            "tokens_per_s": tokens / elapsed, "step_s": elapsed / args.steps,
            "communication_share": communication_share(trainer),
            "activations_mb": activation_bytes(trainer) / 1e6}
    if args.snapshot_dir:
        start = time.perf_counter()
        trainer._save_snapshot("benchmark")
        mine["snapshot_s"] = time.perf_counter() - start
        written = [f.stat().st_size for f in Path(args.snapshot_dir).rglob("*") if f.is_file()]
        mine["snapshot_mb"] = sum(written) / 1e6
    return mine


def communication_share(trainer) -> float:
    """Of one training step, the share the training thread spent in FSDP's collectives (see
    COMMUNICATION_REGIONS); 0 under DDP, whose all-reduce the profiler does not see in this thread."""
    inputs, targets = trainer.to_device(next(iter(trainer.train_loader)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start = time.perf_counter()
        trainer._run_batch(inputs, targets)[0].item()
        step_us = (time.perf_counter() - start) * 1e6
    in_collectives = sum(event.cpu_time_total for event in profile.key_averages()
                         if event.key.startswith(COMMUNICATION_REGIONS))
    return in_collectives / step_us


def activation_bytes(trainer) -> int:
    """Bytes one forward pass of a training batch saves for backward (then the backward pass, so
    that DDP and FSDP finish the step they started; the gradients are dropped)."""
    inputs, targets = trainer.to_device(next(iter(trainer.train_loader)))
    with saved_activations() as saved:
        loss = trainer.compute_loss(inputs, targets)
    trainer.backward(loss)
    trainer.optimizer.zero_grad(set_to_none=True)
    return saved.bytes


def run_method(args: argparse.Namespace, method: str) -> dict:
    flags = ["--method", method, *forwarded(args)]
    if not args.snapshot:
        return run_workers(__file__, args.nproc, args.threads, flags)
    folder = tempfile.mkdtemp(prefix=f"bench_fsdp_{method}_")
    try:
        return run_workers(__file__, args.nproc, args.threads, [*flags, "--snapshot-dir", folder])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def forwarded(args: argparse.Namespace) -> list[str]:
    return [*shared_flags(args), "--batch-size", str(args.batch_size),
            "--activation-checkpointing", args.activation_checkpointing] + (
                ["--amp"] if args.amp else []) + (["--keep-gathered"] if args.keep_gathered else [])


def report(results: list[dict]) -> None:
    print(f"{'method':<6} {'rank':>4} {'state MB':>9} {'start-up MB':>11} {'peak MB':>9} "
          f"{'activations MB':>14} {'tokens/s':>9} {'comm %':>7} {'snapshot s':>10}")
    for result in results:
        if "refused" in result:
            print(f"{result['method']:<6} refused: {result['refused']}")
            continue
        for rank in result["ranks"]:
            snapshot = f"{rank['snapshot_s']:>10.1f}" if "snapshot_s" in rank else f"{'':>10}"
            print(f"{result['method']:<6} {rank['rank']:>4} {rank['state_mb']:>9.0f} "
                  f"{rank['startup_peak_mb']:>11.0f} {rank['peak_mb']:>9.0f} {rank['activations_mb']:>14.1f} "
                  f"{rank['tokens_per_s']:>9.0f} "
                  f"{100 * rank['communication_share']:>6.1f}% {snapshot}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2,
                        help="ranks per run (one per GPU)")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    add_shared_arguments(parser, layers=12, heads=12, embd=768, steps=5)
    parser.add_argument("--batch-size", type=int, default=4, help="samples per rank per step")
    parser.add_argument("--amp", action="store_true", help="use_amp (bf16 where the device has it)")
    parser.add_argument("--activation-checkpointing", choices=CHECKPOINTING_MODES, default="none",
                        help="trainer_config.activation_checkpointing")
    parser.add_argument("--keep-gathered", action="store_true",
                        help="FSDP: trainer_config.reshard_after_forward=False (gathered parameters kept "
                             "from the forward to the backward pass)")
    parser.add_argument("--model-type", choices=PRESETS, default=None,
                        help="a named model instead of --layers/--heads/--embd (gpt2-large: 774M parameters)")
    parser.add_argument("--methods", default="ddp,fsdp", help="comma-separated: ddp, fsdp")
    parser.add_argument("--snapshot", action="store_true",
                        help="after the timed steps, time one sharded snapshot (written to a scratch folder)")
    parser.add_argument("--json", type=Path, default=RESULTS / "fsdp.json")
    parser.add_argument("--method", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--snapshot-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model_type:
        args.layers, args.heads, args.embd = PRESETS[args.model_type]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    results = [run_method(args, method) for method in args.methods.split(",")]
    report(results)
    save_json(args.json, {"settings": vars(args), "results": results})


if __name__ == "__main__":
    main()
