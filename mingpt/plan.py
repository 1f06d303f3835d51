"""Plan a run before launching it: memory per device, communication, step time, and which method.

    python plan.py [overrides] --nodes 1 --gpus-per-node 4 --device V100 --memory-gb 16
    python mingpt/plan.py gpt_config.model_type=gpt2-xl gpt_config.n_layer=null gpt_config.n_head=null \\
        gpt_config.n_embd=null --nodes 8 --gpus-per-node 8 --device H100 --inter-gbps 400

It reads the same config and overrides as main.py (Hydra composes gpt2_train_cfg.yaml; the data's
vocabulary sizes the model, as for training), so it plans the run main.py would start, on the
cluster the options describe (`--help` lists them with their defaults). What it prints, and how it
chooses, is planning/advice.py's; the memory model is planning/memory.py's, the communication and
step-time model planning/step_time.py's (their docstrings state them); where the models stop
holding, docs/distributed.md.
"""
import argparse
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from mingpt.char_dataset import open_corpus, prepare_corpus
from mingpt.cluster_check import CheckedCluster, check_run
from mingpt.common.errors import OneLineArgumentParser, check, command
from mingpt.distributed.precision import AMP_DTYPES, cpu_has_native_bf16, dtype_name
from mingpt.planning.advice import Setting, describe, plan_rows, recommend, table
from mingpt.planning.check import checked_ranks
from mingpt.planning.memory import SimulatedDevice, host_memory_available
from mingpt.planning.step_time import Cluster
from mingpt.reporting.flops import GPU_PEAKS, cpu_peak_flops
from mingpt.run_config import CONFIG_NAME_HELP, DEFAULT_CONFIG, from_command_line
from mingpt.start_up import placement_of

CONFIG_DIR = Path(__file__).resolve().parent
GPU_RESERVE = 10**9
"""Bytes of a GPU's memory that training cannot use: the CUDA context, NCCL's buffers."""
DEVICES = {peaks.name.replace(" ", "-"): peaks for peaks in GPU_PEAKS}
CPU_DEVICE = "cpu"
WIDTH = 110
"""plan.py's lines wrap here (the project's line length)."""


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


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, list[str]]:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0],
                                   epilog="Anything else is a Hydra override, as for main.py.")
    defaults = ClusterOptions()
    parser.add_argument("--config-name", default=DEFAULT_CONFIG, help=CONFIG_NAME_HELP)
    parser.add_argument("--nodes", type=int, default=defaults.nodes, help="nodes (default: %(default)s)")
    parser.add_argument("--gpus-per-node", type=int, default=defaults.gpus_per_node,
                        help="GPUs per node; with --device cpu, CPU ranks per node (default: %(default)s)")
    parser.add_argument("--device", help=f"one of {', '.join(DEVICES)}, or cpu (ranks of this machine's "
                        f"CPU) (default: {defaults.device}, and the plan says it assumed it)")
    parser.add_argument("--memory-gb", type=float, help="memory per device in GB (default: the device's)")
    parser.add_argument("--peak-tflops", type=float,
                        help="peak TFLOP/s per device in the run's precision (default: the device's)")
    parser.add_argument("--intra-gbps", type=float, default=defaults.intra_gbps,
                        help="Gbit/s each device sends within its node, each way (NVLink H100: 3600) "
                        "(default: %(default)s)")
    parser.add_argument("--inter-gbps", type=float, default=defaults.inter_gbps,
                        help="Gbit/s a node sends to other nodes, each way, all its network cards "
                        "(default: %(default)s)")
    parser.add_argument("--intra-latency-us", type=float, default=defaults.intra_latency_us,
                        help="latency of one message within a node (default: %(default)s)")
    parser.add_argument("--inter-latency-us", type=float, default=defaults.inter_latency_us,
                        help="latency of one message across nodes (default: %(default)s)")
    parser.add_argument("--mfu", type=float, default=defaults.mfu,
                        help="share of the peak the compute reaches (default: %(default)s)")
    parser.add_argument("--efficiency", type=float, default=defaults.efficiency,
                        help="scaling efficiency the recommended gradient accumulation must reach "
                        "(default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, help="the data's vocabulary size (default: read the data)")
    parser.add_argument("--check", action="store_true",
                        help="instead of planning, start ranks of the run in this process on torch's fake "
                        "process group, through main.py's start-up and one real step at the configured "
                        "batch, and say what each holds and reads (docs/distributed.md)")
    parser.add_argument("--ranks", help="with --check: the ranks to start, comma-separated (default: 0, "
                        "the middle one and the last)")
    return parser.parse_known_args(argv)


def cluster_options(args: argparse.Namespace) -> ClusterOptions:
    device = args.device or ClusterOptions.device
    return ClusterOptions(args.nodes, args.gpus_per_node, device, args.memory_gb, args.peak_tflops,
                          args.intra_gbps, args.inter_gbps, args.intra_latency_us, args.inter_latency_us,
                          args.mfu, args.efficiency)


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
        peak = cpu_peak_flops(dtype_name(dtype)) / options.gpus_per_node
    else:
        name = dtype_name(dtype, tf32=True)
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
    cluster = build_cluster(options, dtype)
    placement = placement_of(tc, cluster.world_size, cluster.ranks_per_node, device_type, dtype,
                             config.optimizer_config.name)
    return Setting(model, tc.batch_size, placement, tc.activation_checkpointing, cluster, options.efficiency)


def checked_cluster(config, options: ClusterOptions) -> CheckedCluster:
    """The cluster a check's ranks stand for: its world, and each rank's device, precision and memory."""
    device_type = CPU_DEVICE if options.device == CPU_DEVICE else "cuda"
    dtype = compute_dtype(config, device_type)
    cluster = build_cluster(options, dtype)
    device = SimulatedDevice(device_type, dtype, options.device, cluster.memory)
    return CheckedCluster(options.nodes, options.gpus_per_node, device)


@command
def main(argv: Optional[list[str]] = None) -> None:
    args, overrides = parse_args(argv)
    options = cluster_options(args)
    check(args.ranks is None or args.check, "--ranks", "chooses the ranks of --check; add --check")
    config = from_command_line(overrides, "plan.py", args.config_name)
    if args.check:
        cluster = checked_cluster(config, options)
        ranks = checked_ranks(cluster.world_size, args.ranks)
        lines = check_run(config, cluster, ranks)
        assumed = [] if args.device else [f"Assumed: {options.device} (no --device given)"]
        print("\n".join([*assumed, *lines]))
        return
    setting = make_setting(config, options, vocab_size_of(config, args.vocab_size))
    rows = plan_rows(setting)
    assumed = [] if args.device else [f"Assumed: {options.device} (no --device given); --device, --nodes and "
                                       "--gpus-per-node describe your cluster (plan.py --help)"]
    advice = [line for said in recommend(rows, setting) for line in wrapped(said)]
    print("\n".join([*assumed, *wrapped(describe(setting)), "", table(rows, setting), "", *advice]))


def wrapped(line: str) -> list[str]:
    """A line of the plan cut at WIDTH, its continuation under its text (a reason's, under its "- ")."""
    indent = "  " if line.startswith("- ") else "    "
    return textwrap.wrap(line, width=WIDTH, subsequent_indent=indent, break_on_hyphens=False)


if __name__ == "__main__":
    main()
