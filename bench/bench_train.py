"""Training-step speed of minGPT, built through the project's own code, against the hardware's limit.

For each model the benchmark builds the GPT, the Trainer and the Trainer's real DataLoader over real
text, and reports:
- tokens/s and ms/step over `--steps` calls of `Trainer._run_batch` (median step; mean, min, max too);
- the step split into data wait, forward, backward, optimizer and communication, from `--split-steps`
  more steps timed phase by phase (Trainer.compute_loss, .backward, .optimizer_step, each waited for).
  Communication is the gradient reduction the backward pass does NOT hide: backward with gradient
  sync minus backward without it (DDP's no_sync; FSDP's reduce-scatter off), so it is 0 in one process;
- MFU: model FLOPs (`GPT.flops_per_token`) per second over a peak. CPU: fp32 square matmuls measured
  at the same thread count (and bf16 too with --amp), before and after the models, the better kept.
  GPU: the datasheet's dense bf16 figure (mingpt/flops.py);
- the Linear layers' matmuls as they ran inside the steps (torch.profiler over `--profile-steps`
  more): their FLOP/s against the peak, and their share of the step. A step is almost all Linear
  FLOPs, so their efficiency is about the most MFU can reach; everything else the step does
  (dropout, attention, element-wise ops, the optimizer) is what separates MFU from it;
- peak memory during the steps (CPU: the process's peak resident set; GPU: max allocated) and the
  bytes of parameters, gradients and AdamW state the rank holds.
Figures are printed and written as JSON (--json).

Examples (from the repository root):

    .venv/bin/python bench/bench_train.py                          # default model and gpt-mini, fp32
    .venv/bin/python bench/bench_train.py --models default --profile
    .venv/bin/python bench/bench_train.py --amp --steps 50         # bf16 autocast, MFU vs both peaks
    .venv/bin/python bench/bench_train.py --dropout 0 --compile --warmup 5   # what dropout and eager cost
    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        bench/bench_train.py --threads 1                           # DDP: communication shows up

Under torchrun every rank trains and rank 0 reports its own figures (tokens/s for all ranks).
Every CPU figure says how much of the machine the run had: a busy neighbour can halve it, and the
output flags that as NOISY. Load from other VMs on the host cannot be seen from inside: repeat a run.
This is a benchmark, not a test: it asserts nothing beyond a finite loss.
"""
import argparse
import contextlib
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import psutil
import torch
from common import (
    RESULTS,
    cpu_name,
    held_state_bytes,
    peak_memory,
    reset_peak_memory,
    save_json,
    synthetic_text,
)

from mingpt.char_dataset import (
    DEFAULT_CORPUS,
    CharDataset,
    DataConfig,
    inputs_and_targets,
    open_corpus,
    prepare_corpus,
    split_dataset,
)
from mingpt.common.errors import DataError
from mingpt.common.logger import configure_logging, log
from mingpt.distributed.parallel import METHODS, gradient_sync
from mingpt.distributed.precision import resolve_precision
from mingpt.distributed.process_group import DistEnv, barrier, distributed_session
from mingpt.model import GPT, PRESETS, GPTConfig
from mingpt.optimizer import OptimizerConfig
from mingpt.start_up import place_model
from mingpt.reporting.flops import gpu_peak_flops, matmul_flops_by_size, model_flops_utilization, wait_for
from mingpt.trainer import Trainer, TrainerConfig

SEED = 1337
PHASES = ("data", "forward", "backward", "optimizer", "communication")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", nargs="+", default=["default", "gpt-mini"], metavar="MODEL",
                   choices=["default", *PRESETS],
                   help="'default' is GPTConfig() (8 layers, 8 heads, 512 wide), or a preset: "
                        + ", ".join(PRESETS))
    p.add_argument("--batch-size", type=int, default=8, help="samples per step and rank")
    p.add_argument("--block-size", type=int, default=128, help="tokens per sample")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (allocator, worker start-up)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--split-steps", type=int, default=5, help="steps timed phase by phase")
    p.add_argument("--threads", type=int, default=2, help="torch threads per rank (steps and peak alike)")
    p.add_argument("--workers", type=int, default=1, help="TrainerConfig.data_loader_workers")
    p.add_argument("--method", default="ddp", choices=METHODS, help="TrainerConfig.distributed_method")
    p.add_argument("--amp", action="store_true", help="TrainerConfig.use_amp (bf16 autocast on CPU)")
    p.add_argument("--amp-dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="TrainerConfig.amp_dtype with --amp on CUDA (CPUs always use bf16)")
    p.add_argument("--dropout", type=float, default=None,
                   help="set GPTConfig embd_pdrop, resid_pdrop and attn_pdrop (default: GPTConfig's own)")
    p.add_argument("--compile", action="store_true",
                   help="TrainerConfig.compile (torch.compile); raise --warmup to cover the compilation")
    p.add_argument("--peak-sizes", type=int, nargs="+", default=[1024, 2048, 3072],
                   help="square matmul sizes measured for the CPU peak (the best one counts)")
    p.add_argument("--data", type=Path, default=DEFAULT_CORPUS,
                   help="UTF-8 text file; the default corpus is fetched as main.py fetches it; synthetic "
                        "text is generated (and flagged) when there is none")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="train on synthetic text of this many characters instead of --data (50257: GPT-2's "
                        "output layer)")
    p.add_argument("--profile", action="store_true", help="print the profiled steps' top ops and categories")
    p.add_argument("--profile-steps", type=int, default=3,
                   help="steps recorded by torch.profiler (for the matmuls' speed, and --profile)")
    p.add_argument("--profile-top", type=int, default=15, help="ops listed by --profile")
    p.add_argument("--json", type=Path, default=RESULTS / "train.json", help="where to write the figures")
    args = p.parse_args(argv)
    for name in ("batch_size", "block_size", "steps", "split_steps", "threads", "profile_steps",
                 "profile_top"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0 or args.workers < 0:
        p.error("--warmup and --workers must not be negative")
    return args


# ------------------------------------------------------------------------------------------ the machine

def machine_busy_seconds() -> float:
    """CPU seconds all processes have used since boot (all cores, idle and iowait excepted)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


class CpuMonitor:
    """Was this block alone on the machine? Timings on a shared CPU are only as good as that.

    share: CPU time this process got / (wall time x threads). About 1.0 when its compute threads
    were never preempted (idle OpenMP threads spin, so waits count too).
    others: cores used meanwhile by other processes, beyond the other ranks of this run (the
    DataLoader workers count here; they use a few percent of one core).
    """

    def __init__(self, threads: int, other_ranks: int = 0):
        self.threads, self.expected_others = threads, other_ranks * threads
        self.share = self.others = math.nan

    def __enter__(self) -> "CpuMonitor":
        self.wall, self.cpu, self.busy = time.perf_counter(), time.process_time(), machine_busy_seconds()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.wall
        cpu = time.process_time() - self.cpu
        self.share = cpu / (wall * self.threads)
        used_by_others = max(machine_busy_seconds() - self.busy - cpu, 0.0) / wall
        self.others = max(used_by_others - self.expected_others, 0.0)

    def as_dict(self) -> dict:
        return {"cpu_share": self.share, "other_cores": self.others}


def measured_peak(dtype: torch.dtype, device: torch.device, sizes: list[int], env: DistEnv) -> dict:
    """GFLOP/s of square matmuls of each size (best of repeats); the best size is the peak."""
    with CpuMonitor(torch.get_num_threads(), env.world_size - 1) as monitor:
        rates = matmul_flops_by_size(dtype, device, tuple(sizes), repeats=5)
    by_size = {n: flops / 1e9 for n, flops in rates.items()}
    return {"dtype": str(dtype).removeprefix("torch."), "gflops_by_size": by_size,
            "gflops": max(by_size.values()), "source": "measured", "cpu": monitor.as_dict()}


MATMUL_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}


def peaks(env: DistEnv, args) -> dict[str, dict]:
    """The peaks MFU is quoted against: dtype -> {"gflops": ..., ...}. The first is the peak of the
    precision the steps run in (the Trainer's own choice), the headline; on a CPU training in bf16
    the fp32 peak follows, for comparison."""
    precision = resolve_precision(args.amp, args.amp_dtype, env.device)
    in_use = precision.matmul_dtype
    if env.device.type == "cuda":
        table = gpu_peak_flops(env.device, in_use)
        if table is not None:
            return {in_use: {"dtype": in_use, "gflops": table / 1e9, "source": "datasheet, dense"}}
        precision.configure_matmuls()  # TF32, as the Trainer will allow it
        return {in_use: measured_peak(MATMUL_DTYPES[in_use], env.device, [8192], env)}
    result = {in_use: measured_peak(MATMUL_DTYPES[in_use], env.device, args.peak_sizes, env)}
    if in_use != "fp32":
        result["fp32"] = measured_peak(torch.float32, env.device, args.peak_sizes, env)
    return result


def best_of(first: dict[str, dict], second: dict[str, dict]) -> dict[str, dict]:
    """Per dtype, the higher of two peak measurements: a busy moment on a shared machine can only
    lower a peak, so measuring before and after the models and keeping the best guards against one."""
    return {key: max(first[key], second[key], key=lambda p: p["gflops"]) for key in first}


# ----------------------------------------------------------------------------------- data and model

def load_data(path: Path, block_size: int, env: DistEnv) -> tuple[CharDataset, DataConfig, str]:
    """The project's dataset over the text at path, as main.py loads it: one process per machine
    fetches the default corpus if it is missing and makes the token file, then every rank maps it.
    Synthetic text when there is no text file."""
    config = DataConfig(path=str(path), block_size=block_size)
    if env.is_local_main:
        try:
            prepare_corpus(config)
        except DataError as error:
            if path.is_file():
                raise  # the text is there but unusable: the user's to fix, not to paper over
            print(f"WARNING: {error}", file=sys.stderr)
    barrier()
    if path.is_file():
        return open_corpus(config), config, str(path)
    print(f"WARNING: {path} not found; using SYNTHETIC random text. Throughput is comparable, "
          "losses are not.", file=sys.stderr)
    return CharDataset(synthetic_text(1_000_000, SEED), block_size), config, "SYNTHETIC random text"


def gpt_config(name: str, dropout: float | None) -> GPTConfig:
    config = GPTConfig() if name == "default" else GPTConfig(model_type=name, n_layer=None, n_head=None,
                                                             n_embd=None)
    if dropout is None:
        return config
    return replace(config, embd_pdrop=dropout, resid_pdrop=dropout, attn_pdrop=dropout)


def build_trainer(name: str, args, dataset: CharDataset, data_config: DataConfig, env: DistEnv,
                  snapshot_dir: str) -> tuple[GPT, Trainer]:
    train_set, test_set = split_dataset(dataset, data_config, SEED)
    config = replace(gpt_config(name, args.dropout), vocab_size=dataset.vocab_size,
                     block_size=dataset.block_size)
    torch.manual_seed(SEED)
    model = GPT(config)
    trainer_config = TrainerConfig(
        batch_size=args.batch_size,
        data_loader_workers=args.workers,
        use_amp=args.amp,
        amp_dtype=args.amp_dtype,
        compile=args.compile,
        distributed_method=args.method,
        # A path that never exists: the Trainer must not resume from someone's gpt_snapshot.pt.
        snapshot_path=str(Path(snapshot_dir) / f"{name}.pt"),
    )
    placed = place_model(trainer_config, OptimizerConfig(), model, env)
    trainer = Trainer(trainer_config, placed, train_set, test_set, dataset.vocab, env)
    return model, trainer


# -------------------------------------------------------------------------------------------- the steps

def batches(trainer: Trainer):
    """Endless batches from the Trainer's own DataLoader (a new epoch when one runs out)."""
    epoch = 0
    while True:
        trainer.train_loader.sampler.set_epoch(epoch)
        yield from trainer.train_loader
        epoch += 1


def next_batch(data, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return inputs_and_targets(next(data).to(device, non_blocking=True))


def timed_step(trainer: Trainer, data, device: torch.device) -> tuple[float, float, float]:
    """One _run_batch as training runs it; returns (data wait s, whole step s, loss)."""
    start = time.perf_counter()
    inputs, targets = next_batch(data, device)
    wait_for(device)  # the host-to-device copy counts as waiting for data
    loaded = time.perf_counter()
    loss = trainer._run_batch(inputs, targets)[0].item()  # .item() only returns once the step has finished
    wait_for(device)
    return loaded - start, time.perf_counter() - start, loss


class PhaseClock:
    """Seconds between consecutive laps, each taken once the device has finished."""

    def __init__(self, device: torch.device):
        self.device, self.laps, self.last = device, {}, time.perf_counter()

    def lap(self, phase: str) -> None:
        wait_for(self.device)
        now = time.perf_counter()
        self.laps[phase] = now - self.last
        self.last = now


def split_step(trainer: Trainer, data, device: torch.device, sync_gradients: bool) -> dict[str, float]:
    """One step, phase by phase. Without gradient sync it stops after the backward pass: those steps
    only measure what the backward pass costs when it reduces nothing."""
    clock = PhaseClock(device)
    inputs, targets = next_batch(data, device)
    clock.lap("data")
    trainer.optimizer.zero_grad(set_to_none=True)
    with gradient_sync(trainer.model, enabled=sync_gradients):
        loss = trainer.compute_loss(inputs, targets)
        clock.lap("forward")
        trainer.backward(loss)
        clock.lap("backward")
    if sync_gradients:
        trainer.optimizer_step()
        clock.lap("optimizer")
    return clock.laps


def step_split(trainer: Trainer, data, device: torch.device, steps: int) -> dict[str, dict[str, float]]:
    """Median ms per phase. The backward pass's own cost is measured without gradient sync; what the
    synchronised one takes beyond it is the communication it did not overlap."""
    synced = [split_step(trainer, data, device, sync_gradients=True) for _ in range(steps)]
    median = {phase: 1e3 * statistics.median(s[phase] for s in synced) for phase in synced[0]}
    if trainer.env.world_size == 1:
        median["communication"] = 0.0  # one process: nothing to reduce
    else:
        unsynced = [split_step(trainer, data, device, sync_gradients=False) for _ in range(steps)]
        backward_alone = 1e3 * statistics.median(s["backward"] for s in unsynced)
        median["communication"] = max(median["backward"] - backward_alone, 0.0)
        median["backward"] -= median["communication"]
    trainer.optimizer.zero_grad(set_to_none=True)
    total = sum(median.values())
    return {"ms": {phase: median[phase] for phase in PHASES},
            "pct": {phase: 100 * median[phase] / total for phase in PHASES}}


def summarise(name: str, model: GPT, trainer: Trainer, samples, env: DistEnv, args) -> dict:
    """Headline rates use the MEDIAN step: robust to a stray slow step on a shared machine."""
    data_s, step_s, losses = zip(*samples)
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"{name}: non-finite loss {losses}")
    tokens_per_step = args.batch_size * args.block_size  # this rank's
    mean_step, median_step = statistics.fmean(step_s), statistics.median(step_s)
    cfg = model.config
    return {
        "model": name,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
        "vocab_size": cfg.vocab_size, "block_size": cfg.block_size,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "dropout": [cfg.embd_pdrop, cfg.resid_pdrop, cfg.attn_pdrop],
        "compile": args.compile,
        "precision": str(trainer.precision),
        "flops_per_token": model.flops_per_token(),
        "tokens_per_step": tokens_per_step * env.world_size,
        "ms_per_step_median": median_step * 1e3,
        "ms_per_step_mean": mean_step * 1e3,
        "ms_per_step_min": min(step_s) * 1e3,
        "ms_per_step_max": max(step_s) * 1e3,
        "tokens_per_s": env.world_size * tokens_per_step / median_step,
        "tokens_per_s_mean": env.world_size * tokens_per_step / mean_step,
        "tokens_per_s_per_rank": tokens_per_step / median_step,
        "tokens_per_s_per_rank_mean": tokens_per_step / mean_step,
        "data_wait_pct": 100 * sum(data_s) / sum(step_s),
        "achieved_tflops": model.flops_per_token() * tokens_per_step / median_step / 1e12,  # per rank
        "loss_first": losses[0], "loss_last": losses[-1],
    }


def add_mfu(result: dict, peak: dict[str, dict]) -> None:
    """MFU as the Trainer reports it (flops.model_flops_utilization: one rank's tokens/s over its
    device's peak), against each peak, the precision in use first; and the same for the Linear
    matmuls alone, as they ran inside the steps (the ceiling of MFU: a step also has everything else
    to do)."""
    def mfu(tokens_per_s: float, p: dict) -> float:
        return model_flops_utilization(tokens_per_s, result["flops_per_token"], p["gflops"] * 1e9)

    matmuls = result["matmuls"]["gflops"]
    result["mfu"] = {key: mfu(result["tokens_per_s_per_rank"], p) for key, p in peak.items()}
    result["mfu_mean_step"] = {key: mfu(result["tokens_per_s_per_rank_mean"], p) for key, p in peak.items()}
    result["matmul_efficiency"] = {key: matmuls / p["gflops"] for key, p in peak.items()}


# ---------------------------------------------------------------------------------------------- profile

def profile_steps(trainer: Trainer, data, device: torch.device, steps: int):
    """Op times over a few steps. record_shapes stays off: here it made the elementwise ops of the
    model several times slower, which would blame them for time they do not take."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            timed_step(trainer, data, device)
    return prof.key_averages()


LINEAR_MATMULS = ("aten::mm", "aten::addmm")  # attention's are bmm and baddbmm

# Buckets for the self time of aten ops, checked in order, so that the profile says what MFU is lost to.
# In this model only attention runs batched matmuls (bmm, baddbmm), so they count as attention;
# "matmul" is then the Linear layers. Dropout's mask is random_ and ge on the CPU (common/tensor_ops.keep_mask),
# bernoulli_ inside F.dropout elsewhere. Anything not listed (copies, adds, bias-gradient sums, the
# mask multiplies, autograd bookkeeping) is "other".
OP_CATEGORIES = (
    ("attention", ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::bmm", "aten::baddbmm",
                   "aten::_softmax", "aten::_safe_softmax")),
    ("matmul (Linear)", LINEAR_MATMULS),
    ("gelu", ("aten::gelu",)),  # before the dropout mask's aten::ge, which would match it
    ("dropout mask", ("aten::random_", "aten::ge", "aten::bernoulli_", "aten::native_dropout")),
    ("layernorm", ("aten::native_layer_norm",)),
    ("cross-entropy", ("aten::_log_softmax", "aten::nll_loss")),
    ("optimizer + clip", ("aten::_fused_adamw", "aten::_foreach_", "aten::linalg_vector_norm")),
    ("embedding", ("aten::embedding",)),
)


def category(op: str) -> str:
    return next((name for name, prefixes in OP_CATEGORIES if op.startswith(prefixes)), "other")


def linear_matmuls(averages, model: GPT, rows: int, steps: int, device: torch.device) -> dict:
    """How fast the Linear layers' matmuls (forward, input and weight gradients) ran inside the steps,
    and their share of the step. On a GPU their kernels' device time, on the CPU the ops' own time."""
    def seconds(event) -> float:
        return (event.device_time_total if device.type == "cuda" else event.self_cpu_time_total) / 1e6

    matmul_s = sum(seconds(e) for e in averages if e.key in LINEAR_MATMULS) / steps
    step_s = sum(e.self_cpu_time_total for e in averages) / 1e6 / steps
    flops = 6 * rows * model.matmul_weights()
    return {"ms_per_step": matmul_s * 1e3, "gflops": flops / matmul_s / 1e9,
            "pct_of_step": 100 * matmul_s / step_s if device.type == "cpu" else None}


def print_profile(averages, device: torch.device, args) -> dict:
    """The ops that take the most time, and time by category: what MFU is lost to."""
    sort_keys = ["self_cpu_time_total"] + (["self_device_time_total"] if device.type == "cuda" else [])
    for key in sort_keys:
        print(f"\nTop {args.profile_top} ops by {key} over {args.profile_steps} steps:")
        print(averages.table(sort_by=key, row_limit=args.profile_top, max_name_column_width=48))
    return {"top_ops": top_ops(averages, args), "self_cpu_by_category": by_category(averages, args)}


def top_ops(averages, args) -> list[dict]:
    total = sum(e.self_cpu_time_total for e in averages) or 1
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.profile_top]
    return [{"op": e.key, "calls_per_step": e.count / args.profile_steps,
             "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / args.profile_steps,
             "self_cpu_pct": 100 * e.self_cpu_time_total / total,
             "self_device_ms_per_step": e.self_device_time_total / 1e3 / args.profile_steps}
            for e in top]


def by_category(averages, args) -> dict[str, dict]:
    """Self CPU time per OP_CATEGORIES bucket (on CUDA: the host's time, launch overhead included)."""
    ms: Counter = Counter()
    for e in averages:
        ms[category(e.key)] += e.self_cpu_time_total / 1e3 / args.profile_steps
    total = sum(ms.values()) or 1
    ranked = ms.most_common()
    print("Self CPU time by category (ms/step, share): "
          + ", ".join(f"{name} {t:.1f} ({100 * t / total:.1f}%)" for name, t in ranked))
    return {name: {"ms_per_step": t, "pct": 100 * t / total} for name, t in ranked}


# ---------------------------------------------------------------------------------------------- reports

# Past these, something else was using the cores: the figures are pessimistic and say so.
LOW_CPU_SHARE = 0.9
BUSY_OTHER_CORES = 0.15


def cpu_note(cpu: dict | None) -> str:
    if not cpu:
        return ""
    note = f"  [cpu share {cpu['cpu_share']:.2f}, other processes {cpu['other_cores']:.2f} cores]"
    if cpu["cpu_share"] < LOW_CPU_SHARE or cpu["other_cores"] > BUSY_OTHER_CORES:
        note += " NOISY: other processes competed for these cores; rerun on a quiet machine"
    return note


def print_peaks(peak: dict[str, dict], threads: int, device: torch.device) -> None:
    for key, p in peak.items():
        sizes = ", ".join(f"{n}: {g:.1f}" for n, g in p.get("gflops_by_size", {}).items())
        where = f"{threads} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
        print(f"peak {key} matmul ({where}, {p['source']}): {p['gflops']:.1f} GFLOP/s"
              + (f"  [by size {sizes}]" if sizes else "") + cpu_note(p.get("cpu")))


def print_result(r: dict) -> None:
    mfu = "  ".join(f"MFU({k}) {v * 100:.1f}%" for k, v in r.get("mfu", {}).items())
    matmuls = r["matmuls"]
    efficiency = ", ".join(f"{share * 100:.1f}% of the {key} peak"
                           for key, share in r.get("matmul_efficiency", {}).items())
    share = "" if matmuls["pct_of_step"] is None else f", {matmuls['pct_of_step']:.1f}% of the step"
    split = r["split"]
    print(f"{r['model']} ({r['n_layer']}L/{r['n_head']}H/{r['n_embd']}C, {r['params_m']:.2f}M params, "
          f"{r['flops_per_token'] / 1e6:.1f} MFLOP/token, {r['precision']}, dropout {max(r['dropout'])}"
          f"{', compiled' if r['compile'] else ''})\n"
          f"    {r['tokens_per_s']:,.0f} tok/s  {r['ms_per_step_median']:.1f} ms/step median "
          f"(mean {r['ms_per_step_mean']:.1f}, min {r['ms_per_step_min']:.1f}, "
          f"max {r['ms_per_step_max']:.1f})  data wait {r['data_wait_pct']:.2f}%\n"
          f"    split: " + ", ".join(f"{phase} {split['ms'][phase]:.1f} ms ({split['pct'][phase]:.1f}%)"
                                     for phase in PHASES) + "\n"
          f"    {r['achieved_tflops'] * 1e3:.1f} GFLOP/s  {mfu}\n"
          f"    Linear matmuls in the step: {matmuls['gflops']:.1f} GFLOP/s, {efficiency}{share}\n"
          f"    memory: peak {r['peak_memory_mb']:,.0f} MB, parameters + gradients + AdamW "
          f"{r['state_mb']:,.0f} MB  loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}"
          + cpu_note(r["cpu"]))


def environment(args, env: DistEnv, data_source: str) -> dict:
    device = env.device
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "device_type": device.type,
        "world_size": env.world_size, "method": args.method,
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size, "block_size": args.block_size,
        "warmup": args.warmup, "steps": args.steps, "split_steps": args.split_steps, "workers": args.workers,
        "amp": args.amp, "amp_dtype": args.amp_dtype if args.amp else None,
        "data": data_source, "synthetic_data": data_source.startswith("SYNTHETIC"),
    }


# ------------------------------------------------------------------------------------------------- main

def bench_model(name: str, args, dataset, data_config, env: DistEnv, snapshot_dir: str) -> dict:
    model, trainer = build_trainer(name, args, dataset, data_config, env, snapshot_dir)
    data = batches(trainer)
    for _ in range(args.warmup):
        timed_step(trainer, data, env.device)
    reset_peak_memory(env.device)
    with CpuMonitor(args.threads, env.world_size - 1) as monitor:
        samples = [timed_step(trainer, data, env.device) for _ in range(args.steps)]
    result = summarise(name, model, trainer, samples, env, args)
    result["cpu"] = monitor.as_dict() if env.device.type == "cpu" else None
    result["peak_memory_mb"] = peak_memory(env.device) / 1e6
    result["state_mb"] = held_state_bytes(trainer) / 1e6
    result["split"] = step_split(trainer, data, env.device, args.split_steps)
    averages = profile_steps(trainer, data, env.device, args.profile_steps)
    result["matmuls"] = linear_matmuls(averages, model, args.batch_size * args.block_size,
                                       args.profile_steps, env.device)
    if args.profile:
        result["profile"] = print_profile(averages, env.device, args)
    return result


def run(args, env: DistEnv, snapshot_dir: str) -> None:
    configure_logging(env.rank)
    log.setLevel(logging.WARNING)  # keep the Trainer's warnings (e.g. AMP ignored), not its chatter
    if args.vocab_size:
        dataset = CharDataset(synthetic_text(2_000_000, SEED, args.vocab_size), args.block_size)
        data_config = DataConfig(block_size=args.block_size)
        source = f"SYNTHETIC text of {args.vocab_size:,} characters"
    else:
        dataset, data_config, source = load_data(args.data, args.block_size, env)
    print(f"data: {source} ({dataset.num_chars:,} chars, vocab {dataset.vocab_size}); {env.world_size} "
          f"x {env.device}, {torch.get_num_threads()} threads each, batch {args.batch_size} x "
          f"{args.block_size} tokens per rank, {args.warmup} warmup + {args.steps} timed + "
          f"{args.split_steps} split steps")
    peak = peaks(env, args)
    print_peaks(peak, args.threads, env.device)
    results = [bench_model(name, args, dataset, data_config, env, snapshot_dir) for name in args.models]
    if env.device.type == "cpu":
        again = peaks(env, args)
        print("peak measured again after the models (MFU uses the better of the two):")
        print_peaks(again, args.threads, env.device)
        peak = best_of(peak, again)
    print("\nsummary:")
    for result in results:
        add_mfu(result, peak)
        print_result(result)
    if env.is_main:
        report = {"environment": environment(args, env, source), "peak": peak, "results": results}
        save_json(args.json, report)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # before any work, so the peak and the steps use the same count
    with distributed_session() as env, tempfile.TemporaryDirectory() as snapshot_dir:
        with open(os.devnull, "w") as devnull:
            with contextlib.redirect_stdout(sys.stdout if env.is_main else devnull):  # rank 0 reports
                run(args, env, snapshot_dir)


if __name__ == "__main__":
    main()
