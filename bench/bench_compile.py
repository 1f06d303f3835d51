"""torch.compile on the CPU: a training step of the default model and of gpt-mini, compiled against
eager, in bf16 (where this CPU computes it natively) and fp32, with the compilation's own time.

    python bench/bench_compile.py [--models default gpt-mini] [--batch-size 8] [--steps 10]

Each case builds a Trainer through the project's code (trainer_config.compile as a run sets it), times
its first step (with compilation, for a compiled model) and the median of --steps steps after it.
Compiled and eager alternate per case in one process. Writes bench/results/compile.json; the verdict
per case (compiled faster, and how many steps repay the compilation) decides what trainer_config.compile
does by default on a CPU (see its docstring).
"""
import argparse
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS, benchmark_trainer, save_json

from mingpt.distributed.precision import cpu_has_native_bf16
from mingpt.distributed.process_group import distributed_session

SIZES = {"default": (8, 8, 512), "gpt-mini": (6, 6, 192)}


def timed(trainer, steps: int) -> tuple[float, float]:
    """(seconds of the first step, median seconds of the next `steps`)."""
    batches = iter(trainer.train_loader)
    times = []
    for _ in range(steps + 1):
        inputs, targets = trainer.to_device(next(batches))
        start = time.perf_counter()
        trainer._run_batch(inputs, targets)[0].item()
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


def case(env, name: str, bf16: bool, compiled: bool, batch: int, block: int, steps: int) -> dict:
    layers, heads, embd = SIZES[name]
    torch._dynamo.reset()
    with benchmark_trainer(env, layers, heads, embd, block, batch_size=batch, use_amp=bf16,
                           compile=compiled) as trainer:
        first, step = timed(trainer, steps)
    return {"first_step_s": first, "step_s": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "compile.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    precisions = [True, False] if cpu_has_native_bf16() else [False]
    rows = []
    with distributed_session() as env:
        for name in args.models:
            for bf16 in precisions:
                eager = case(env, name, bf16, False, args.batch_size, args.block_size, args.steps)
                compiled = case(env, name, bf16, True, args.batch_size, args.block_size, args.steps)
                compile_s = compiled["first_step_s"] - eager["step_s"]
                saved = eager["step_s"] - compiled["step_s"]
                row = {"model": name, "precision": "bf16" if bf16 else "fp32", "eager": eager, "compiled": compiled,
                       "speedup": eager["step_s"] / compiled["step_s"], "compile_s": compile_s,
                       "steps_to_repay": compile_s / saved if saved > 0 else None}
                rows.append(row)
                repay = f"repaid after {row['steps_to_repay']:.0f} steps" if saved > 0 else "never repaid"
                print(f"{name} {row['precision']}: eager {eager['step_s'] * 1e3:.0f} ms/step, compiled "
                      f"{compiled['step_s'] * 1e3:.0f} ms/step ({row['speedup']:.2f}x), compiling {compile_s:.0f} s, "
                      f"{repay}", flush=True)
    save_json(args.json, {"settings": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
