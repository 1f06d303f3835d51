"""Generate text with a trained snapshot: the prompt, then exactly --length new tokens (characters).

    python mingpt/generate.py --snapshot gpt_snapshot.pt --prompt "ROMEO:" --length 500 \\
        --temperature 0.8 --top-k 40 --seed 1337
    python generate.py --snapshot s3://bucket/gpt_snapshot.pt     # inside mingpt/; any fsspec URL
    python generate.py --snapshot s3://bucket/run/                 # a snapshot folder: its newest
    python generate.py --snapshot run/sharded_000000300            # a sharded snapshot (or its run folder)

The snapshot alone rebuilds the model (its model_config) and decodes its output (its vocabulary, or
a BPE model's tokenizer), so no training config or data is needed. A BPE model takes any prompt and
writes --length tokens, decoded whole by its tokenizer. The same snapshot, prompt, settings, seed
and device give the same text. --temperature 0 is greedy decoding (always the most likely character).
Mistakes (a missing snapshot, a prompt character the model never saw, a bad option) are reported
as one line on stderr, with exit status 1.

Sampling is the model's own, as in the original: GPT.generate (model.py), with a key/value cache
(each new token is one position, not the whole context again; --no-cache recomputes it, for
comparison: the same tokens). Speed: docs/performance.md, "Generation".
"""
import argparse
from typing import Optional

import torch

from mingpt.common.errors import MinGPTError, OneLineArgumentParser, command
from mingpt.storage.saved_model import build_model, find_snapshot
from mingpt.tokens.tokenizer import UnknownCharacters, Vocabulary

# The longest vocabulary an error message lists in full; larger ones are only counted.
VOCAB_SHOWN_MAX = 120


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = OneLineArgumentParser(description="Generate text with a trained minGPT-DDP snapshot.")
    parser.add_argument("--snapshot", default="gpt_snapshot.pt",
                        help="a snapshot file or snapshot folder (its newest): a local path or any "
                             "fsspec URL such as s3://bucket/gpt_snapshot.pt")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--length", type=int, default=500,
                        help="number of new tokens: characters, or a BPE model's tokens (default 500)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="below 1 is more conservative, above 1 more random, 0 greedy (default 1.0)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="draw only from the k most likely characters (default: all)")
    parser.add_argument("--seed", type=int, default=1337, help="random seed (default 1337)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=default_device(),
                        help="where to run (default: cuda if available, else cpu)")
    parser.add_argument("--no-cache", dest="cache", action="store_false",
                        help="recompute the whole context for every token, as without a key/value cache "
                             "(the same tokens, slower: for comparison)")
    args = parser.parse_args(argv)
    check_args(args)
    return args


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_args(args: argparse.Namespace) -> None:
    """Refuse values that argparse's types let through but that mean nothing."""
    if args.length < 0:
        raise MinGPTError(f"--length: must not be negative, got {args.length}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise MinGPTError(f"--temperature: must be 0 (greedy) or a positive number, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise MinGPTError(f"--top-k: must be at least 1, got {args.top_k}")
    if not -2**63 <= args.seed < 2**64:  # what torch.Generator.manual_seed accepts
        raise MinGPTError(f"--seed: must fit in 64 bits, got {args.seed}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise MinGPTError("--device cuda: no CUDA device is available here; use --device cpu")


def describe_vocab(vocab: list[str]) -> str:
    if len(vocab) > VOCAB_SHOWN_MAX:
        return f"{len(vocab)} characters"
    return repr("".join(vocab))  # repr keeps the message on one line (newline shows as \n)


def encode(prompt: str, vocabulary: Vocabulary) -> list[int]:
    """Token ids of prompt; MinGPTError when it is empty, or naming any character a character
    model never saw."""
    if not prompt:
        raise MinGPTError("--prompt: empty; give at least one character to continue from")
    try:
        return vocabulary.encode(prompt)
    except UnknownCharacters as unknown:
        raise MinGPTError(f"--prompt: {unknown} not in the snapshot's vocabulary; use only characters of "
                          f"the text it was trained on: {describe_vocab(vocabulary.tokens)}") from None


def generate(args: argparse.Namespace) -> str:
    """The prompt followed by args.length generated characters."""
    snapshot, path = find_snapshot(args.snapshot)
    device = torch.device(args.device)
    vocabulary = Vocabulary.kept(snapshot.vocab, snapshot.tokenizer)
    prompt_ids = encode(args.prompt, vocabulary)
    model = build_model(snapshot, path, device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
    out = model.generate(idx, args.length, args.temperature, args.top_k, generator, use_cache=args.cache)
    return vocabulary.decode(out[0].tolist())  # whole: a BPE's character may span tokens


@command
def main(argv: Optional[list[str]] = None) -> None:
    print(generate(parse_args(argv)))


if __name__ == "__main__":
    main()
