"""Whether padding GPT-2's vocabulary (50,257) to a multiple of 64 (50,304) pays: the output layer and
its cross-entropy, forward and backward, timed at both sizes.

    python bench/bench_vocab_padding.py                  # this machine's CPU, or its GPU if it has one
    python bench/bench_vocab_padding.py --tokens 16384   # more tokens per step

nanoGPT and llm.c pad to 50,304 because a GPU's matrix units work in tiles, and 50,257 (odd; 17 past
a multiple of 64) leaves the last tile of every output-layer matmul mostly empty. The padded ids are
never targets, so the loss is the same; only the speed can differ. This measures the output layer
alone (its matmuls are a third of gpt2's step): hidden states of n_embd (768) for --tokens tokens,
a Linear to the vocabulary, the cross-entropy against ids below 50,257, backward, --repeats times
after a warm-up; the median of each. Results go to bench/results/vocab_padding.json on a CPU, to
bench/results/gpu/vocab_padding.json on a GPU (bf16 autocast there; fp32 on a CPU), with the machine
named. The project pads only where this pays on the device that trains.
"""
import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"
GPT2_VOCAB, PADDED_VOCAB, N_EMBD = 50_257, 50_304, 768


def step_seconds(vocab: int, tokens: int, repeats: int, device: torch.device) -> float:
    """Median seconds of the output layer's forward and backward at this vocabulary size."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, N_EMBD, generator=generator).to(device).requires_grad_()
    weight = (torch.randn(vocab, N_EMBD, generator=generator) * 0.02).to(device).requires_grad_()
    targets = torch.randint(0, GPT2_VOCAB, (tokens,), generator=generator).to(device)
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with autocast:
            loss = F.cross_entropy(hidden @ weight.t(), targets)
        loss.backward()

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step (CPU 1,024, GPU 16,384)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps at each size (CPU 5, GPU 50)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    tokens = args.tokens or (16_384 if cuda else 1_024)  # a CPU step of 2,048 takes 6 s on a 2-core VM
    repeats = args.repeats or (50 if cuda else 5)
    # Alternate the two sizes, so that a slower phase of a shared machine hits both alike.
    runs = {GPT2_VOCAB: [], PADDED_VOCAB: []}
    for _ in range(3):
        for vocab in runs:
            runs[vocab].append(step_seconds(vocab, tokens, repeats, device))
    seconds = {vocab: min(times) for vocab, times in runs.items()}
    speedup = seconds[GPT2_VOCAB] / seconds[PADDED_VOCAB]
    machine = torch.cuda.get_device_name() if cuda else f"{platform.node()}: {os.cpu_count()} CPUs"
    report = {"machine": machine, "device": device.type, "dtype": "bf16 autocast" if cuda else "fp32",
              "tokens_per_step": tokens, "repeats": repeats, "torch": torch.__version__,
              "seconds": {str(vocab): [round(s, 5) for s in times] for vocab, times in runs.items()},
              "best_s": {str(vocab): round(s, 5) for vocab, s in seconds.items()},
              "padded_speedup": round(speedup, 3), "pays": speedup > 1.02}
    print(f"{machine}: output layer fwd+bwd, {tokens:,} tokens: {seconds[GPT2_VOCAB] * 1e3:.1f} ms at "
          f"{GPT2_VOCAB:,}, {seconds[PADDED_VOCAB] * 1e3:.1f} ms at {PADDED_VOCAB:,}: padded {speedup:.3f}x")
    path = Path(args.json) if args.json else (RESULTS / "gpu" if cuda else RESULTS) / "vocab_padding.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
