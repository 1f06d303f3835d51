"""The planner's per-rank peak (planning/memory.py, what the Trainer checks at start-up) against what a
step really holds: torch.cuda.max_memory_allocated on a GPU, the process's peak resident memory on a CPU.

    python bench/bench_gpu_memory.py [--cases gpt2-bf16,default-fp16]          # DDP, one process
    torchrun --standalone --nproc_per_node=1 bench/bench_gpu_memory.py --method fsdp

Cases: gpt2 (124M, GPT-2's vocabulary of 50,257) in bf16 at batch 8, block 1024; the tutorial's default
model in fp16 with its GradScaler at batch 216, block 128 (bf16 on a CPU); tiny, for a CPU check of
the script. Target: within 10% of the measured peak. Writes bench/results/gpu/memory.json on a GPU,
bench/results/memory_cpu.json otherwise (unless --json).
"""
import argparse
from pathlib import Path

from common import RESULTS, benchmark_trainer, peak_memory, reset_peak_memory, save_json, synthetic_text

from mingpt.char_dataset import CharDataset
from mingpt.distributed.process_group import distributed_session

CASES = {  # (layers, heads, embd, block, batch, vocab, amp dtype on CUDA)
    "gpt2-bf16": (12, 12, 768, 1024, 8, 50257, "bfloat16"),
    "default-fp16": (8, 8, 512, 128, 216, 65, "float16"),
    "tiny": (2, 2, 32, 16, 8, 65, "bfloat16"),
}
TARGET = 0.10


def measure(name: str, method: str, steps: int, env) -> dict:
    layers, heads, embd, block, batch, vocab, dtype = CASES[name]
    dataset = CharDataset(synthetic_text(max(200_000, 4 * batch * block), 0, vocab), block)
    with benchmark_trainer(env, layers, heads, embd, block, dataset=dataset, batch_size=batch, use_amp=True,
                           amp_dtype=dtype, distributed_method=method) as trainer:
        batches = iter(trainer.train_loader)
        reset_peak_memory(env.device)
        for _ in range(steps):
            inputs, targets = trainer.to_device(next(batches))
            trainer._run_batch(inputs, targets)[0].item()
        measured, planned = peak_memory(env.device), trainer.placed.memory.estimate.peak
    row = {"case": name, "method": method, "planned_bytes": planned, "measured_bytes": measured,
           "error": planned / measured - 1, "within_target": abs(planned / measured - 1) <= TARGET}
    if env.device.type != "cuda":
        row["within_target"] = None  # the whole process's resident memory: torch itself, not the step
    if env.is_main:
        print(f"{name} {method}: planned {planned / 1e9:.2f} GB, measured {measured / 1e9:.2f} GB "
              f"({row['error']:+.1%}; target within {TARGET:.0%}: "
              f"{ {True: 'met', False: 'not met', None: 'a CPU process, not comparable'}[row['within_target']] })",
              flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="gpt2-bf16,default-fp16")
    parser.add_argument("--method", default="ddp", choices=("ddp", "fsdp"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with distributed_session() as env:
        rows = [measure(name, args.method, args.steps, env) for name in args.cases.split(",")]
        if env.is_main:
            default = RESULTS / ("gpu" if env.device.type == "cuda" else "") / f"memory_{args.method}.json"
            save_json(args.json or default, {"settings": vars(args), "device": str(env.device), "rows": rows})


if __name__ == "__main__":
    main()
