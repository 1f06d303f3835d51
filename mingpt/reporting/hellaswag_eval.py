"""HellaSwag, scored the way GPT-2 reproductions report it (llm.c's dev/data/hellaswag.py, the
HellaSwag paper's acc_norm): the number that compares a model with GPT-2 124M's 29.4%.

HellaSwag (Zellers et al., 2019) gives a context and 4 endings, one of them right. Its validation
file is the user's to fetch: data/hellaswag_val.jsonl of the HellaSwag repository (SOURCE), 10,042
items, one JSON object a line with "ctx", "endings" (4 strings) and "label" (the right one's index).
Nothing is downloaded here.

Each ending is scored after its context, as llm.c renders it: the context's tokens, then those of
" " + ending (encoded apart, as llm.c does: a BPE's tokens of an ending do not depend on the context
before it). Its score is the model's mean cross-entropy over the ending's tokens only (completion-
normalised: a long ending is not penalised for its length, nor the context counted); the model
chooses the lowest, and the accuracy is the share of items where that is the right one.

- A sequence longer than the model's block_size keeps its last tokens: the model reads the last
  block_size of them (the context's first tokens dropped), predicting each of the ending's tokens
  from what precedes it there. HellaSwag's items are short next to GPT-2's 1,024 positions; a
  character model's block_size of 128 cuts most of its contexts.
- A character model cannot read a character it never saw (HellaSwag's text has digits and brackets
  tiny-shakespeare lacks): such an item is skipped and counted, its characters named, and the
  accuracy is over the items scored. A file of which no item can be read is refused.
- Over ranks, rank r scores items r, r + world_size, ... and the counts are summed: the accuracy is
  the same at any world size. Every rank runs as many forward passes (a rank with an item fewer
  scores one again, uncounted): FSDP gathers each block's weights in every pass, on every rank.
"""
import json
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from mingpt.common import files
from mingpt.common.errors import DataError, KeyGroup, check, check_not_negative, short_reason
from mingpt.common.logger import log
from mingpt.distributed.process_group import all_reduce_sum
from mingpt.tokens.tokenizer import UnknownCharacters, Vocabulary

SOURCE = "https://github.com/rowanz/hellaswag (data/hellaswag_val.jsonl)"
"""Where the validation file comes from."""
ENDINGS = 4
LOGITS_PER_FORWARD = 2**25
"""A forward pass scores as many items as keep its logits under this many (128 MB in fp32): one item
at a time for GPT-2 (4 x 1024 x 50,257 logits at most), dozens for a character model."""
MAX_ITEMS_PER_FORWARD = 32
UNKNOWN_SHOWN = 10
"""The unknown characters a message names; more are counted."""

Logits = Callable[[torch.Tensor], torch.Tensor]
"""(B, T) token ids -> (B, T, V) logits: the model's forward pass, in the caller's precision."""


@dataclass(frozen=True)
class Item:
    """One question: its context's token ids, each ending's (" " + ending), the right ending's index."""

    context: tuple[int, ...]
    endings: tuple[tuple[int, ...], ...]
    label: int


@dataclass(frozen=True)
class Score:
    correct: int
    items: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.items if self.items else 0.0


@dataclass(frozen=True)
class HellaSwag:
    """The items of a HellaSwag file that a model's vocabulary reads, ready to score."""

    path: str
    items: list[Item]
    block_size: int
    vocab_size: int
    skipped: int = 0
    """Items with a character the (character) vocabulary lacks."""
    unknown: tuple[str, ...] = ()
    """Those characters, in the order met."""

    @property
    def truncated(self) -> int:
        """Items with an ending whose sequence is longer than the model reads (its first tokens cut)."""
        return sum(any(len(item.context) + len(ending) > self.block_size + 1 for ending in item.endings)
                   for item in self.items)

    @property
    def items_per_forward(self) -> int:
        """The same on every rank (of block_size and vocab_size): the ranks run as many passes."""
        fitting = LOGITS_PER_FORWARD // (ENDINGS * self.block_size * self.vocab_size)
        return max(1, min(MAX_ITEMS_PER_FORWARD, fitting))

    def describe(self) -> str:
        """The items scored, and those skipped or cut: "HellaSwag: 10,042 items of hellaswag_val.jsonl"."""
        notes = [f"HellaSwag: {len(self.items):,} items of {self.path}"]
        if self.skipped:
            notes.append(f"{self.skipped:,} skipped for characters the model never saw "
                         f"({shown(self.unknown)})")
        if self.truncated:
            notes.append(f"{self.truncated:,} longer than block_size {self.block_size}, scored on their last "
                         f"{self.block_size} tokens")
        return "; ".join(notes)

    @torch.no_grad()
    def score(self, logits: Logits, device: torch.device, rank: int = 0, world_size: int = 1,
              at: Callable[[int], None] = lambda batch: None) -> Score:
        """This rank's share of the items scored, the counts summed over the world_size ranks (each
        calls it). at(batch) is told each forward pass before it runs (the hang watchdog's position)."""
        share = self.items[rank::world_size]
        per_rank = -(-len(self.items) // world_size)
        counted = torch.tensor([True] * len(share) + [False] * (per_rank - len(share)), device=device)
        share += [self.items[0]] * (per_rank - len(share))  # scored again, uncounted
        correct = torch.zeros((), dtype=torch.long, device=device)
        step = self.items_per_forward
        for batch, start in enumerate(range(0, per_rank, step)):
            at(batch)
            chunk = share[start:start + step]
            choices = ending_losses(chunk, logits, self.block_size, device).argmin(dim=1)
            labels = torch.tensor([item.label for item in chunk], device=device)
            correct += ((choices == labels) & counted[start:start + step]).sum()
        totals = torch.stack([correct, counted.sum()])
        if world_size > 1:
            all_reduce_sum(totals)
        return Score(*totals.tolist())


def ending_losses(items: Sequence[Item], logits: Logits, block_size: int, device: torch.device
                  ) -> torch.Tensor:
    """(len(items), 4): each ending's mean cross-entropy over its own tokens, after its context; the
    items' 4 x len(items) sequences in one forward pass, padded on the right (causal: the padding
    changes no position before it)."""
    rows = [window(item.context, ending, block_size) for item in items for ending in item.endings]
    width = max(len(tokens) for tokens, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    scored = torch.zeros(len(rows), width - 1, dtype=torch.bool)  # the targets that are the ending's
    for row, (tokens, ending) in enumerate(rows):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        scored[row, len(tokens) - 1 - ending:len(tokens) - 1] = True
    ids, scored = ids.to(device), scored.to(device)
    predicted = logits(ids[:, :-1])[scored].float()  # (scored targets, V): no copy of the others' logits
    losses = F.cross_entropy(predicted, ids[:, 1:][scored], reduction="none")
    row_of = torch.arange(len(rows), device=device).unsqueeze(1).expand_as(scored)[scored]
    sums = torch.zeros(len(rows), device=device).index_add_(0, row_of, losses)
    return (sums / scored.sum(dim=1)).view(len(items), ENDINGS)


def window(context: tuple[int, ...], ending: tuple[int, ...], block_size: int) -> tuple[list[int], int]:
    """The tokens the model reads and predicts (its last block_size + 1: block_size inputs, each
    predicting the next) and how many of the last are the ending's that it predicts."""
    tokens = [*context, *ending][-(block_size + 1):]
    return tokens, min(len(ending), len(tokens) - 1)


# ----------------------------------------------------------------------------------------- reading

def read(path: str, vocabulary: Vocabulary, block_size: int, limit: int = 0,
         key: str = "--data") -> HellaSwag:
    """The first limit items of the file at path (0: all), in the vocabulary's tokens; key: what the
    user set to name the file, which error messages name."""
    lines = read_lines(path, key)
    lines = lines[:limit] if limit else lines
    items, unknown, skipped = [], {}, 0
    for number, line in lines:
        context, endings, label = parse(line, path, number, key)
        try:
            items.append(encode(vocabulary, context, endings, label))
        except UnknownCharacters as missing:
            skipped += 1
            unknown.update(dict.fromkeys(missing.characters))
    if not items:
        raise DataError(f"{key}: none of the {len(lines):,} items of {path} can be scored: the model never "
                        f"saw the characters {shown(tuple(unknown))}; score a model of a wider vocabulary "
                        "(a BPE model reads any text)")
    return HellaSwag(path, items, block_size, len(vocabulary), skipped, tuple(unknown))


def encode(vocabulary: Vocabulary, context: str, endings: list[str], label: int) -> Item:
    """The item in the vocabulary's tokens; UnknownCharacters naming every character of it that a
    character vocabulary lacks."""
    if vocabulary.is_char:
        vocabulary.encode(" ".join([context, *endings]))  # raises, naming them all
    return Item(tuple(vocabulary.encode(context)),
                tuple(tuple(vocabulary.encode(" " + ending)) for ending in endings), label)


def read_lines(path: str, key: str) -> list[tuple[int, str]]:
    """The file's lines that are not blank, numbered from 1."""
    try:
        text = files.read_bytes(path).decode("utf-8")
    except FileNotFoundError:
        raise DataError(f"{key}: no such file {path}; download HellaSwag's validation file from {SOURCE} "
                        "and give its path") from None
    except UnicodeDecodeError:
        raise DataError(f"{key}: {path} is not UTF-8 text; give HellaSwag's hellaswag_val.jsonl") from None
    except Exception as e:
        raise DataError(f"{key}: cannot read {path} ({short_reason(e)}); check the path and its "
                        "permissions") from None
    lines = [(number, line) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise DataError(f"{key}: {path} is empty; give HellaSwag's hellaswag_val.jsonl ({SOURCE})")
    return lines


def parse(line: str, path: str, number: int, key: str) -> tuple[str, list[str], int]:
    """(ctx, endings, label) of one line; DataError naming the line when it is not a HellaSwag item."""
    problem = None
    try:
        item = json.loads(line)
    except ValueError:
        item, problem = None, "not JSON"
    if problem is None:
        problem = item_problem(item)
    if problem:
        raise DataError(f"{key}: {path} line {number} is not a HellaSwag item ({problem}); give "
                        f"HellaSwag's hellaswag_val.jsonl ({SOURCE}): each line has ctx, endings and label")
    return item["ctx"], item["endings"], item["label"]


def item_problem(item) -> Optional[str]:
    """What is wrong with a parsed line, or None."""
    if not isinstance(item, dict):
        return "not a JSON object"
    if not isinstance(item.get("ctx"), str) or not item["ctx"]:
        return "no ctx text"
    endings = item.get("endings")
    if not (isinstance(endings, list) and len(endings) == ENDINGS
            and all(isinstance(ending, str) for ending in endings)):
        return f"endings is not a list of {ENDINGS} strings"
    label = item.get("label")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < ENDINGS:
        return f"label is not 0 to {ENDINGS - 1}"
    return None


def shown(characters: tuple[str, ...]) -> str:
    """A few characters for a message, repr'd (a newline shows as \\n): "'[', ']' and 3 more"."""
    named = ", ".join(map(repr, characters[:UNKNOWN_SHOWN]))
    more = len(characters) - UNKNOWN_SHOWN
    return f"{named} and {more} more" if more > 0 else named


@dataclass
class HellaSwagKeys(KeyGroup):
    """TrainerConfig's HellaSwag keys: scoring during training (hellaswag.py scores a snapshot)."""

    hellaswag_path: Optional[str] = None
    """HellaSwag's validation file, which you download (hellaswag_val.jsonl: docs/observability.md);
    a local path or fsspec URL. Its accuracy (acc_norm, scored as llm.c scores it) is measured after
    the snapshot decision of every hellaswag_every_steps-th step and of the run's last step, the
    items shared out over the ranks, and logged and recorded like the eval loss. null: off."""
    hellaswag_every_steps: int = 0
    """Score HellaSwag every this many optimizer steps (0: at the run's last step only)."""
    hellaswag_items: int = 0
    """Score only the file's first this many items (0: all of them, 10,042 in HellaSwag's)."""

    def __post_init__(self) -> None:
        check_not_negative(self, "trainer_config", "hellaswag_every_steps", "hellaswag_items")
        check(self.hellaswag_path is None or bool(self.hellaswag_path), "trainer_config.hellaswag_path",
              "must not be empty; give HellaSwag's hellaswag_val.jsonl or null")
        super().__post_init__()  # the next group's checks (TrainerConfig's bases)

    def hellaswag_due(self, step: int, scored_at: Optional[int], run_ended: bool = False) -> bool:
        """Whether step's weights are scored: every hellaswag_every_steps-th step, and the run's last
        step unless it was scored already (scored_at: the last step scored)."""
        if self.hellaswag_path is None:
            return False
        every = self.hellaswag_every_steps
        return scored_at != step if run_ended else bool(every) and step % every == 0


def for_run(path: Optional[str], vocab: Sequence[str], block_size: int, limit: int) -> Optional[HellaSwag]:
    """The Trainer's items (trainer_config.hellaswag_path; None: off), read by every rank alike and
    said once."""
    if path is None:
        return None
    hellaswag = read(path, Vocabulary.of(vocab), block_size, limit, key="trainer_config.hellaswag_path")
    log.info(hellaswag.describe())
    return hellaswag
