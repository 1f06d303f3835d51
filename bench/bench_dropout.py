"""What the CPU's own dropout and attention (model.dropout, model.causal_attention) buy over torch's.

    python bench/bench_dropout.py [--models default gpt-mini] [--rounds 15] [--threads 2]

For each model it alternates training steps (forward, backward, clipping, AdamW) with the project's
CPU path and with torch's built-ins (F.dropout, whose mask comes from bernoulli_, and SDPA, which
falls back to unfused attention when it has to drop attention weights), step by step in one process,
so that both see the same machine; then it prints the median step of each and the median of the
per-round speed-ups. The first round is not counted (allocator warm-up).
"""
import argparse
import statistics
import time
from pathlib import Path
from unittest import mock

from common import RESULTS, save_json

import torch  # noqa: E402  (common puts mingpt/ on the path first)
import torch.nn.functional as F  # noqa: E402

import model as model_module  # noqa: E402
from model import GPT, PRESETS, GPTConfig, OptimizerConfig, create_optimizer  # noqa: E402

VOCAB, BLOCK, BATCH = 65, 128, 8  # the default data's vocabulary and the batch


def torch_attention(q, k, v, dropout_p):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


TORCH_BUILT_INS = {"dropout": F.dropout, "causal_attention": torch_attention}


def gpt(name: str) -> GPT:
    sizes = {} if name == "default" else {"model_type": name, "n_layer": None, "n_head": None, "n_embd": None}
    torch.manual_seed(0)
    return GPT(GPTConfig(**sizes, vocab_size=VOCAB, block_size=BLOCK))


def step_seconds(model: GPT, optimizer: torch.optim.Optimizer, inputs, targets) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(inputs, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return time.perf_counter() - start


def compare(name: str, rounds: int) -> dict:
    model = gpt(name).train()
    optimizer = create_optimizer(model, OptimizerConfig())
    inputs, targets = (torch.randint(VOCAB, (BATCH, BLOCK)) for _ in range(2))
    ours, theirs = [], []
    for _ in range(rounds + 1):
        ours.append(step_seconds(model, optimizer, inputs, targets))
        with mock.patch.multiple(model_module, **TORCH_BUILT_INS):
            theirs.append(step_seconds(model, optimizer, inputs, targets))
    ours, theirs = ours[1:], theirs[1:]
    result = {"model": name, "ms_ours": 1e3 * statistics.median(ours),
              "ms_torch": 1e3 * statistics.median(theirs),
              "speedup": statistics.median(t / o for o, t in zip(ours, theirs))}
    print(f"{name}: {result['ms_torch']:.1f} ms/step with torch's dropout and attention, "
          f"{result['ms_ours']:.1f} with the project's; speed-up {result['speedup']:.3f}x")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["default", "gpt-mini"], choices=["default", *PRESETS])
    parser.add_argument("--rounds", type=int, default=15, help="timed pairs of steps per model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "dropout.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [compare(name, args.rounds) for name in args.models]
    save_json(args.json, {"settings": vars(args), "results": results})


if __name__ == "__main__":
    main()
