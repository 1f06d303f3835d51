"""The planner's memory and step time (mingpt/plan.py) against measured runs on this machine.

    python bench/bench_plan.py                       # the grid below, about 25 minutes
    python bench/bench_plan.py --models default --batch-sizes 4 --steps 2

Grid: ddp and fsdp on 2 ranks (torchrun, gloo, one thread each) and a world of one, activation
checkpointing none and full, two model sizes (the default 8 x 512, 25M parameters, and gpt2-medium's
24 x 1024, 303M) and two batch sizes each. Each launch runs one model and batch; its ranks run
the configurations one after another, each built through the project's Trainer.

Measured peak: each rank's resident memory at its high-water mark (VmHWM) during a
configuration's start-up and training steps, less its resident memory just before (the baseline,
taken after a small model has run the same code paths once, so that torch's code and buffers are
already in). glibc is told to return freed blocks of 64 KiB or more to the system at once
(M_MMAP_THRESHOLD), so that resident memory follows what torch allocates and frees: the CPU
counterpart of torch.cuda.max_memory_allocated, which the planner predicts. With glibc's defaults
(--malloc default) freed memory is kept for reuse and the high-water mark lies 17-87% above
(reported, no target: that is the allocator's, as a GPU's caching allocator keeps its reserve).
Target: every prediction within 10% of the measured peak of every rank.

Step time: measured over the steps after the first; the compute alone from a DDP step without its
gradient all-reduce, which gives the utilisation reached here (achieved FLOP/s over the 1-thread
fp32 matmul peak); the planner's step time (planning/step_time.py) at that utilisation and at
the bandwidth and latency of gloo's all-reduce measured here, against the measured one; the
communication share: the step's time beyond that compute, measured and predicted (no target).
"""
import argparse
import ctypes
import dataclasses
import gc
import time
from pathlib import Path

import torch
from common import RESULTS, benchmark_trainer, emit, run_workers, save_json, synthetic_dataset

from mingpt.distributed import parallel
from mingpt.model import GPTConfig
from mingpt.planning.memory import MemoryEstimate, Placement, estimate_memory
from mingpt.planning.step_time import Cluster, step_time
from mingpt.reporting.flops import matmul_flops_by_size

MODELS = {"default": (8, 8, 512), "gpt2-medium": (24, 16, 1024), "tiny": (2, 4, 128)}
BATCH_SIZES = {"default": (4, 16), "gpt2-medium": (1, 2), "tiny": (8,)}
CONFIGS = ("ddp:none:2", "ddp:full:2", "fsdp:none:2", "fsdp:full:2", "ddp:none:1", "ddp:full:1")
"""method:checkpointing:ranks; ranks 1 is a world of one on each rank (no DDP wrapper)."""
VOCAB_SIZE = 65  # common.synthetic_text's alphabet
TARGET = 0.10
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 1024


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def fresh_baseline() -> int:
    """Hand freed memory back, restart the high-water mark, and return resident memory now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM restarts from VmRSS
    return status_bytes("VmRSS")


def parse_config(text: str) -> tuple[str, str, int]:
    method, checkpointing, ranks = text.split(":")
    return method, checkpointing, int(ranks)


def timed_steps(trainer, steps: int, sync: bool = True) -> list[float]:
    """Seconds of each step (the first one included: its optimizer state makes the peak of later
    ones); sync=False skips the gradient all-reduce (DDP's compute alone)."""
    batches, seconds = iter(trainer.train_loader), []
    for _ in range(steps):
        inputs, targets = trainer.to_device(next(batches))
        start = time.perf_counter()
        with parallel.gradient_sync(trainer.model, enabled=sync):
            trainer._run_batch(inputs, targets)[0].item()
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(env, args, text: str) -> dict:
    """One configuration on this rank: its peak over the baseline, and its step times."""
    method, checkpointing, ranks = parse_config(text)
    alone = dataclasses.replace(env, rank=0, local_rank=0, world_size=1, local_world_size=1)
    dataset = synthetic_dataset(args.block_size)  # before the baseline: the data is not the step's
    predict(args, text)  # and the planner's trace of the step (made once per machine) is not either
    base = fresh_baseline()
    with benchmark_trainer(env if ranks > 1 else alone, *shape_of(args), args.block_size, dataset,
                           batch_size=args.batch_size, distributed_method=method,
                           activation_checkpointing=checkpointing) as trainer:
        seconds = timed_steps(trainer, args.steps)
        peak = status_bytes("VmHWM") - base
        timing = args.timing and method == "ddp" and ranks > 1
        compute = timed_steps(trainer, 2, sync=False)[-1] if timing else None
    return {"config": text, "rank": env.rank, "peak": peak, "step_s": min(seconds[1:]),
            "compute_s": compute}


def shape_of(args) -> tuple[int, int, int]:
    return args.layers, args.heads, args.embd


def gloo_links(repeats: int = 3) -> dict:
    """Bandwidth (bytes/s, each way) and latency (s per message step) of gloo's all-reduce
    between 2 ranks, in the step-time model's terms: t = 2 (n-1) a + 2 (n-1)/n S / b."""
    import torch.distributed as dist

    def best(tensor: torch.Tensor) -> float:
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    size = 32 * 2**20
    latency = best(torch.zeros(1)) / 2
    return {"bandwidth": size / max(best(torch.zeros(size // 4)) - 2 * latency, 1e-9), "latency": latency}


def worker(args: argparse.Namespace) -> None:
    from mingpt.distributed.process_group import all_gather_objects, distributed_session

    if args.malloc == "fixed":
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    with distributed_session() as env:
        links = gloo_links() if args.timing else None
        for checkpointing in ("none", "full"):  # the same code paths once, before any baseline
            with benchmark_trainer(env, 2, 2, 64, args.block_size, batch_size=2,
                                   activation_checkpointing=checkpointing, distributed_method="fsdp") as warm:
                timed_steps(warm, 1)
        mine = [measure(env, args, text) for text in args.configs.split(",")]
        everyone = all_gather_objects(mine)
        if env.is_main:
            emit({"links": links, "ranks": everyone})


def model_config(shape: argparse.Namespace) -> GPTConfig:
    return GPTConfig(n_layer=shape.layers, n_head=shape.heads, n_embd=shape.embd, vocab_size=VOCAB_SIZE,
                     block_size=shape.block_size)


def run_launch(args, model: str, batch_size: int, peak_flops: float) -> list[dict]:
    """One torchrun launch of one model and batch: its configurations, measured and predicted."""
    layers, heads, embd = MODELS[model]
    shape = argparse.Namespace(model=model, layers=layers, heads=heads, embd=embd, block_size=args.block_size,
                               batch_size=batch_size)
    flags = ["--layers", layers, "--heads", heads, "--embd", embd, "--block-size", args.block_size,
             "--batch-size", batch_size, "--steps", args.steps, "--configs", args.configs,
             "--malloc", args.malloc, "--timing" if args.timing else "--no-timing"]
    result = run_workers(__file__, 2, 1, flags)
    measured = [entry for rank in result["ranks"] for entry in rank]
    rows = [memory_row(shape, text, [entry for entry in measured if entry["config"] == text])
            for text in args.configs.split(",")]
    if args.timing:
        compute = {entry["config"].split(":")[1]: entry["compute_s"]
                   for entry in measured if entry["compute_s"]}
        for row, text in zip(rows, args.configs.split(",")):
            mine = [entry for entry in measured if entry["config"] == text]
            row.update(timing_fields(shape, row, mine, compute, result["links"], peak_flops))
    return rows


def predict(shape: argparse.Namespace, text: str) -> MemoryEstimate:
    """The planner's estimate of one configuration's peak per rank."""
    method, checkpointing, ranks = parse_config(text)
    placement = Placement(method, ranks, ranks)
    return estimate_memory(model_config(shape), shape.batch_size, checkpointing, placement)


def memory_row(shape: argparse.Namespace, text: str, mine: list[dict]) -> dict:
    """A configuration's measured peaks (one per rank) beside the planner's estimate."""
    method, checkpointing, ranks = parse_config(text)
    estimate = predict(shape, text)
    peaks = [entry["peak"] for entry in mine]
    return {"model": shape.model, "batch_size": shape.batch_size, "method": method,
            "checkpointing": checkpointing, "ranks": ranks, "measured_peaks": peaks,
            "predicted_peak": estimate.peak, "predicted": dataclasses.asdict(estimate),
            "errors": [(estimate.peak - peak) / peak for peak in peaks]}


def timing_fields(shape, row: dict, mine: list[dict], compute: dict, links: dict, peak_flops: float) -> dict:
    """Measured step time and communication share beside the planner's, at the utilisation reached
    here (DDP's step without its all-reduce) and gloo's measured bandwidth and latency."""
    from mingpt.planning.advice import Setting  # the parent's only: the workers need not import it

    method, checkpointing, ranks = row["method"], row["checkpointing"], row["ranks"]
    setting = Setting(model_config(shape), shape.batch_size, Placement(method), checkpointing, None, 0.9)
    work = setting.work(checkpointing)
    compute_s = compute.get(checkpointing) or min(entry["step_s"] for entry in mine)
    utilization = (work.flops_per_token + work.recompute_flops_per_token) * work.tokens_per_micro_batch / (
        compute_s * peak_flops)
    cluster = Cluster(1, ranks, 0, peak_flops, utilization, links["bandwidth"], 1.0, links["latency"], 0.0,
                      "cpu")
    timing = step_time(method, work, cluster)
    step_s = max(entry["step_s"] for entry in mine)
    return {"utilization": utilization, "measured_step_s": step_s, "predicted_step_s": timing.seconds,
            "step_error": (timing.seconds - step_s) / step_s,
            "measured_communication_share": max(0.0, 1 - compute_s / step_s) if ranks > 1 else 0.0,
            "predicted_communication_share": timing.exposed / timing.seconds}


def report(rows: list[dict]) -> None:
    print(f"{'model':<12} {'batch':>5} {'method':<6} {'ckpt':<4} {'ranks':>5} | {'predicted MB':>12} "
          f"{'measured MB':>17} {'error':>13} {'<=10%':>5} | {'step s':>6} {'pred s':>6} {'comm %':>6} "
          f"{'pred %':>6}")
    for row in rows:
        measured = "/".join(f"{peak / 1e6:.0f}" for peak in row["measured_peaks"])
        errors = "/".join(f"{100 * error:+.1f}%" for error in row["errors"])
        ok = "yes" if all(abs(error) <= TARGET for error in row["errors"]) else "NO"
        timing = (f"{row['measured_step_s']:>6.2f} {row['predicted_step_s']:>6.2f} "
                  f"{100 * row['measured_communication_share']:>5.0f}% "
                  f"{100 * row['predicted_communication_share']:>5.0f}%") if "measured_step_s" in row else ""
        print(f"{row['model']:<12} {row['batch_size']:>5} {row['method']:<6} {row['checkpointing']:<4} "
              f"{row['ranks']:>5} | {row['predicted_peak'] / 1e6:>12.0f} {measured:>17} {errors:>13} "
              f"{ok:>5} | "
              f"{timing}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", default="default,gpt2-medium",
                        help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default: two per model)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="method:checkpointing:ranks, comma-separated")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="training steps per configuration (2 or more)")
    parser.add_argument("--malloc", choices=("fixed", "default"), default="fixed",
                        help="fixed: glibc returns freed blocks of 64 KiB at once; default: glibc's own")
    parser.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True,
                        help="also time steps and gloo's links (--no-timing: memory only)")
    parser.add_argument("--json", type=Path, default=RESULTS / "plan.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--layers", "--heads", "--embd", "--batch-size"):
        parser.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    torch.set_num_threads(1)  # the ranks' own count
    peak_flops = max(matmul_flops_by_size(torch.float32).values()) if args.timing else 0.0
    rows = []
    for model in args.models.split(","):
        given = args.batch_sizes
        batch_sizes = [int(b) for b in given.split(",")] if given else BATCH_SIZES[model]
        for batch_size in batch_sizes:
            rows += run_launch(args, model, batch_size, peak_flops)
            report(rows[-len(args.configs.split(",")):])
    print()
    report(rows)
    worst = max(abs(error) for row in rows for error in row["errors"])
    print(f"\nlargest memory error {100 * worst:.1f}% (target {100 * TARGET:.0f}%); "
          f"fp32 matmul peak, 1 thread: {peak_flops / 1e9:.1f} GFLOP/s")
    save_json(args.json, {"settings": vars(args), "peak_flops_1_thread": peak_flops, "target": TARGET,
                          "largest_error": worst, "rows": rows})


if __name__ == "__main__":
    main()
