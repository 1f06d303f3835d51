"""plan.py --check's GPU figures held against a real step on a GPU (bench/gpu_checks.sh, step g).

    python bench/bench_check_gpu.py                       # gpt2, bf16, batch 8, block 1024, ddp
    torchrun --standalone --nproc_per_node=1 bench/bench_check_gpu.py --method fsdp

First the check's rank 0 of a world of as many ranks as this launch has, started on torch's fake process
group on the CPU (cluster_check.check_ranks, as plan.py --check runs it, the device this GPU with its
free memory): what it holds, measured, and the planner's figures for a step on this GPU. Then the same
config trained for real on this GPU through main.py's start-up (start_up.py), two steps: what it holds
after them, from its tensors, and torch.cuda.max_memory_allocated over the second (its optimizer state
then held from the start, as the planner counts it). Targets: the held state equal to the check's
(within 2%: both are the same tensors' bytes), the peak within 10% of the planner's (the check's GPU
figure); the caching allocator's reserve (max_memory_reserved) is reported beside it, unchecked.
Without a GPU it runs the CPU half only, on a small model (a check of this script).
"""
import argparse
import os
import tempfile
from pathlib import Path

import torch
from common import RESULTS, save_json

from mingpt.cluster_check import CheckedCluster, check_ranks, into_folder
from mingpt.distributed.process_group import distributed_session
from mingpt.planning.check import held_by
from mingpt.planning.memory import SimulatedDevice, gb
from mingpt.run_config import from_command_line
from mingpt.start_up import start_trainer, train_objects

GPT2 = ["gpt_config.model_type=gpt2", "gpt_config.n_layer=null", "gpt_config.n_head=null",
        "gpt_config.n_embd=null", "data_config.block_size=1024", "trainer_config.batch_size=8",
        "trainer_config.amp_dtype=bfloat16", "trainer_config.data_loader_workers=0"]
SMALL = ["gpt_config.n_layer=2", "gpt_config.n_head=2", "gpt_config.n_embd=64", "trainer_config.batch_size=4",
         "trainer_config.data_loader_workers=0"]
STATE_TARGET, PEAK_TARGET = 0.02, 0.10


def real_step(config, env) -> dict:
    """Two steps of the run on this launch's devices; the second's peak and what it holds after."""
    trainer, _ = start_trainer(config, env, train_objects(config, env))  # no lease: it saves nothing
    batches = iter(trainer.train_loader)
    trainer._run_batch(*trainer.to_device(next(batches)))
    if env.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(env.device)
    trainer._run_batch(*trainer.to_device(next(batches)))
    held = held_by(trainer.model, trainer.optimizer)
    gpu = env.device.type == "cuda"
    return {"parameters": held.parameters, "gradients": held.gradients, "optimizer": held.optimizer,
            "peak": torch.cuda.max_memory_allocated(env.device) if gpu else None,
            "reserved": torch.cuda.max_memory_reserved(env.device) if gpu else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="ddp", choices=("ddp", "fsdp"))
    parser.add_argument("--json", type=Path, default=None)
    args, extra = parser.parse_known_args(argv)
    gpu = torch.cuda.is_available()
    overrides = [*(GPT2 if gpu else SMALL), f"trainer_config.distributed_method={args.method}", *extra]
    config = from_command_line(overrides, "bench_check_gpu.py")
    name = torch.cuda.get_device_name() if gpu else "cpu"
    device = SimulatedDevice("cuda" if gpu else "cpu", torch.bfloat16 if gpu else None, name,
                             torch.cuda.mem_get_info()[0] if gpu else None)
    ranks, per_node = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    is_main = os.environ.get("RANK", "0") == "0"
    # The check first: its ranks' processes fork from this one, which must not be in a group yet.
    cluster = CheckedCluster(ranks // per_node, per_node, device)
    check = check_ranks(config, cluster, [0])[0] if is_main else None
    with distributed_session() as env, tempfile.TemporaryDirectory() as folder:
        measured = real_step(into_folder(config, Path(folder)), env)
    if not is_main:
        return
    state = {key: (measured[key] - getattr(check.held, key)) / getattr(check.held, key)
             for key in ("parameters", "gradients", "optimizer")}
    planned = check.planned_cluster["peak"]
    row = {"device": name, "method": args.method, "overrides": overrides, "check_held": vars(check.held),
           "check_planned_on_device": check.planned_cluster, "measured": measured, "state_errors": state,
           "state_within": all(abs(error) <= STATE_TARGET for error in state.values()),
           "peak_error": planned / measured["peak"] - 1 if gpu else None}
    row["peak_within"] = abs(row["peak_error"]) <= PEAK_TARGET if gpu else None
    said = ", ".join(f"{key} {100 * error:+.1f}%" for key, error in state.items())
    peak = (f"peak {gb(measured['peak'])} (reserved {gb(measured['reserved'])}), the check's planned "
            f"{gb(planned)} ({100 * row['peak_error']:+.1f}%, target {PEAK_TARGET:.0%})" if gpu
            else "no GPU: the state only")
    print(f"{name} {args.method}: holds {gb(sum(measured[key] for key in state))}, the check's "
          f"{gb(check.held.total)} ({said}); {peak}")
    default = (RESULTS / "gpu" / f"check_{args.method}.json" if gpu
               else Path(tempfile.mkdtemp()) / "check.json")
    save_json(args.json or default, {"settings": vars(args), "row": row})
    if not row["state_within"] or row["peak_within"] is False:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
