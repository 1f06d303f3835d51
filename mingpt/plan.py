"""Plan a run before launching it: memory per device, communication, step time, and which method.

    python plan.py [overrides] --nodes 1 --gpus-per-node 4 --device V100 --memory-gb 16
    python mingpt/plan.py gpt_config.model_type=gpt2-xl gpt_config.n_layer=null gpt_config.n_head=null \\
        gpt_config.n_embd=null --nodes 8 --gpus-per-node 8 --device H100 --inter-gbps 400

It reads the same config and overrides as main.py (Hydra composes gpt2_train_cfg.yaml; the data's
vocabulary sizes the model, as for training), so it plans the run main.py would start, on the
cluster described by the options. For each method that applies (ddp; fsdp on more than one
device; hsdp on more than one node), with and without activation checkpointing (and with CPU
offload where the sharded method does not fit on a GPU without it), one row: memory per device
(distributed/memory.py: parameters, gradients, AdamW state, activations traced from the
project's own step, buffers), whether it fits, bytes moved per step within and across nodes and
their time, compute time at the stated utilisation (--mfu), the communication left exposed after
overlap, step time, tokens/s and scaling efficiency. Then a recommendation: the fastest setting
that fits, with the gradient accumulation that brings scaling efficiency to --efficiency, and why.

The communication model (distributed/step_time.py), per rank and step, P parameters:
- ring all-reduce of S bytes over n ranks: 2 (n-1) latency steps + 2 (n-1)/n x S / bandwidth;
  all-gather and reduce-scatter (S the gathered size): half of that;
- over N nodes of G ranks, hierarchical: the intra-node part over G ranks at each rank's
  --intra-gbps, plus the inter-node part over N nodes at the node's --inter-gbps, which its G ranks
  share (a node sends 2 (N-1)/N x S for an all-reduce, (N-1)/N x S for a gather or scatter);
- ddp: all-reduce of 4P bytes of fp32 gradients per optimizer step, overlapped with the backward
  pass except what outlasts it (at least the last 25 MB bucket);
- fsdp: all-gather of the parameters in the compute dtype twice per micro-batch (forward and
  backward; once with reshard_after_forward=False) and reduce-scatter of 4P bytes per optimizer
  step, over all ranks, prefetched one block ahead: exposed is what outlasts the compute, at least
  one block's share (CPU ranks: the reduce-scatter is synchronous);
- hsdp: fsdp's collectives within each node, plus an all-reduce of each rank's 4P/G gradient shard
  across nodes, overlapped with the backward pass as ddp's.
Compute: 6 FLOPs per weight per token plus causal attention, and a second forward pass of the
blocks with activation checkpointing, at --mfu of the device's peak in the run's precision.
Where the model stops holding: see the README ("DDP or FSDP").
"""
import argparse
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from mingpt.char_dataset import open_corpus, prepare_corpus
from mingpt.distributed.activation_checkpointing import CHECKPOINTING_MODES
from mingpt.distributed.memory import (
    MemoryEstimate,
    Placement,
    estimate_memory,
    fits_in,
    gb,
    host_memory_available,
    largest_batch,
    model_sizes,
)
from mingpt.distributed.precision import AMP_DTYPES, cpu_has_native_bf16
from mingpt.distributed.step_time import (
    Cluster,
    StepTime,
    StepWork,
    accumulation_for,
    recompute_flops_per_token,
    step_time,
)
from mingpt.model import GPT, GPTConfig
from mingpt.reporting.errors import MinGPTError, OneLineArgumentParser, check, command
from mingpt.reporting.flops import GPU_PEAKS, cpu_peak_flops

CONFIG_DIR = Path(__file__).resolve().parent
GPU_RESERVE = 10**9
"""Bytes of a GPU's memory that training cannot use: the CUDA context, NCCL's buffers."""
DEVICES = {peaks.name.replace(" ", "-"): peaks for peaks in GPU_PEAKS}
CPU_DEVICE = "cpu"


@dataclass
class ClusterOptions:
    """The cluster as the command line gives it, checked before anything else runs."""

    nodes: int = 1
    gpus_per_node: int = 1
    device: str = "H100"
    memory_gb: Optional[float] = None
    peak_tflops: Optional[float] = None
    intra_gbps: float = 1600.0
    inter_gbps: float = 100.0
    intra_latency_us: float = 10.0
    inter_latency_us: float = 20.0
    mfu: float = 0.4
    efficiency: float = 0.9

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            check(value > 0, _flag(name), f"must be a positive number of {name.split('_')[0]}, got {value}")
        for name in ("intra_gbps", "inter_gbps", "memory_gb", "peak_tflops"):
            value = getattr(self, name)
            check(value is None or value > 0, _flag(name), f"must be positive, got {value}")
        for name in ("intra_latency_us", "inter_latency_us"):
            check(getattr(self, name) >= 0, _flag(name), f"must not be negative, got {getattr(self, name)}")
        check(0 < self.mfu <= 1, "--mfu", f"is a share of the peak, in (0, 1]; got {self.mfu}")
        check(0 < self.efficiency <= 1, "--efficiency", f"is a share, in (0, 1]; got {self.efficiency}")
        known = self.device == CPU_DEVICE or self.device in DEVICES
        given = self.memory_gb is not None and self.peak_tflops is not None
        check(known or given, "--device", f"unknown device {self.device!r}; choose one of "
              f"{', '.join([*DEVICES, CPU_DEVICE])}, or give --memory-gb and --peak-tflops")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Row:
    """One setting of the run on the cluster: its memory and its step."""

    method: str
    checkpointing: str
    cpu_offload: bool
    memory: MemoryEstimate
    fits: bool
    timing: StepTime
    tokens_per_s: float


@dataclass(frozen=True)
class Setting:
    """The run as main.py would start it, and the cluster it would run on."""

    model: GPTConfig
    batch_size: int
    grad_accum_steps: int
    reshard_after_forward: bool
    snapshot_staging: Optional[str]
    compute_dtype: Optional[torch.dtype]
    configured_method: str
    configured_checkpointing: str
    cluster: Cluster
    efficiency: float

    def placement(self, method: str, cpu_offload: bool, grad_accum_steps: int = 0) -> Placement:
        cluster = self.cluster
        return Placement(method, cluster.world_size, cluster.ranks_per_node, cluster.device_type,
                         self.compute_dtype, cpu_offload, self.reshard_after_forward or method == "ddp",
                         grad_accum_steps or self.grad_accum_steps, self.snapshot_staging)

    def work(self, checkpointing: str, grad_accum_steps: int = 0) -> StepWork:
        flops = flops_per_token(self.model)
        head = self.model.vocab_size * self.model.n_embd
        recompute = recompute_flops_per_token(flops, head) if checkpointing == "full" else 0
        compute_bytes = self.compute_dtype.itemsize if self.compute_dtype else 4
        return StepWork(model_sizes(self.model), flops, recompute, self.batch_size * self.model.block_size,
                        compute_bytes, grad_accum_steps or self.grad_accum_steps)

    def tokens_per_step(self, grad_accum_steps: int = 0) -> int:
        steps = grad_accum_steps or self.grad_accum_steps
        return self.cluster.world_size * self.batch_size * steps * self.model.block_size


def flops_per_token(config: GPTConfig) -> int:
    """GPT.flops_per_token() of the model, built once (a large model takes a while even on meta)."""
    return _flops(config.n_layer, config.n_head, config.n_embd, config.vocab_size, config.block_size)


@lru_cache(maxsize=16)
def _flops(n_layer: int, n_head: int, n_embd: int, vocab_size: int, block_size: int) -> int:
    with torch.device("meta"):
        return GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                             block_size=block_size)).flops_per_token()


def methods_for(cluster: Cluster) -> list[str]:
    return ["ddp"] + (["fsdp"] if cluster.world_size > 1 else []) + (["hsdp"] if cluster.nodes > 1 else [])


def plan_rows(setting: Setting) -> list[Row]:
    """Every method that applies, without and with activation checkpointing; CPU offload too for
    a sharded method on GPUs when it does not fit without."""
    rows = []
    for method in methods_for(setting.cluster):
        for checkpointing in CHECKPOINTING_MODES:
            row = plan_row(setting, method, checkpointing, cpu_offload=False)
            rows.append(row)
            if method != "ddp" and setting.cluster.device_type == "cuda" and not row.fits:
                rows.append(plan_row(setting, method, checkpointing, cpu_offload=True))
    return rows


def plan_row(setting: Setting, method: str, checkpointing: str, cpu_offload: bool,
             grad_accum_steps: int = 0) -> Row:
    placement = setting.placement(method, cpu_offload, grad_accum_steps)
    memory = estimate_memory(setting.model, setting.batch_size, checkpointing, placement)
    timing = step_time(method, setting.work(checkpointing, grad_accum_steps), setting.cluster,
                       placement.reshard_after_forward, cpu_offload)
    return Row(method, checkpointing, cpu_offload, memory, memory.peak <= setting.cluster.memory, timing,
               setting.tokens_per_step(grad_accum_steps) / timing.seconds)


def table(rows: list[Row], setting: Setting) -> str:
    header = (f"{'method':<6} {'ckpt':<4} {'offload':<7} | {'params':>7} {'grads':>7} {'AdamW':>7} "
              f"{'activ':>7} {'buffers':>7} | {'peak':>7} {'fits':<4} | {'intra':>7} {'inter':>7} "
              f"{'comm s':>7} | {'compute':>7} {'exposed':>7} {'step s':>7} | {'tokens/s':>10} {'eff':>5}")
    lines = [header, "-" * len(header)]
    for row in rows:
        m, t = row.memory, row.timing
        mark = " <- configured" if (row.method, row.checkpointing, row.cpu_offload) == (
            setting.configured_method, setting.configured_checkpointing, False) else ""
        lines.append(
            f"{row.method:<6} {row.checkpointing:<4} {'yes' if row.cpu_offload else 'no':<7} | "
            f"{_gb(m.parameters)} {_gb(m.gradients)} {_gb(m.optimizer)} {_gb(m.activations)} "
            f"{_gb(m.buffers)} | "
            f"{_gb(m.peak)} {'yes' if row.fits else 'NO':<4} | {_gb(t.traffic.intra_bytes)} "
            f"{_gb(t.traffic.inter_bytes)} {t.traffic.seconds:>7.3f} | {t.compute:>7.3f} {t.exposed:>7.3f} "
            f"{t.seconds:>7.3f} | {row.tokens_per_s:>10,.0f} {100 * t.efficiency:>4.0f}%{mark}")
    return "\n".join(lines)


def _gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:>7.2f}"


@dataclass(frozen=True)
class Choice:
    """A setting that fits, at the gradient accumulation recommended for it."""

    row: Row
    """At the run's own grad_accum_steps."""
    steps: int
    reached: Row
    """At `steps` micro-batches per optimizer step."""

    def reaches(self, setting: Setting) -> bool:
        return self.reached.timing.efficiency >= setting.efficiency


def recommend(rows: list[Row], setting: Setting) -> list[str]:
    """Of the settings that fit and reach the target efficiency (each with the fewest micro-batches
    that do), the fastest; within a few percent of it, the one that changes the training recipe
    least (fewest micro-batches), then the simplest. Then why."""
    fitting = [row for row in rows if row.fits]
    if not fitting:
        return _nothing_fits(rows, setting)
    choices = [_accumulation(row, setting) for row in fitting]
    pool = [choice for choice in choices if choice.reaches(setting)] or choices
    fastest = max(choice.reached.tokens_per_s for choice in pool)
    close = [choice for choice in pool if choice.reached.tokens_per_s >= (1 - CLOSE_ENOUGH) * fastest]
    best = min(close, key=lambda choice: (choice.steps, _complexity(choice.row)))
    return [_headline(best, setting), *_reasons(best, choices, rows, setting)]


CLOSE_ENOUGH = 0.03
"""Settings this close to the fastest are as good: the simplest of them is recommended."""


def _complexity(row: Row) -> tuple:
    """ddp, then fsdp, then hsdp (a 2-D mesh); no checkpointing; no offload."""
    return (row.cpu_offload, row.checkpointing != "none", ("ddp", "fsdp", "hsdp").index(row.method))


def _accumulation(row: Row, setting: Setting) -> Choice:
    """The fewest micro-batches per step that reach the target efficiency and still fit (the row's
    own when none does)."""
    placement = setting.placement(row.method, row.cpu_offload)
    options = dict(reshard_after_forward=placement.reshard_after_forward, cpu_offload=row.cpu_offload)
    steps = accumulation_for(setting.efficiency, row.method, setting.work(row.checkpointing), setting.cluster,
                             **options)
    if steps in (0, setting.grad_accum_steps):
        return Choice(row, setting.grad_accum_steps, row)
    candidate = plan_row(setting, row.method, row.checkpointing, row.cpu_offload, steps)
    return Choice(row, steps, candidate) if candidate.fits else Choice(row, setting.grad_accum_steps, row)


def _in_words(row: Row, steps: int) -> str:
    words = [f"distributed_method={row.method}", f"activation_checkpointing={row.checkpointing}"]
    if row.cpu_offload:
        words.append("cpu_offload=True")
    words.append(f"grad_accum_steps={steps}")
    return " ".join(f"trainer_config.{word}" for word in words)


def _headline(best: Choice, setting: Setting) -> str:
    reached, memory = best.reached, setting.cluster.memory
    return (f"Recommended: {_in_words(best.row, best.steps)}: {gb(reached.memory.peak)} of {gb(memory)} "
            f"per device, {reached.tokens_per_s:,.0f} tokens/s, "
            f"scaling efficiency {100 * reached.timing.efficiency:.0f}% "
            f"(target {100 * setting.efficiency:.0f}%), {setting.tokens_per_step(best.steps):,} tokens per "
            f"step.")


def _reasons(best: Choice, choices: list[Choice], rows: list[Row], setting: Setting) -> list[str]:
    reasons = []
    for method in methods_for(setting.cluster):
        if method != best.row.method:
            same = next(row for row in rows
                        if row.method == method and row.checkpointing == best.row.checkpointing)
            choice = next((choice for choice in choices if choice.row == same), None)
            reasons.append(_why_not(same, choice, best, setting))
    kind = (best.row.method, best.row.cpu_offload)
    other = next((row for row in rows if (row.method, row.cpu_offload) == kind
                  and row.checkpointing != best.row.checkpointing), None)
    if other is not None:
        other_choice = next((choice for choice in choices if choice.row == other), None)
        reasons.append(_checkpointing_reason(best.row, other, other_choice))
    reasons.append(_communication_reason(best.row, setting))
    reasons.append(_accumulation_reason(best, setting))
    return [f"- {reason}" for reason in reasons]


def _why_not(row: Row, choice: Optional[Choice], best: Choice, setting: Setting) -> str:
    if choice is None:
        what = {"ddp": "keeps a whole copy of the parameters, gradients, AdamW state and gradient buckets "
                       "on every device",
                "fsdp": "shards the state over every device, but not the activations",
                "hsdp": "shards the state over a node's devices only"}[row.method]
        return (f"{row.method} does not fit: it {what}: {gb(row.memory.peak)} per device "
                f"(activations {gb(row.memory.activations)}) > {gb(setting.cluster.memory)}.")
    reached = choice.reached
    speed = (f"{reached.tokens_per_s:,.0f} tokens/s and {100 * reached.timing.efficiency:.0f}% efficiency "
             f"with grad_accum_steps={choice.steps}")
    if best.reaches(setting) and not choice.reaches(setting):
        verdict = f"does not reach {100 * setting.efficiency:.0f}%"
    elif reached.tokens_per_s < (1 - CLOSE_ENOUGH) * best.reached.tokens_per_s:
        verdict = "is slower"
    elif choice.steps > best.steps:
        verdict = "needs more micro-batches per step for as much"
    else:
        return (f"{row.method} fits ({gb(row.memory.peak)}) and is about as fast ({speed}); "
                f"{best.row.method} is simpler.")
    return f"{row.method} fits ({gb(row.memory.peak)}) but {verdict}: {speed}."


def _checkpointing_reason(best: Row, other: Row, other_choice: Optional[Choice]) -> str:
    if best.checkpointing == "full" and not other.fits:
        return (f"activation checkpointing is needed: without it {best.method} holds "
                f"{gb(other.memory.activations)} of activations, {gb(other.memory.peak)} in all; with it "
                f"{gb(best.memory.activations)}, for a third more block compute.")
    if best.checkpointing == "full":
        reached = other_choice.reached
        return (f"activation checkpointing is not needed to fit ({gb(other.memory.peak)} without it), but "
                f"the communication hides behind its recomputation: without it {reached.tokens_per_s:,.0f} "
                f"tokens/s and {100 * reached.timing.efficiency:.0f}% efficiency with "
                f"grad_accum_steps={other_choice.steps}.")
    return (f"activation checkpointing is not needed: it would cut activations from "
            f"{gb(best.memory.activations)} to {gb(other.memory.activations)} at the cost of a third more "
            f"block compute ({other.tokens_per_s:,.0f} tokens/s).")


def _communication_reason(best: Row, setting: Setting) -> str:
    traffic, timing = best.timing.traffic, best.timing
    across = f" and {gb(traffic.inter_bytes)} across nodes" if setting.cluster.nodes > 1 else ""
    return (f"each step moves {gb(traffic.intra_bytes)} per device within its node{across} "
            f"({traffic.seconds * 1e3:,.0f} ms), of which {timing.exposed * 1e3:,.0f} ms is not hidden "
            f"behind {timing.compute * 1e3:,.0f} ms of compute.")


def _accumulation_reason(best: Choice, setting: Setting) -> str:
    target, row, reached = f"{100 * setting.efficiency:.0f}%", best.row, best.reached
    if best.reaches(setting) and best.steps == setting.grad_accum_steps:
        return f"scaling efficiency {100 * row.timing.efficiency:.0f}% already reaches {target}."
    if best.reaches(setting):
        return (f"{best.steps} micro-batches per step (one synchronisation) bring scaling efficiency from "
                f"{100 * row.timing.efficiency:.0f}% to {100 * reached.timing.efficiency:.0f}%, at or above "
                f"{target}.")
    gathers = " (sharding gathers the parameters for every micro-batch)" if row.method != "ddp" else ""
    return (f"no gradient accumulation up to 64 micro-batches that fits reaches {target}{gathers}: "
            f"faster links, a larger batch or fewer devices would.")


def _nothing_fits(rows: list[Row], setting: Setting) -> list[str]:
    smallest = min(rows, key=lambda row: row.memory.peak)
    placement = setting.placement(smallest.method, smallest.cpu_offload)
    largest = largest_batch(setting.model, smallest.checkpointing, placement, fits_in(setting.cluster.memory),
                            below=setting.batch_size)
    fix = (f"trainer_config.batch_size={largest} fits with {_in_words(smallest, setting.grad_accum_steps)}"
           if largest else "no batch size fits: use more devices, devices with more memory, or a smaller "
           "model")
    return [f"Nothing fits in {gb(setting.cluster.memory)} per device at batch_size={setting.batch_size}: "
            f"the smallest is {smallest.method} with activation_checkpointing={smallest.checkpointing}"
            f"{' and cpu_offload' if smallest.cpu_offload else ''}, {gb(smallest.memory.peak)}. {fix}."]


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, list[str]]:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0],
                                   epilog="Anything else is a Hydra override, as for main.py.")
    defaults = ClusterOptions()
    parser.add_argument("--nodes", type=int, default=defaults.nodes)
    parser.add_argument("--gpus-per-node", type=int, default=defaults.gpus_per_node,
                        help="GPUs per node (with --device cpu: CPU ranks per node)")
    parser.add_argument("--device", default=defaults.device,
                        help=f"one of {', '.join(DEVICES)}, or cpu (ranks of this machine's CPU)")
    parser.add_argument("--memory-gb", type=float, help="memory per device in GB (default: the device's)")
    parser.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device in the run's precision")
    parser.add_argument("--intra-gbps", type=float, default=defaults.intra_gbps,
                        help="Gbit/s each device sends within its node, each way (NVLink H100: 3600)")
    parser.add_argument("--inter-gbps", type=float, default=defaults.inter_gbps,
                        help="Gbit/s a node sends to other nodes, each way, all its network cards")
    parser.add_argument("--intra-latency-us", type=float, default=defaults.intra_latency_us)
    parser.add_argument("--inter-latency-us", type=float, default=defaults.inter_latency_us)
    parser.add_argument("--mfu", type=float, default=defaults.mfu,
                        help="share of the peak the compute reaches")
    parser.add_argument("--efficiency", type=float, default=defaults.efficiency,
                        help="scaling efficiency the recommended gradient accumulation must reach")
    parser.add_argument("--vocab-size", type=int, help="the data's vocabulary size (default: read the data)")
    return parser.parse_known_args(argv)


def cluster_options(args: argparse.Namespace) -> ClusterOptions:
    return ClusterOptions(args.nodes, args.gpus_per_node, args.device, args.memory_gb, args.peak_tflops,
                          args.intra_gbps, args.inter_gbps, args.intra_latency_us, args.inter_latency_us,
                          args.mfu, args.efficiency)


def load_run_config(overrides: list[str]):
    """The typed config main.py would train with, from the same YAML and overrides."""
    from mingpt.main import load_config  # registers the config schema and the repo_path resolver

    bad = [item for item in overrides if "=" not in item]
    check(not bad, bad[0] if bad else "", "is neither an option of plan.py nor a key=value override")
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return load_config(compose("gpt2_train_cfg", overrides=overrides))
    except (HydraException, OmegaConfBaseException) as error:
        raise MinGPTError(str(error).splitlines()[0]) from None


def compute_dtype(config, device_type: str) -> Optional[torch.dtype]:
    """The low precision the run would compute in (precision.py's choice), None for fp32."""
    if not config.trainer_config.use_amp:
        return None
    if device_type == CPU_DEVICE:
        return torch.bfloat16 if cpu_has_native_bf16() else None
    return AMP_DTYPES[config.trainer_config.amp_dtype]


def build_cluster(options: ClusterOptions, dtype: Optional[torch.dtype]) -> Cluster:
    cpu = options.device == CPU_DEVICE
    peaks = DEVICES.get(options.device)
    if options.peak_tflops is not None:
        peak = options.peak_tflops * 1e12
    elif cpu:
        peak = cpu_peak_flops("bf16" if dtype == torch.bfloat16 else "fp32") / options.gpus_per_node
    else:
        name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "tf32")
        check(getattr(peaks, name) is not None, "--device", f"{options.device} has no {name} peak; "
              "give --peak-tflops, or train in another precision (trainer_config.amp_dtype)")
        peak = getattr(peaks, name) * 1e12
    if options.memory_gb is not None:
        memory = int(options.memory_gb * 1e9)
    elif cpu:
        memory = (host_memory_available() or 0) // options.gpus_per_node
    else:
        memory = int(peaks.memory_gb * 1e9)
    if not cpu:
        memory -= GPU_RESERVE
    gbit = 1e9 / 8  # bytes/s
    return Cluster(options.nodes, options.gpus_per_node, memory, peak, options.mfu, options.intra_gbps * gbit,
                   options.inter_gbps * gbit, options.intra_latency_us * 1e-6,
                   options.inter_latency_us * 1e-6, "cpu" if cpu else "cuda")


def vocab_size_of(config, given: Optional[int]) -> int:
    if given is not None:
        check(given > 0, "--vocab-size", f"must be positive, got {given}")
        return given
    prepare_corpus(config.data_config)
    return open_corpus(config.data_config).vocab_size


def make_setting(config, options: ClusterOptions, vocab_size: int) -> Setting:
    tc = config.trainer_config
    check(tc.distributed_method != "hsdp" or options.nodes > 1, "trainer_config.distributed_method",
          f"hsdp shards within a node and replicates across nodes, and --nodes is {options.nodes}; "
          "plan 2 or more nodes, or use fsdp")
    device_type = CPU_DEVICE if options.device == CPU_DEVICE else "cuda"
    dtype = compute_dtype(config, device_type)
    model = replace(config.gpt_config, vocab_size=vocab_size, block_size=config.data_config.block_size)
    return Setting(model, tc.batch_size, tc.grad_accum_steps, tc.reshard_after_forward,
                   tc.snapshot_format if tc.async_snapshots else None, dtype, tc.distributed_method,
                   tc.activation_checkpointing, build_cluster(options, dtype), options.efficiency)


def describe(setting: Setting) -> str:
    cluster, model = setting.cluster, setting.model
    precision = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[setting.compute_dtype]
    params = model_sizes(model).total
    return (f"Plan: GPT {params / 1e6:.1f}M parameters ({model.n_layer} layers, {model.n_embd} wide, block "
            f"{model.block_size}, vocabulary {model.vocab_size}), {precision}, "
            f"batch_size={setting.batch_size} x "
            f"{setting.grad_accum_steps} per device; {cluster.nodes} node(s) x {cluster.ranks_per_node} "
            f"{'CPU rank' if cluster.device_type == 'cpu' else 'GPU'}(s), {gb(cluster.memory)} usable each, "
            f"{cluster.peak_flops / 1e12:.1f} TFLOP/s peak at {100 * cluster.utilization:.0f}% utilisation, "
            f"{cluster.intra_bandwidth * 8 / 1e9:,.0f} Gb/s within and "
            f"{cluster.inter_bandwidth * 8 / 1e9:,.0f} "
            f"Gb/s across nodes. Memory in GB per device; intra/inter: GB moved per step and device.")


@command
def main(argv: Optional[list[str]] = None) -> None:
    args, overrides = parse_args(argv)
    options = cluster_options(args)
    config = load_run_config(overrides)
    setting = make_setting(config, options, vocab_size_of(config, args.vocab_size))
    rows = plan_rows(setting)
    print("\n".join([describe(setting), "", table(rows, setting), "", *recommend(rows, setting)]))


if __name__ == "__main__":
    main()
