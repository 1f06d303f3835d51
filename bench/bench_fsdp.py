"""Per-rank memory and throughput of DDP against FSDP, on a model where sharding matters.

    python bench/bench_fsdp.py [--nproc 2] [--layers 12] [--embd 768] [--batch-size 4] [--steps 5]

For each method it starts `torchrun --standalone --nproc_per_node=N` on this script's worker mode,
which builds the model and Trainer through the project's own code and times real training steps.
Each rank reports:
- state MB: parameters + gradients + AdamW moments it holds (exact tensor bytes; 1/N under FSDP);
- peak MB: the peak during the timed steps (start-up builds the whole model before sharding): the
  process's resident memory on the CPU (everything: Python, torch, activations, gathered blocks),
  or torch.cuda.max_memory_allocated on a GPU;
- tokens/s over all ranks.
Figures are printed as a table and written as JSON (--json).
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "mingpt"))


def tensor_bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def held_state_bytes(trainer) -> int:
    """Parameters, gradients and optimizer state this rank holds."""
    params = list(trainer.model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    moments = [v for state in trainer.optimizer.state.values() for v in state.values() if hasattr(v, "numel")]
    return tensor_bytes(params) + tensor_bytes(grads) + tensor_bytes(moments)


def reset_peak_memory(device) -> None:
    """Measure the training steps' peak, not start-up's (the full model is built before sharding)."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed start-up memory back to the system
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets the peak resident set (VmHWM)


def peak_memory(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    status = Path("/proc/self/status").read_text()
    kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(kib) * 1024


def worker(args: argparse.Namespace) -> None:
    """Runs under torchrun: time training steps, then rank 0 prints every rank's figures as JSON."""
    import torch

    from char_dataset import CharDataset
    from model import GPT, GPTConfig, OptimizerConfig
    from process_group import all_gather_objects, distributed_session
    from trainer import Trainer, TrainerConfig

    with distributed_session() as env, tempfile.TemporaryDirectory() as scratch:
        text = "".join(chr(97 + (i * 7919) % 26) for i in range(200_000))  # no data file needed
        dataset = CharDataset(text, block_size=args.block_size)
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd,
                              vocab_size=dataset.vocab_size, block_size=args.block_size))
        config = TrainerConfig(batch_size=args.batch_size, data_loader_workers=0, use_amp=args.amp,
                               amp_dtype="bfloat16", distributed_method=args.method,
                               snapshot_path=f"{scratch}/snap.pt")
        trainer = Trainer(config, model, OptimizerConfig(), dataset, None, dataset.vocab, env)
        batches = iter(trainer.train_loader)
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                reset_peak_memory(env.device)
                start = time.perf_counter()
            inputs, targets = (t.to(env.device) for t in next(batches))
            trainer.train_step(inputs, targets).item()
        elapsed = time.perf_counter() - start
        peak = peak_memory(env.device)
        tokens = args.steps * args.batch_size * args.block_size * env.world_size
        mine = {"rank": env.rank, "state_mb": held_state_bytes(trainer) / 1e6, "peak_mb": peak / 1e6,
                "tokens_per_s": tokens / elapsed}
        everyone = all_gather_objects(mine)
        if env.is_main:
            params = sum(p.numel() for p in trainer.model.parameters())
            print("RESULT " + json.dumps({"method": args.method, "params": params, "ranks": everyone}))
        del trainer, model


def run_method(args: argparse.Namespace, method: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, "--worker", "--method", method, *forwarded(args)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        sys.exit(f"{method} run failed:\n{result.stdout}\n{result.stderr}")
    return json.loads(lines[0][len("RESULT "):])


def forwarded(args: argparse.Namespace) -> list[str]:
    flags = ["--layers", args.layers, "--heads", args.heads, "--embd", args.embd, "--block-size",
             args.block_size, "--batch-size", args.batch_size, "--warmup", args.warmup, "--steps", args.steps]
    return [str(flag) for flag in flags] + (["--amp"] if args.amp else [])


def report(results: list[dict]) -> None:
    print(f"{'method':<6} {'rank':>4} {'state MB':>9} {'peak MB':>9} {'tokens/s':>9}")
    for result in results:
        for rank in result["ranks"]:
            print(f"{result['method']:<6} {rank['rank']:>4} {rank['state_mb']:>9.0f} {rank['peak_mb']:>9.0f} "
                  f"{rank['tokens_per_s']:>9.0f}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="samples per rank per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--amp", action="store_true", help="use_amp (bf16 where the device has it)")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "fsdp.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="ddp", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    results = [run_method(args, method) for method in ("ddp", "fsdp")]
    report(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "results": results},
                                    indent=2))


if __name__ == "__main__":
    main()
