"""The planner held against simulated ranks (plan.py --check) of GPT-2's four sizes at 8 to 1,024 ranks.

    python bench/bench_check.py                        # the grid below; hours on a 2-core CPU
    python bench/bench_check.py --models gpt2 --worlds 8,64 --methods fsdp --json /tmp/check.json
    python bench/bench_check.py --ddp-worlds 8 --offload-worlds 64 --last-rank gpt2   # as committed

Each point starts one rank of the world (8 ranks per node, H100s in fp16) through main.py's start-up on
torch's fake process group, in a process of its own, and steps it once (cluster_check.check_ranks):
what it then holds (its parameters, their gradients and AdamW's state, from its tensors' storages) is
held against the planner's rank_state, and the activations its forward pass leaves for the backward
pass (measured by planning/check.StepMemory on the real tensors, in this CPU's precision) against the
planner's trace of the same step. Rank 0 holds the most (FSDP2 pads every rank's chunk of a parameter
to the first's); under fsdp the last rank is measured too (its optimizer state is of its own, shorter,
rows). Targets: the state within 2% (both are exact), activations within 15%.

Grid: gpt2, gpt2-medium, gpt2-large, gpt2-xl (their shapes, with the corpus's 59-character
vocabulary) x 8, 64, 512, 1,024 ranks x ddp, fsdp, hsdp (2 nodes or more), each sharded method
with and without cpu_offload. ddp holds the whole model whatever the world: it runs where this
machine can hold a whole copy with its buckets (--ddp-limit-gb), and is reported as not run beyond.
"""
import argparse
import json
import time
from pathlib import Path

import torch
from common import RESULTS, save_json

from mingpt.cluster_check import CheckedCluster, check_ranks
from mingpt.common.errors import MinGPTError
from mingpt.planning.memory import SimulatedDevice, gb
from mingpt.run_config import from_command_line

MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
WORLDS = (8, 64, 512, 1024)
METHODS = ("ddp", "fsdp", "hsdp", "fsdp+offload", "hsdp+offload")
RANKS_PER_NODE = 8
STATE_TARGET = 0.02
ACTIVATION_TARGET = 0.15
H100 = SimulatedDevice("cuda", torch.float16, "H100", 79 * 10**9)
DDP_BYTES_PER_PARAMETER = 20  # fp32 weights, gradients, two AdamW moments and DDP's buckets


def points(args) -> list[tuple[str, int, str]]:
    found = []
    for model in args.models.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            for method in args.methods.split(","):
                if method.startswith("hsdp") and world <= RANKS_PER_NODE:
                    continue  # one node: hsdp is refused
                if method == "ddp" and str(world) not in args.ddp_worlds.split(","):
                    continue
                if method.endswith("+offload") and str(world) not in args.offload_worlds.split(","):
                    continue
                found.append((model, world, method))
    return found


def overrides(model: str, method: str, batch_size: int) -> list[str]:
    name, _, offload = method.partition("+")
    return [f"gpt_config.model_type={model}", "gpt_config.n_layer=null", "gpt_config.n_head=null",
            "gpt_config.n_embd=null", f"trainer_config.distributed_method={name}",
            f"trainer_config.cpu_offload={bool(offload)}", f"trainer_config.batch_size={batch_size}"]


def ddp_bytes(config) -> int:
    """What a rank holds under ddp with its buckets (activations aside)."""
    from dataclasses import replace

    from mingpt.planning.memory import model_sizes
    sized = replace(config.gpt_config, vocab_size=59, block_size=config.data_config.block_size)
    return model_sizes(sized).total * DDP_BYTES_PER_PARAMETER


def measure(model: str, world: int, method: str, args) -> list[dict]:
    config = from_command_line(overrides(model, method, args.batch_size), "bench_check.py")
    needed = ddp_bytes(config)
    if method == "ddp" and needed > args.ddp_limit_gb * 1e9:
        return [{"model": model, "world": world, "method": method, "skipped":
                 f"a whole copy with its buckets is {needed / 1e9:.1f} GB, more than --ddp-limit-gb "
                 f"{args.ddp_limit_gb:g}"}]
    ranks = [0, world - 1] if method.startswith("fsdp") and model in args.last_rank.split(",") else [0]
    cluster = CheckedCluster(world // RANKS_PER_NODE, RANKS_PER_NODE, H100)
    start = time.perf_counter()
    try:
        checks = check_ranks(config, cluster, ranks)
    except MinGPTError as error:
        return [{"model": model, "world": world, "method": method, "refused": str(error)}]
    except RuntimeError as error:  # the rank's process died (out of memory, say): said, and the grid goes on
        return [{"model": model, "world": world, "method": method, "refused": str(error).splitlines()[0]}]
    seconds = (time.perf_counter() - start) / len(ranks)
    rows = []
    for check in checks:
        measured = {"parameters": check.held.parameters, "gradients": check.held.gradients,
                    "optimizer": check.held.optimizer, "activations": check.activations}
        errors = {name: (value - check.planned_cpu[name]) / check.planned_cpu[name]
                  for name, value in measured.items()}
        rows.append({"model": model, "world": world, "method": method, "rank": check.rank, "mesh": check.mesh,
                     "batch_size": args.batch_size, "precision": check.precision, "measured": measured,
                     "planned": {name: check.planned_cpu[name] for name in measured}, "errors": errors,
                     "within": all(abs(error) <= target(name) for name, error in errors.items()),
                     "planned_h100": check.planned_cluster, "seconds": seconds,
                     "resident_peak": check.resident_peak})
    return rows


def target(name: str) -> float:
    return ACTIVATION_TARGET if name == "activations" else STATE_TARGET


def line(row: dict) -> str:
    head = f"{row['model']:<11} {row['world']:>5} {row['method']:<12}"
    if "skipped" in row or "refused" in row:
        return f"{head}       not run: {row.get('skipped') or row.get('refused')}"
    cells = " ".join(f"{gb(row['measured'][name]):>9} {100 * row['errors'][name]:+5.1f}%"
                     for name in ("parameters", "gradients", "optimizer", "activations"))
    return f"{head} {row['rank']:>5} {cells} {'yes' if row['within'] else 'NO':>4} {row['seconds']:>5.0f}s"


HEADER = (f"{'model':<11} {'world':>5} {'method':<12} {'rank':>5} {'parameters':>16} {'gradients':>16} "
          f"{'optimizer':>16} {'activations':>16} {'ok':>4} {'time':>6}")


def even_share(row: dict) -> tuple[int, int]:
    """What the planner said before it counted FSDP2's chunks: an even share of the parameters
    (total / ranks) and twice that of AdamW state (no step counts)."""
    from dataclasses import replace

    from mingpt.planning.memory import model_sizes
    config = from_command_line(overrides(row["model"], row["method"], 1), "bench_check.py")
    total = model_sizes(replace(config.gpt_config, vocab_size=59, block_size=128)).total
    name = row["method"].partition("+")[0]
    shards = {"ddp": 1, "fsdp": row["world"], "hsdp": RANKS_PER_NODE}[name]
    parameters = -(-4 * total // shards)
    return parameters, 2 * parameters


def markdown(rows: list[dict]) -> str:
    """The committed table (docs/performance.md): measured bytes, the planner's error, and the even
    share's error before the planner counted FSDP2's chunks."""
    lines = ["| model | ranks | method | rank | parameters | gradients | AdamW state | activations | "
             "before: parameters, AdamW |", "|---|---|---|---|---|---|---|---|---|"]
    order = {name: index for index, name in enumerate((*MODELS, *METHODS))}
    def key(row: dict) -> tuple:
        return order[row["model"]], row["world"], order[row["method"]], row.get("rank", 0)

    for row in sorted(rows, key=key):
        if "measured" not in row:
            lines.append(f"| {row['model']} | {row['world']:,} | {row['method']} | | not run: "
                         f"{row.get('skipped') or row.get('refused')} | | | | |")
            continue
        cells = [f"{gb(row['measured'][name])} ({100 * row['errors'][name]:+.1f}%)"
                 for name in ("parameters", "gradients", "optimizer", "activations")]
        parameters, moments = even_share(row)
        before = (f"{100 * (parameters / row['measured']['parameters'] - 1):+.1f}%, "
                  f"{100 * (moments / row['measured']['optimizer'] - 1):+.1f}%")
        lines.append(f"| {row['model']} | {row['world']:,} | {row['method']} | {row['rank']} | "
                     f"{' | '.join(cells)} | {before} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--batch-size", type=int, default=1,
                        help="the step's batch (its compute and activations scale with it)")
    parser.add_argument("--ddp-worlds", default=",".join(map(str, WORLDS)),
                        help="the worlds ddp runs at (what a rank holds under ddp does not depend on it)")
    parser.add_argument("--offload-worlds", default=",".join(map(str, WORLDS)),
                        help="the worlds the sharded methods run at with cpu_offload too")
    parser.add_argument("--last-rank", default=",".join(MODELS),
                        help="models whose last rank is measured too under fsdp (its optimizer state is "
                        "shorter)")
    parser.add_argument("--ddp-limit-gb", type=float, default=17.0,
                        help="run ddp only where a whole copy with its buckets fits in this")
    parser.add_argument("--json", type=Path, default=RESULTS / "check.json")
    parser.add_argument("--markdown", action="store_true", help="print the table of --json's rows, and stop")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(args.json.read_text())["rows"]))
        return
    rows, done = [], set()
    if args.json.exists():  # a grid interrupted goes on where it stopped
        rows = json.loads(args.json.read_text()).get("rows", [])
        done = {(row["model"], row["world"], row["method"]) for row in rows}
    print(HEADER)
    for row in rows:
        print(line(row))
    for model, world, method in points(args):
        if (model, world, method) in done:
            continue
        for row in measure(model, world, method, args):
            rows.append(row)
            print(line(row), flush=True)
        measured = [row for row in rows if "errors" in row]
        worst = {name: max((abs(row["errors"][name]) for row in measured), default=0.0)
                 for name in ("parameters", "gradients", "optimizer", "activations")}
        save_json(args.json, {"settings": {key: str(value) for key, value in vars(args).items()},
                              "targets": {"state": STATE_TARGET, "activations": ACTIVATION_TARGET},
                              "largest_errors": worst, "all_within": all(row["within"] for row in measured),
                              "rows": rows})


if __name__ == "__main__":
    main()
