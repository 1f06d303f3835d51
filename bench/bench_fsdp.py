"""Per-rank memory and throughput of DDP against FSDP, on a model where sharding matters.

    python bench/bench_fsdp.py [--nproc 2] [--layers 12] [--embd 768] [--batch-size 4] [--steps 5]
                               [--activation-checkpointing full]

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
- tokens/s over all ranks.
Figures are printed as a table and written as JSON (--json).
"""
import argparse
from pathlib import Path

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

import torch  # noqa: E402  (common puts mingpt/ on the path first)
from activation_checkpointing import CHECKPOINTING_MODES, saved_activations  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    """Runs under torchrun: time training steps, then rank 0 emits every rank's figures."""
    from process_group import all_gather_objects, distributed_session

    with distributed_session() as env, benchmark_trainer(
            env, args.layers, args.heads, args.embd, args.block_size, batch_size=args.batch_size,
            use_amp=args.amp, amp_dtype="bfloat16", distributed_method=args.method,
            activation_checkpointing=args.activation_checkpointing) as trainer:
        elapsed = timed_steps(trainer, args.warmup, args.steps, lambda: reset_peak_memory(env.device))
        tokens = args.steps * args.batch_size * args.block_size * env.world_size
        mine = {"rank": env.rank, "state_mb": held_state_bytes(trainer) / 1e6,
                "peak_mb": peak_memory(env.device) / 1e6, "tokens_per_s": tokens / elapsed,
                "activations_mb": activation_bytes(trainer) / 1e6}
        everyone = all_gather_objects(mine)
        if env.is_main:
            params = sum(p.numel() for p in trainer.model.parameters())
            emit({"method": args.method, "params": params, "ranks": everyone})


def activation_bytes(trainer) -> int:
    """Bytes one forward pass of a training batch saves for backward (then the backward pass, so
    that DDP and FSDP finish the step they started; the gradients are dropped)."""
    inputs, targets = (t.to(trainer.env.device) for t in next(iter(trainer.train_loader)))
    with saved_activations() as saved:
        loss = trainer.compute_loss(inputs, targets)
    trainer.backward(loss)
    trainer.optimizer.zero_grad(set_to_none=True)
    return saved.bytes


def run_method(args: argparse.Namespace, method: str) -> dict:
    return run_workers(__file__, args.nproc, args.threads, ["--method", method, *forwarded(args)])


def forwarded(args: argparse.Namespace) -> list[str]:
    return [*shared_flags(args), "--batch-size", str(args.batch_size),
            "--activation-checkpointing", args.activation_checkpointing] + (["--amp"] if args.amp else [])


def report(results: list[dict]) -> None:
    print(f"{'method':<6} {'rank':>4} {'state MB':>9} {'peak MB':>9} {'activations MB':>14} {'tokens/s':>9}")
    for result in results:
        for rank in result["ranks"]:
            print(f"{result['method']:<6} {rank['rank']:>4} {rank['state_mb']:>9.0f} {rank['peak_mb']:>9.0f} "
                  f"{rank['activations_mb']:>14.1f} {rank['tokens_per_s']:>9.0f}")


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
    parser.add_argument("--json", type=Path, default=RESULTS / "fsdp.json")
    parser.add_argument("--method", default="ddp", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    results = [run_method(args, method) for method in ("ddp", "fsdp")]
    report(results)
    save_json(args.json, {"settings": vars(args), "results": results})


if __name__ == "__main__":
    main()
