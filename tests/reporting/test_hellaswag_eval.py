"""reporting/hellaswag_eval.py: each ending's completion-normalised loss and the model's choices are
those llm.c's way of scoring gives with transformers' logits (a character snapshot exported with
export_hf.py, and a BPE GPT-2 folder), any split over ranks counts what one rank counts in as many
forward passes, and a file that is no HellaSwag file, or that the vocabulary cannot read, is said in
one line. The command: tests/test_hellaswag.py, with the 2-rank run of the training-time evaluation."""
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import hellaswag_items, make_gpt2_folder, make_text, write_hellaswag
from tokenizers import Tokenizer

from mingpt import export_hf
from mingpt.common.errors import DataError
from mingpt.reporting import hellaswag_eval
from mingpt.reporting.hellaswag_eval import ending_losses, read, window
from mingpt.storage.saved_model import folder_model, snapshot_model
from mingpt.storage.snapshot import read_snapshot
from mingpt.tokens.tokenizer import Vocabulary

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")
ITEMS = hellaswag_items(13)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_hellaswag(tmp_path_factory.mktemp("hellaswag") / "hellaswag_val.jsonl", ITEMS)


@pytest.fixture(scope="module")
def character_model(tiny_epoch):
    model, vocabulary, _ = snapshot_model(str(tiny_epoch.snapshot), CPU)
    return model, vocabulary


def reference_losses(model, tokenizer: Tokenizer, item: dict, block_size: int) -> list[float]:
    """llm.c's dev/data/hellaswag.py, with transformers' logits: the context's tokens, then those of
    " " + ending; the mean cross-entropy over the ending's tokens (of a longer sequence, its last
    block_size + 1 tokens, the model reading block_size of them)."""
    context = tokenizer.encode(item["ctx"]).ids
    losses = []
    for text in item["endings"]:
        ending = tokenizer.encode(" " + text).ids
        tokens = torch.tensor(context + ending)[-(block_size + 1):]
        with torch.no_grad():
            logits = model(tokens[None, :-1]).logits[0]  # logits[i] predicts tokens[i + 1]
        scored = min(len(ending), len(tokens) - 1)
        losses.append(F.cross_entropy(logits[-scored:], tokens[-scored:]).item())
    return losses


def check_against_transformers(model, vocabulary, data, folder) -> None:
    """Our losses and choices for each item of data, and llm.c's computed with the folder's model and
    tokenizer loaded by transformers and tokenizers."""
    block_size = model.config.block_size
    items = read(str(data), vocabulary, block_size).items
    ours = ending_losses(items, lambda ids: model(ids)[0], block_size, CPU)
    theirs_model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    theirs = torch.tensor([reference_losses(theirs_model, tokenizer, item, block_size) for item in ITEMS])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    assert ours.argmin(dim=1).tolist() == theirs.argmin(dim=1).tolist()


def test_a_snapshot_chooses_what_its_export_chooses_in_transformers(tiny_epoch, character_model, data,
                                                                     tmp_path):
    folder = tmp_path / "exported"
    export_hf.export(read_snapshot(str(tiny_epoch.snapshot)), folder)
    model, vocabulary = character_model
    assert model.config.block_size == 16  # most items are cut: the cut is checked too
    check_against_transformers(model, vocabulary, data, folder)


def test_a_gpt2_folder_chooses_what_transformers_chooses(data, tmp_path):
    folder = make_gpt2_folder(tmp_path / "gpt2", make_text(20000))
    model, vocabulary = folder_model(str(folder), CPU, "--model-folder")
    assert not vocabulary.is_char and model.config.block_size == 64
    check_against_transformers(model, vocabulary, data, folder)


def test_a_trained_model_prefers_words_to_words_spelt_backwards(character_model, tmp_path):
    model, vocabulary = character_model
    easy = write_hellaswag(tmp_path / "easy.jsonl", ITEMS[::2])  # wrong endings spelt backwards
    score = read(str(easy), vocabulary, model.config.block_size).score(lambda ids: model(ids)[0], CPU)
    assert score.correct == score.items == 7 and score.accuracy == 1.0


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_any_split_over_ranks_counts_what_one_rank_counts_in_as_many_passes(character_model, data,
                                                                           monkeypatch, world_size):
    """The ranks' counts summed (here by the test: all_reduce_sum stands aside) are one rank's, and
    every rank runs as many forward passes (FSDP gathers weights in each, on every rank)."""
    model, vocabulary = character_model
    scoring = read(str(data), vocabulary, model.config.block_size)
    monkeypatch.setattr(hellaswag_eval, "MAX_ITEMS_PER_FORWARD", 2)  # several passes per rank
    monkeypatch.setattr(hellaswag_eval, "all_reduce_sum", lambda totals: totals)
    logits = lambda ids: model(ids)[0]  # noqa: E731
    alone = scoring.score(logits, CPU)
    assert alone.items == len(ITEMS) and 0 < alone.correct < len(ITEMS)
    passes, scores = [], []
    for rank in range(world_size):
        seen = []
        scores.append(scoring.score(logits, CPU, rank, world_size, at=seen.append))
        passes.append(len(seen))
    assert sum(score.correct for score in scores) == alone.correct
    assert sum(score.items for score in scores) == len(ITEMS)
    assert len(set(passes)) == 1, passes


def test_a_long_sequence_keeps_its_last_tokens():
    assert window((1, 2, 3), (4, 5), block_size=8) == ([1, 2, 3, 4, 5], 2)
    assert window((1, 2, 3), (4, 5), block_size=3) == ([2, 3, 4, 5], 2)
    assert window((1, 2, 3), (4, 5, 6, 7, 8), block_size=3) == ([5, 6, 7, 8], 3)  # its first 2 not predicted


def test_an_item_with_a_character_the_model_never_saw_is_skipped_and_counted(tmp_path):
    vocabulary = Vocabulary(sorted(set("the king of love.")))
    items = [{"ctx": "the king", "endings": ["of love", "love", "of", "the"], "label": 0},
             {"ctx": "the queen", "endings": ["of love", "love", "of", "[title]"], "label": 1},
             {"ctx": "the king", "endings": ["of love", "love", "of", "the"], "label": 2}]
    scoring = read(str(write_hellaswag(tmp_path / "h.jsonl", items)), vocabulary, block_size=8)
    assert len(scoring.items) == 2 and scoring.skipped == 1
    assert scoring.unknown == ("q", "u", "[", "]")
    assert scoring.describe() == (f"HellaSwag: 2 items of {tmp_path / 'h.jsonl'}; 1 skipped for characters "
                                  "the model never saw ('q', 'u', '[', ']'); 2 longer than block_size 8, "
                                  "scored on their last 8 tokens")
    assert [item.label for item in scoring.items] == [0, 2]
    assert len(read(str(tmp_path / "h.jsonl"), vocabulary, 8, limit=1).items) == 1


def test_a_file_the_vocabulary_cannot_read_at_all_is_refused(tmp_path):
    item = {"ctx": "[x]", "endings": ["1", "2", "3", "4"], "label": 0}
    path = write_hellaswag(tmp_path / "h.jsonl", [item])
    with pytest.raises(DataError, match=r"^--data: none of the 1 items of .* can be scored: the model never "
                                        r"saw the characters '\[', 'x', '\]', '1', '2', '3', '4'; "):
        read(str(path), Vocabulary(list("abc ")), block_size=8)


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"endings": ["a"] * 4, "label": 0}), "no ctx text"),
    (json.dumps({"ctx": "a", "endings": ["a"] * 3, "label": 0}), "endings is not a list of 4 strings"),
    (json.dumps({"ctx": "a", "endings": ["a"] * 4, "label": 4}), "label is not 0 to 3"),
    (json.dumps({"ctx": "a", "endings": ["a"] * 4, "label": True}), "label is not 0 to 3"),
])
def test_a_line_that_is_no_hellaswag_item_is_named(tmp_path, line, problem):
    good = json.dumps({"ctx": "a", "endings": ["a"] * 4, "label": 0})
    path = tmp_path / "h.jsonl"
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(DataError, match=rf"^--data: {path} line 3 is not a HellaSwag item \({problem}\); "
                                        r"give HellaSwag's hellaswag_val.jsonl \(https://github.com/rowanz/"):
        read(str(path), Vocabulary(list("a ")), block_size=8)


def test_a_missing_file_says_where_hellaswag_comes_from(tmp_path):
    with pytest.raises(DataError, match=r"^trainer_config.hellaswag_path: no such file .*; download "
                                        r"HellaSwag's validation file from https://github.com/rowanz/"
                                        r"hellaswag \(data/hellaswag_val.jsonl\)"):
        read(str(tmp_path / "nothing.jsonl"), Vocabulary(list("a ")), 8, key="trainer_config.hellaswag_path")


def test_scoring_is_due_at_its_cadence_and_once_at_the_runs_last_step():
    keys = hellaswag_eval.HellaSwagKeys(hellaswag_path="hellaswag_val.jsonl", hellaswag_every_steps=50)
    assert [step for step in range(1, 151) if keys.hellaswag_due(step, scored_at=None)] == [50, 100, 150]
    assert keys.hellaswag_due(173, scored_at=150, run_ended=True)
    assert not keys.hellaswag_due(150, scored_at=150, run_ended=True)  # its last step scored at the cadence
    assert [step for step in range(1, 151) if hellaswag_eval.HellaSwagKeys(hellaswag_path="h.jsonl")
            .hellaswag_due(step, scored_at=None)] == []  # every 0: the last step only
    assert not hellaswag_eval.HellaSwagKeys().hellaswag_due(150, scored_at=None, run_ended=True)  # off
