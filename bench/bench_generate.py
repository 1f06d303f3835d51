"""Generation speed with and without the key/value cache (GPT.generate): time to first token and
tokens per second, from a 1-token and a 256-token prompt, for the default model and a gpt2-sized one,
on 1 and 2 threads.

    python bench/bench_generate.py [--new-tokens 32] [--models default gpt2] [--threads 1 2]

Random weights (speed does not depend on them), greedy decoding, batch 1, fp32 on the CPU (the
device --device names otherwise). Each figure is the best of --repeats runs. Tokens per second are
the new tokens after the first over the time they took; the first token's time is the prompt's
(prefill). The default model's block is 128: a 256-token prompt is past it from the start, where the
window slides and each token is computed afresh with or without a cache (model.py says why).
"""
import argparse
import time
from pathlib import Path

import torch
from common import RESULTS, save_json

from mingpt.model import GPT, GPTConfig

MODELS = {"default": dict(n_layer=8, n_head=8, n_embd=512, vocab_size=65, block_size=128),
          "gpt2": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024,
                       activation="gelu_tanh")}
TARGET = 8.0
"""The issue's target: the cache's tokens/s at least 8x the uncached at a 256-token prompt, gpt2-sized."""


def timed_generation(model: GPT, prompt: torch.Tensor, new_tokens: int, use_cache: bool) -> tuple[float, float]:
    """(seconds to the first new token, tokens/s of the others)."""
    start = time.perf_counter()
    idx = model.generate(prompt, 1, temperature=0, use_cache=use_cache)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(prompt, new_tokens, temperature=0, use_cache=use_cache)
    whole_s = time.perf_counter() - start
    assert idx.size(1) == prompt.size(1) + 1
    return first_s, (new_tokens - 1) / max(whole_s - first_s, 1e-9)


def measure(name: str, prompt_tokens: int, threads: int, new_tokens: int, repeats: int,
            device: torch.device) -> dict:
    torch.set_num_threads(threads)
    with torch.device(device):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**MODELS[name], embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)).eval()
    prompt = torch.randint(model.config.vocab_size, (1, prompt_tokens), device=device)
    row = {"model": name, "prompt_tokens": prompt_tokens, "threads": threads}
    for use_cache in (True, False):
        runs = [timed_generation(model, prompt, new_tokens, use_cache) for _ in range(repeats)]
        kind = "cached" if use_cache else "uncached"
        row[f"{kind}_first_token_s"] = min(first for first, _ in runs)
        row[f"{kind}_tokens_per_s"] = max(rate for _, rate in runs)
    row["speedup"] = row["cached_tokens_per_s"] / row["uncached_tokens_per_s"]
    print(f"{name:8} prompt {prompt_tokens:4} threads {threads}: first token {row['cached_first_token_s']:.3f} s "
          f"cached / {row['uncached_first_token_s']:.3f} s uncached; {row['cached_tokens_per_s']:7.1f} vs "
          f"{row['uncached_tokens_per_s']:6.1f} tokens/s ({row['speedup']:.1f}x)", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--prompts", nargs="+", type=int, default=[1, 256])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=str(RESULTS / "generate.json"))
    args = parser.parse_args()
    rows = [measure(name, prompt, threads, args.new_tokens, args.repeats, torch.device(args.device))
            for name in args.models for threads in args.threads for prompt in args.prompts]
    gpt2_256 = [row["speedup"] for row in rows if row["model"] == "gpt2" and row["prompt_tokens"] == 256]
    verdict = {"target_speedup": TARGET, "gpt2_256_speedups": gpt2_256,
               "met": bool(gpt2_256) and min(gpt2_256) >= TARGET}
    print(f"gpt2-sized, 256-token prompt: {', '.join(f'{s:.1f}x' for s in gpt2_256)} (target {TARGET}x: "
          f"{'met' if verdict['met'] else 'not met'})")
    save_json(Path(args.json), {"settings": vars(args), "rows": rows, "verdict": verdict})


if __name__ == "__main__":
    main()
