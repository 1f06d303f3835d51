"""Score a model on HellaSwag, as GPT-2 reproductions report it (llm.c, and the paper's acc_norm).

    python mingpt/hellaswag.py --snapshot gpt_snapshot.pt --data hellaswag_val.jsonl
    python hellaswag.py --model-folder gpt2 --data hellaswag_val.jsonl --limit 1000   # inside mingpt/

--data is HellaSwag's validation file, which you download: data/hellaswag_val.jsonl of
https://github.com/rowanz/hellaswag (10,042 items; nothing is downloaded here). The model is a
snapshot (--snapshot: a file, a run's folder, whose newest is taken, or a sharded_<step> folder;
local or any fsspec URL), read as generate.py reads it, or a Hugging Face GPT-2 folder
(--model-folder), read as gpt_config.init_from reads it. Its own vocabulary tokenizes the text: a
character model scores characters, a BPE model its tokens.

Each ending's score is the model's mean cross-entropy over the ending's tokens, after the context;
the lowest is the model's choice, and the accuracy the share of items it gets right. Chance is 25%;
GPT-2 124M scores 29.4% (llm.c's figure; llm.c's own 124M reaches 29.9%). What is done with an item
longer than the model's block_size, or with a character a character model never saw:
reporting/hellaswag_eval.py. Mistakes are one line on stderr, exit status 1.
"""
import argparse
import sys
from typing import Callable, Optional

import torch

from mingpt.common.errors import MinGPTError, OneLineArgumentParser, command
from mingpt.model import GPT
from mingpt.reporting.hellaswag_eval import SOURCE, HellaSwag, Score, read
from mingpt.storage.saved_model import folder_model, snapshot_model
from mingpt.tokens.tokenizer import Vocabulary

DEFAULT_SNAPSHOT = "gpt_snapshot.pt"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = OneLineArgumentParser(
        description="Score a minGPT-DDP snapshot or a GPT-2 model folder on HellaSwag (acc_norm, as llm.c).")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--snapshot", help="a snapshot file, a run's snapshot folder (its newest) or a "
                       f"sharded_<step> folder; local or any fsspec URL (default: {DEFAULT_SNAPSHOT})")
    model.add_argument("--model-folder", help="a Hugging Face GPT-2 model folder (config.json, "
                       "model.safetensors, tokenizer.json), as gpt_config.init_from takes")
    parser.add_argument("--data", default="hellaswag_val.jsonl",
                        help=f"HellaSwag's validation file, downloaded by you from {SOURCE} "
                             "(default: hellaswag_val.jsonl)")
    parser.add_argument("--limit", type=int, default=0,
                        help="score the file's first N items only (default: all)")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to run (default: cuda if available, else cpu)")
    args = parser.parse_args(argv)
    if args.limit < 0:
        raise MinGPTError(f"--limit: must not be negative (0: all), got {args.limit}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise MinGPTError("--device cuda: no CUDA device is available here; use --device cpu")
    return args


def load_model(args: argparse.Namespace, device: torch.device) -> tuple[GPT, Vocabulary, str]:
    """The model to score, its vocabulary, and what it is called in the result line."""
    if args.model_folder:
        return (*folder_model(args.model_folder, device, "--model-folder"), args.model_folder)
    return snapshot_model(args.snapshot or DEFAULT_SNAPSHOT, device)


def progress_on_terminal(items: int, per_forward: int) -> Callable[[int], None]:
    """A self-updating count of the items scored on stderr, when it is a terminal (a CPU takes minutes)."""
    def at(batch: int) -> None:
        if sys.stderr.isatty():
            sys.stderr.write(f"\r\033[KHellaSwag: {min(batch * per_forward, items):,} of {items:,} items")
            sys.stderr.flush()
    return at


def evaluate(args: argparse.Namespace) -> tuple[HellaSwag, Score, str]:
    device = torch.device(args.device)
    model, vocabulary, name = load_model(args, device)
    hellaswag = read(args.data, vocabulary, model.config.block_size, args.limit)
    score = hellaswag.score(lambda ids: model(ids)[0], device,
                            at=progress_on_terminal(len(hellaswag.items), hellaswag.items_per_forward))
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
    return hellaswag, score, name


@command
def main(argv: Optional[list[str]] = None) -> None:
    hellaswag, score, name = evaluate(parse_args(argv))
    print(hellaswag.describe())
    print(f"HellaSwag accuracy {score.accuracy:.4f} ({score.correct:,} of {score.items:,} items right; "
          f"acc_norm, completion-normalised) for {name}")


if __name__ == "__main__":
    main()
