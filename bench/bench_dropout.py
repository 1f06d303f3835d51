"""What the CPU's own dropout and attention (common/tensor_ops.py) buy over torch's.

    python bench/bench_dropout.py [--models default gpt-mini] [--rounds 15] [--threads 2]

For each model it alternates Trainer._run_batch calls with the project's CPU path and with torch's
built-ins (F.dropout, whose mask comes from bernoulli_, and SDPA, which falls back to unfused
attention when it has to drop attention weights), step by step in one process, so that both see the
same machine; then it prints the median step of each and the median of the per-round speed-ups. The
first round is not counted (allocator warm-up).
"""
import argparse
import statistics
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from common import RESULTS, benchmark_trainer, save_json

from mingpt import model as model_module
from mingpt.common import tensor_ops
from mingpt.distributed.process_group import distributed_session
from mingpt.model import PRESETS, GPTConfig
from mingpt.trainer import Trainer

BLOCK, BATCH = 128, 8  # the shape


def torch_attention(q, k, v, dropout_p):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def model_sizes(name: str) -> tuple[int, int, int]:
    """(n_layer, n_head, n_embd) of a preset, or of GPTConfig's default model."""
    if name in PRESETS:
        return PRESETS[name]
    default = GPTConfig()
    return default.n_layer, default.n_head, default.n_embd


def step_seconds(trainer: Trainer, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    start = time.perf_counter()
    trainer._run_batch(inputs, targets)
    return time.perf_counter() - start


def compare(env, name: str, rounds: int) -> dict:
    with benchmark_trainer(env, *model_sizes(name), BLOCK, batch_size=BATCH) as trainer:
        inputs, targets = trainer.to_device(next(iter(trainer.train_loader)))
        ours, theirs = [], []
        for _ in range(rounds + 1):
            ours.append(step_seconds(trainer, inputs, targets))
            # Dropout's modules call tensor_ops.dropout; the attention layer calls model's causal_attention.
            with mock.patch.object(tensor_ops, "dropout", F.dropout), \
                    mock.patch.object(model_module, "causal_attention", torch_attention):
                theirs.append(step_seconds(trainer, inputs, targets))
    ours, theirs = ours[1:], theirs[1:]
    result = {"model": name, "ms_ours": 1e3 * statistics.median(ours),
              "ms_torch": 1e3 * statistics.median(theirs),
              "speedup": statistics.median(t / o for o, t in zip(ours, theirs)),
              "rounds_ms": {"ours": [1e3 * s for s in ours], "torch": [1e3 * s for s in theirs]}}
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
    with distributed_session() as env:
        results = [compare(env, name, args.rounds) for name in args.models]
    save_json(args.json, {"settings": vars(args), "results": results})


if __name__ == "__main__":
    main()
