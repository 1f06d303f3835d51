"""Run by the tests under torchrun: a model built on the meta device and placed by parallelize(),
for each method, with its full initial weights gathered on rank 0; and the peak memory of placing
a larger one under FSDP.

    torchrun --standalone --nproc_per_node=2 tests/workers/init_probe.py OUT_DIR

Rank 0 writes OUT_DIR/<method>.pt (ddp, fsdp, fsdp_offload: the gathered state dict). Each rank
writes OUT_DIR/peak_rank<N>.json: how far its resident memory rose above where it started while
the larger model was built on the meta device and sharded (Linux's peak resident set, VmHWM, reset
first through /proc/self/clear_refs), beside the model's full size and its largest parameter's.
"""
import json
import re
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from mingpt.distributed.parallel import Parallelism, parallelize
from mingpt.distributed.precision import resolve_precision
from mingpt.distributed.process_group import distributed_session
from mingpt.model import GPT, GPTConfig

SEED = 7
# 15 positions: uneven shards; 11 tokens in 64 rows: rank 0's shard cut at the padding, rank 1's all padding
TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=11, block_size=15)
LARGER = GPTConfig(n_layer=8, n_head=8, n_embd=512, vocab_size=11, block_size=16)  # 25M parameters, 101 MB
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # on rank 0, in CPU memory
PLACEMENTS = {"ddp": Parallelism("ddp"), "fsdp": Parallelism("fsdp"),
              "fsdp_offload": Parallelism("fsdp", cpu_offload=True)}


def placed(config: GPTConfig, parallelism: Parallelism, env) -> torch.nn.Module:
    with torch.device("meta"):
        model = GPT(config, seed=SEED)
    return parallelize(model, parallelism, resolve_precision(False, "float16", env.device), env)


def memory_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def peak_rise_of_placing(config: GPTConfig, env) -> int:
    """Bytes by which this process's resident memory peaked above its level before placing."""
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
    before = memory_kb("VmRSS")
    model = placed(config, Parallelism("fsdp"), env)
    rise = (memory_kb("VmHWM") - before) * 1024
    del model
    return rise


def record(out: Path, env) -> None:
    for name, parallelism in PLACEMENTS.items():
        model = placed(TINY, parallelism, env)
        state = get_model_state_dict(model, options=FULL_STATE)
        if env.is_main:
            torch.save(state, out / f"{name}.pt")
        del model
    rise = peak_rise_of_placing(LARGER, env)
    with torch.device("meta"):
        sizes = [p.numel() * p.element_size() for p in GPT(LARGER).parameters()]
    facts = {"peak_rise": rise, "model_bytes": sum(sizes), "largest_parameter_bytes": max(sizes)}
    (out / f"peak_rank{env.rank}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    with distributed_session() as env:
        record(Path(sys.argv[1]), env)
