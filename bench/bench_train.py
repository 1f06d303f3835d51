"""Training-step throughput and MFU of minGPT, built through the project's own code.

For each model the benchmark builds the GPT, the Trainer (in a world-of-one process group) and the
Trainer's real DataLoader over real text, then times warmup + measured calls of
`trainer.train_step(x, y)`. It reports tokens/s, ms/step, the share of each step spent waiting for
data, achieved TFLOP/s from `model.flops_per_token()`, and MFU against a peak measured on this
machine at the same thread count (CPU) or the GPU's dense bf16 datasheet peak (CUDA).

Rates use the median step (the mean is in the JSON too). On CPU the peak is measured before and after
the models and the better one kept, and every measurement says how much of the machine it had: on a
shared machine a busy neighbour can halve the figures, and the output flags that as NOISY. Load from
outside this machine (other VMs on the host) cannot be seen from inside: repeat a run to gauge it.

Examples (from the repository root):

    .venv/bin/python bench/bench_train.py                          # default model and gpt-mini, fp32
    .venv/bin/python bench/bench_train.py --models default --profile
    .venv/bin/python bench/bench_train.py --amp --steps 50         # bf16 autocast, MFU vs both peaks
    .venv/bin/python bench/bench_train.py --threads 1 --batch-size 16 --json /tmp/train.json
    .venv/bin/python bench/bench_train.py --dropout 0 --compile --warmup 5   # what dropout and eager cost

This is a benchmark, not a test: it asserts nothing beyond a finite loss.
"""
import argparse
import json
import logging
import math
import os
import platform
import statistics
import string
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "mingpt"))  # the project uses flat imports (`from model import GPT`)

from char_dataset import CharDataset, DataConfig, read_text, split_dataset  # noqa: E402
from flops import gpu_peak_flops  # noqa: E402
from logger import configure_logging, log  # noqa: E402
from model import GPT, PRESETS, GPTConfig, OptimizerConfig  # noqa: E402
from precision import cpu_has_native_bf16  # noqa: E402
from process_group import DistEnv, distributed_session  # noqa: E402
from trainer import Trainer, TrainerConfig  # noqa: E402

DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "train.json"
SEED = 1337

CPU_PEAK_SIZES = (1024, 2048, 3072)  # square matmuls; the best of them is the peak
GPU_PEAK_SIZE = 8192


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time minGPT training steps (Trainer.train_step over the real DataLoader) and "
                    "report tokens/s, ms/step, data wait, TFLOP/s and MFU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--models", nargs="+", default=["default", "gpt-mini"], metavar="MODEL",
                   choices=["default", *PRESETS],
                   help="'default' is GPTConfig() (8 layers, 8 heads, 512 wide); or a preset of "
                        f"model.PRESETS: {', '.join(PRESETS)}")
    p.add_argument("--batch-size", type=int, default=8, help="samples per step")
    p.add_argument("--block-size", type=int, default=128, help="tokens per sample")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (allocator, worker start-up)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for compute and the peak")
    p.add_argument("--workers", type=int, default=1, help="TrainerConfig.data_loader_workers")
    p.add_argument("--amp", action="store_true", help="TrainerConfig.use_amp (bf16 autocast on CPU)")
    p.add_argument("--dropout", type=float, default=None,
                   help="set GPTConfig embd_pdrop, resid_pdrop and attn_pdrop (default: GPTConfig's own)")
    p.add_argument("--compile", action="store_true",
                   help="TrainerConfig.compile (torch.compile); raise --warmup to cover the compilation")
    p.add_argument("--amp-dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="TrainerConfig.amp_dtype with --amp on CUDA (CPUs always use bf16)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="UTF-8 text file; synthetic text is generated (and flagged) when it is missing")
    p.add_argument("--profile", action="store_true",
                   help="also run torch.profiler over a few steps of each model and print the top ops")
    p.add_argument("--profile-steps", type=int, default=3, help="steps recorded by --profile")
    p.add_argument("--profile-top", type=int, default=15, help="ops listed by --profile")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the figures")
    args = p.parse_args(argv)
    for name in ("batch_size", "block_size", "steps", "threads", "profile_steps", "profile_top"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0 or args.workers < 0:
        p.error("--warmup and --workers must not be negative")
    return args


# ---------------------------------------------------------------------------------------------- timing

def sync(device: torch.device) -> None:
    """CUDA runs asynchronously: wait for queued kernels before reading the clock. CPU ops are synchronous."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine_busy_seconds() -> float:
    """CPU seconds all processes have used since boot (Linux /proc/stat); NaN elsewhere."""
    try:
        with open("/proc/stat") as f:
            jiffies = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return math.nan
    idle = jiffies[3] + jiffies[4]  # idle and iowait
    return (sum(jiffies) - idle) / os.sysconf("SC_CLK_TCK")


class CpuMonitor:
    """Was this block alone on the machine? Timings on a shared CPU are only as good as that.

    share: CPU time this process got / (wall time x threads). About 1.0 when its compute threads
    were never preempted (idle OpenMP threads spin, so waits count too).
    others: cores that other processes used meanwhile, on average (the DataLoader workers count
    here; they use a few percent of one core).
    """

    def __init__(self, threads: int):
        self.threads = threads
        self.share = self.others = math.nan

    def __enter__(self) -> "CpuMonitor":
        self.wall, self.cpu, self.busy = time.perf_counter(), time.process_time(), machine_busy_seconds()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.wall
        cpu = time.process_time() - self.cpu
        self.share = cpu / (wall * self.threads)
        self.others = max(machine_busy_seconds() - self.busy - cpu, 0.0) / wall

    def as_dict(self) -> dict:
        return {"cpu_share": self.share, "other_cores": self.others}


def best_matmul_seconds(n: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(2):  # first calls pay for MKL/cuBLAS setup and page faults
        torch.mm(a, b)
    sync(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measured_peak(dtype: torch.dtype, device: torch.device, sizes: tuple[int, ...]) -> dict:
    """Best-of-repeats GFLOP/s of square matmuls of each size; the best size is the peak."""
    by_size = {}
    with CpuMonitor(torch.get_num_threads()) as monitor:
        for n in sizes:
            seconds = best_matmul_seconds(n, dtype, device, repeats=5 if device.type == "cpu" else 20)
            by_size[n] = 2 * n**3 / seconds / 1e9
    return {"dtype": str(dtype).removeprefix("torch."), "gflops_by_size": by_size,
            "gflops": max(by_size.values()), "source": "measured",
            "cpu": monitor.as_dict() if device.type == "cpu" else None}


def gpu_table_peak(device: torch.device) -> dict | None:
    """The dense bf16 datasheet peak from the project's table (flops.py: H100 SXM/H200 989 TFLOP/s,
    H100 PCIe 756, A100 312, ...), the figure the trainer's own MFU uses; None for a GPU not in it."""
    flops = gpu_peak_flops(device)
    if flops is None:
        return None
    return {"dtype": "bfloat16", "gflops": flops / 1e9, "source": "datasheet, dense"}


def best_of(first: dict[str, dict], second: dict[str, dict]) -> dict[str, dict]:
    """Per dtype, the higher of two peak measurements: a busy moment on a shared machine can only
    lower a peak, so measuring before and after the models and keeping the best guards against one."""
    return {key: max(first[key], second[key], key=lambda p: p["gflops"]) for key in first}


def peaks(device: torch.device, amp: bool) -> dict[str, dict]:
    """The peaks MFU is quoted against: name -> {"gflops": ..., ...}. The first one is the headline."""
    if device.type == "cuda":
        return {"bf16": gpu_table_peak(device) or measured_peak(torch.bfloat16, device, (GPU_PEAK_SIZE,))}
    # fp32 is what the default run computes in; bf16 is only a fair yardstick when autocast is on,
    # and only where the CPU has bf16 (elsewhere the Trainer trains in fp32, and emulated bf16
    # matmuls of these sizes would take minutes).
    result = {"fp32": measured_peak(torch.float32, device, CPU_PEAK_SIZES)}
    if amp and cpu_has_native_bf16():
        result["bf16"] = measured_peak(torch.bfloat16, device, CPU_PEAK_SIZES)
    return result


# ------------------------------------------------------------------------------------------------ data

def synthetic_text(n_chars: int = 1_000_000) -> str:
    """Seeded pseudo-words over a Shakespeare-sized alphabet (about 65 symbols), so the vocab,
    and with it the output layer's cost, is about what the real corpus gives."""
    alphabet = string.ascii_letters + " .,;:!?'-&$3\n"
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(len(alphabet), (n_chars,), generator=g).tolist()
    return "".join(alphabet[i] for i in ids)


def load_data(path: Path, block_size: int) -> tuple[CharDataset, DataConfig, str]:
    """The project's dataset over the text at path, or over synthetic text when there is none."""
    config = DataConfig(path=str(path), block_size=block_size)
    if path.is_file():
        return CharDataset(read_text(config), block_size), config, str(path)
    print(f"WARNING: {path} not found; using SYNTHETIC random text. Throughput is comparable, "
          "losses are not.", file=sys.stderr)
    return CharDataset(synthetic_text(), block_size), config, "SYNTHETIC random text"


# ----------------------------------------------------------------------------------------------- model

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
    # compile is passed only when asked for, so the default run needs nothing newer than the Trainer.
    extra = {"compile": True} if args.compile else {}
    trainer_config = TrainerConfig(
        batch_size=args.batch_size,
        data_loader_workers=args.workers,
        use_amp=args.amp,
        amp_dtype=args.amp_dtype,
        # A path that never exists: the Trainer must not resume from someone's gpt_snapshot.pt.
        snapshot_path=str(Path(snapshot_dir) / f"{name}.pt"),
        **extra,
    )
    trainer = Trainer(trainer_config, model, OptimizerConfig(), train_set, test_set, dataset.vocab, env)
    return model, trainer


# ------------------------------------------------------------------------------------------- the steps

def batches(trainer: Trainer):
    """Endless batches from the Trainer's own DataLoader (a new epoch when one runs out)."""
    epoch = 0
    while True:
        trainer.train_loader.sampler.set_epoch(epoch)
        yield from trainer.train_loader
        epoch += 1


def timed_step(trainer: Trainer, data, device: torch.device) -> tuple[float, float, float]:
    """One train_step; returns (data wait s, whole step s, loss)."""
    start = time.perf_counter()
    inputs, targets = (t.to(device, non_blocking=True) for t in next(data))
    sync(device)  # the host-to-device copy counts as waiting for data
    loaded = time.perf_counter()
    loss = trainer.train_step(inputs, targets).item()  # .item() only returns once the step has finished
    sync(device)
    return loaded - start, time.perf_counter() - start, loss


def run_steps(trainer: Trainer, data, device: torch.device, n: int) -> list[tuple[float, float, float]]:
    return [timed_step(trainer, data, device) for _ in range(n)]


def summarise(name: str, model: GPT, trainer: Trainer, samples, cpu: dict | None, args) -> dict:
    """The figures of one model. Headline rates use the MEDIAN step: robust to a stray slow step on a
    shared machine; the mean is kept alongside."""
    data_s = [s[0] for s in samples]
    step_s = [s[1] for s in samples]
    losses = [s[2] for s in samples]
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"{name}: non-finite loss {losses}")
    tokens_per_step = args.batch_size * args.block_size
    flops_per_token = model.flops_per_token()
    mean_step, median_step = statistics.fmean(step_s), statistics.median(step_s)
    achieved_gflops = flops_per_token * tokens_per_step / median_step / 1e9
    cfg = model.config
    return {
        "model": name,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
        "vocab_size": cfg.vocab_size, "block_size": cfg.block_size,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "dropout": [cfg.embd_pdrop, cfg.resid_pdrop, cfg.attn_pdrop],
        "compile": args.compile,
        "precision": str(trainer.precision),
        "flops_per_token": flops_per_token,
        "tokens_per_step": tokens_per_step,
        "ms_per_step_median": median_step * 1e3,
        "ms_per_step_mean": mean_step * 1e3,
        "ms_per_step_min": min(step_s) * 1e3,
        "ms_per_step_max": max(step_s) * 1e3,
        "tokens_per_s": tokens_per_step / median_step,
        "tokens_per_s_mean": tokens_per_step / mean_step,
        "data_wait_ms_mean": statistics.fmean(data_s) * 1e3,
        "data_wait_pct": 100 * sum(data_s) / sum(step_s),
        "achieved_tflops": achieved_gflops / 1e3,
        "cpu": cpu,
        "loss_first": losses[0], "loss_last": losses[-1],
    }


def add_mfu(result: dict, peak: dict[str, dict]) -> None:
    """MFU = achieved / peak, against each peak measured (fp32, and bf16 with --amp on CPU)."""
    achieved = result["achieved_tflops"] * 1e3
    slowdown = result["ms_per_step_median"] / result["ms_per_step_mean"]
    result["mfu"] = {key: achieved / p["gflops"] for key, p in peak.items()}
    result["mfu_mean_step"] = {key: achieved * slowdown / p["gflops"] for key, p in peak.items()}


# --------------------------------------------------------------------------------------------- profile

# Buckets for the self time of aten ops, checked in order, so that the profile says what MFU is lost to.
# In this model only attention runs batched matmuls (bmm: SDPA's unfused path, taken with attention
# dropout), so they count as attention; "matmul" is then the Linear layers. Anything not listed
# (copies, adds, bias-gradient sums, the mask multiply of dropout, autograd bookkeeping) is "other".
OP_CATEGORIES = (
    ("attention", ("aten::_scaled_dot_product", "aten::bmm", "aten::baddbmm", "aten::_softmax",
                   "aten::_safe_softmax")),
    ("matmul (Linear)", ("aten::mm", "aten::addmm")),
    ("dropout RNG", ("aten::bernoulli_", "aten::native_dropout")),
    ("gelu", ("aten::gelu",)),
    ("layernorm", ("aten::native_layer_norm",)),
    ("cross-entropy", ("aten::_log_softmax", "aten::nll_loss")),
    ("optimizer + clip", ("aten::_fused_adamw", "aten::_foreach_", "aten::linalg_vector_norm")),
    ("embedding", ("aten::embedding",)),
)


def category(op: str) -> str:
    return next((name for name, prefixes in OP_CATEGORIES if op.startswith(prefixes)), "other")


def profile_steps(trainer: Trainer, data, device: torch.device, args) -> dict:
    """Record a few steps and print the ops that take the most self time: what MFU is lost to.

    record_shapes stays off: here it made the elementwise ops of the model several times slower,
    which would blame them for time they do not take.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with CpuMonitor(args.threads) as monitor, profile(activities=activities) as prof:
        run_steps(trainer, data, device, args.profile_steps)
    cpu = monitor.as_dict() if device.type == "cpu" else None
    averages = prof.key_averages()
    sort_keys = ["self_cpu_time_total"] + (["self_device_time_total"] if device.type == "cuda" else [])
    for key in sort_keys:
        print(f"\nTop {args.profile_top} ops by {key} over {args.profile_steps} steps:{cpu_note(cpu)}")
        print(averages.table(sort_by=key, row_limit=args.profile_top, max_name_column_width=48))
    return {"top_ops": top_ops(averages, args), "self_cpu_by_category": by_category(averages, args),
            "cpu": cpu}


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
    ms: dict[str, float] = {}
    for e in averages:
        ms[category(e.key)] = ms.get(category(e.key), 0.0) + e.self_cpu_time_total / 1e3 / args.profile_steps
    total = sum(ms.values()) or 1
    ranked = sorted(ms.items(), key=lambda kv: kv[1], reverse=True)
    print("Self CPU time by category (ms/step, share): "
          + ", ".join(f"{name} {t:.1f} ({100 * t / total:.1f}%)" for name, t in ranked))
    return {name: {"ms_per_step": t, "pct": 100 * t / total} for name, t in ranked}


# --------------------------------------------------------------------------------------------- reports

# Past these, something else was using the cores: the figures are pessimistic and say so.
LOW_CPU_SHARE = 0.9
BUSY_OTHER_CORES = 0.15


def cpu_note(cpu: dict | None) -> str:
    if cpu is None:
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
    print(f"{r['model']} ({r['n_layer']}L/{r['n_head']}H/{r['n_embd']}C, {r['params_m']:.2f}M params, "
          f"{r['flops_per_token'] / 1e6:.1f} MFLOP/token, {r['precision']}, dropout {max(r['dropout'])}"
          f"{', compiled' if r['compile'] else ''})\n"
          f"    {r['tokens_per_s']:,.0f} tok/s  {r['ms_per_step_median']:.1f} ms/step median "
          f"(mean {r['ms_per_step_mean']:.1f}, min {r['ms_per_step_min']:.1f}, "
          f"max {r['ms_per_step_max']:.1f})  data wait {r['data_wait_pct']:.2f}%\n"
          f"    {r['achieved_tflops'] * 1e3:.1f} GFLOP/s  {mfu}  "
          f"loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}" + cpu_note(r["cpu"]))


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux); platform.processor() is often empty."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(args, env: DistEnv, data_source: str) -> dict:
    device = env.device
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "device_type": device.type,
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size, "block_size": args.block_size,
        "warmup": args.warmup, "steps": args.steps, "workers": args.workers,
        "amp": args.amp, "amp_dtype": args.amp_dtype if args.amp else None,
        "data": data_source, "synthetic_data": data_source.startswith("SYNTHETIC"),
    }


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}")


# ------------------------------------------------------------------------------------------------ main

def bench_model(name: str, args, dataset, data_config, env, snapshot_dir) -> dict:
    model, trainer = build_trainer(name, args, dataset, data_config, env, snapshot_dir)
    model.train()
    data = batches(trainer)
    run_steps(trainer, data, env.device, args.warmup)
    with CpuMonitor(args.threads) as monitor:
        samples = run_steps(trainer, data, env.device, args.steps)
    cpu = monitor.as_dict() if env.device.type == "cpu" else None
    result = summarise(name, model, trainer, samples, cpu, args)
    print_result(result)
    if args.profile:
        result["profile"] = profile_steps(trainer, data, env.device, args)
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # before any work, so the peak and the steps use the same count
    with distributed_session() as env, tempfile.TemporaryDirectory() as snapshot_dir:
        configure_logging(env.rank)
        log.setLevel(logging.WARNING)  # keep the Trainer's warnings (e.g. AMP ignored), not its chatter
        dataset, data_config, source = load_data(args.data, args.block_size)
        print(f"data: {source} ({len(dataset.data):,} chars, vocab {dataset.vocab_size}); device "
              f"{env.device}, {torch.get_num_threads()} threads, batch {args.batch_size} x "
              f"{args.block_size} tokens, {args.warmup} warmup + {args.steps} timed steps")
        peak = peaks(env.device, args.amp)
        print_peaks(peak, args.threads, env.device)
        results = [bench_model(name, args, dataset, data_config, env, snapshot_dir) for name in args.models]
        if env.device.type == "cpu":
            again = peaks(env.device, args.amp)
            print("peak measured again after the models (MFU uses the better of the two):")
            print_peaks(again, args.threads, env.device)
            peak = best_of(peak, again)
        print("\nsummary:")
        for result in results:
            add_mfu(result, peak)
            print_result(result)
        write_json(args.json, {"environment": environment(args, env, source), "peak": peak,
                               "results": results})


if __name__ == "__main__":
    main()
