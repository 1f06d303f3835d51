"""Whether padding GPT-2's vocabulary (50,257) to a multiple of 64 (50,304) pays: a training step of the
project's GPT at gpt2's width, timed with gpt_config.vocab_multiple=1 and =64.

    python bench/bench_vocab_padding.py                  # this machine's CPU, or its GPU if it has one
    python bench/bench_vocab_padding.py --layers 12 --tokens 16384

nanoGPT and llm.c pad to 50,304 because matrix units work in tiles, and 50,257 (odd; 17 past a
multiple of 64) leaves the last tile of every output-layer matmul mostly empty. The padded rows are
zero and their logits -inf (model.py), so the model computes the same loss; only the speed can
differ, and the -inf written into the padding's logits is part of what is timed. The model is gpt2's
width (768) with --layers blocks (1 on a CPU, where the output layer is then most of the step; 12,
gpt2 itself, on a GPU), forward and backward of --tokens tokens, --repeats times after a warm-up,
the two paddings alternated three times; the best median of each. Results go to
bench/results/vocab_padding.json on a CPU, bench/results/gpu/vocab_padding.json on a GPU (bf16
autocast there; fp32 on a CPU), with the machine named.
"""
import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from mingpt.model import GPT, GPTConfig

RESULTS = Path(__file__).resolve().parent / "results"
GPT2_VOCAB, N_EMBD, BLOCK = 50_257, 768, 1024
MULTIPLES = (1, 64)


def step_seconds(vocab_multiple: int, layers: int, tokens: int, repeats: int, device: torch.device) -> float:
    """Median seconds of a forward and backward pass of the model with this padding."""
    config = GPTConfig(n_layer=layers, n_head=12, n_embd=N_EMBD, vocab_size=GPT2_VOCAB, block_size=BLOCK,
                       vocab_multiple=vocab_multiple)
    model = GPT(config).to(device)
    block = min(tokens, BLOCK)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, GPT2_VOCAB, (tokens // block, block + 1), generator=generator).to(device)
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with autocast:
            _, loss = model(ids[:, :-1], ids[:, 1:])
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
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks (CPU 1, GPU 12)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step (CPU 1,024, GPU 16,384)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed steps at each padding (CPU 5, GPU 30)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    layers = args.layers or (12 if cuda else 1)
    tokens = args.tokens or (16_384 if cuda else 1_024)
    repeats = args.repeats or (30 if cuda else 5)
    # Alternate the two paddings, so that a slower phase of a shared machine hits both alike.
    runs = {multiple: [] for multiple in MULTIPLES}
    for _ in range(3):
        for multiple in runs:
            runs[multiple].append(step_seconds(multiple, layers, tokens, repeats, device))
    seconds = {multiple: min(times) for multiple, times in runs.items()}
    speedup = seconds[1] / seconds[64]
    machine = torch.cuda.get_device_name() if cuda else f"{platform.node()}: {os.cpu_count()} CPUs"
    report = {"machine": machine, "device": device.type, "dtype": "bf16 autocast" if cuda else "fp32",
              "model": f"{layers} blocks, 768 wide, vocabulary {GPT2_VOCAB:,}", "tokens_per_step": tokens,
              "repeats": repeats, "torch": torch.__version__,
              "seconds": {f"vocab_multiple={m}": [round(s, 5) for s in times] for m, times in runs.items()},
              "best_s": {f"vocab_multiple={m}": round(s, 5) for m, s in seconds.items()},
              "padded_speedup": round(speedup, 3), "pays": speedup > 1.02}
    print(f"{machine}: {report['model']}, fwd+bwd of {tokens:,} tokens: {seconds[1] * 1e3:.1f} ms unpadded, "
          f"{seconds[64] * 1e3:.1f} ms padded to 50,304: padded {speedup:.3f}x")
    path = Path(args.json) if args.json else (RESULTS / "gpu" if cuda else RESULTS) / "vocab_padding.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
