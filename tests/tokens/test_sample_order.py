"""sample_order.py: what decides a run's samples and their order, kept in its snapshots, and a
resume on other data refused in one line unless asked for (then a new epoch of the new order)."""
import numpy as np
import pytest
import torch
from types import SimpleNamespace

from helpers import one_error_line, run_main_in_process, sha256, tiny_overrides

from mingpt.tokens.sample_order import SampleOrder, fingerprint, split_of


def order(**changed) -> SampleOrder:
    settings = dict(tokens="6,000 tokens, 0123456789ab", split="random 0.9", block_size=16,
                    consecutive_windows=False, seed=1337)
    return SampleOrder(**{**settings, **changed})


def test_what_changed_is_named_by_its_keys():
    recorded = order().as_dict()
    assert order().changes_from(recorded) == []
    assert order(split="contiguous 0.9", seed=7).changes_from(recorded) == [
        "the split (data_config.split, data_config.train_split, data_config.val_path): random 0.9 -> contiguous 0.9",
        "trainer_config.seed: 1337 -> 7",
    ]
    assert order(seed=7).changes_from({}) == []  # a snapshot written before orders were kept: not judged


def test_the_fingerprint_tells_texts_apart_by_their_ends_and_shards_by_their_names_and_sizes():
    ids = np.arange(200_000, dtype=np.uint16)
    middle_changed = ids.copy()
    middle_changed[100_000] += 1
    assert fingerprint(ids).startswith("200,000 tokens, ")
    assert fingerprint(ids) == fingerprint(middle_changed)  # cheap: the ends only
    assert fingerprint(ids) != fingerprint(ids[:-1]) != fingerprint(ids[1:])
    shard = SimpleNamespace(url=None, path="/data/fineweb_train_000001.bin", n_tokens=100)
    moved = SimpleNamespace(url="s3://bucket/fineweb_train_000001.bin", path="/cache/x", n_tokens=100)
    assert fingerprint(Stream([shard])) == fingerprint(Stream([moved]))  # where they lie is not what they are
    assert fingerprint(Stream([shard])) != fingerprint(Stream([SimpleNamespace(**{**vars(shard), "n_tokens": 99})]))
    assert split_of("random", 0.9, None) == "random 0.9" and split_of("random", 0.9, "val.bin") == "all of path"


class Stream:
    """A ShardStream as the fingerprint sees it: its shards, and its length."""

    def __init__(self, shards):
        self.shards = shards

    def __len__(self) -> int:
        return sum(shard.n_tokens for shard in self.shards)


@pytest.fixture
def six_steps(text_file, tmp_path, capsys, one_torch_thread):
    """A run stopped at step 6, in the middle of its first epoch (a step budget)."""
    snapshot = tmp_path / "snap.pt"
    result = run_main_in_process(tiny_overrides(text_file, snapshot, trainer_config__max_steps=6), capsys)
    assert result.returncode == 0, result.stderr
    assert torch.load(snapshot, weights_only=True)["sample_order"]["split"] == "random 0.9"
    return snapshot


REFUSED = [
    ({"data_config__split": "contiguous"}, "the split (data_config.split, data_config.train_split, "
                                           "data_config.val_path): random 0.9 -> contiguous 0.9"),
    ({"data_config__truncate": 0.5}, "the text or shards (data_config.path, data_config.truncate): 6,000 tokens"),
    ({"trainer_config__seed": 7}, "trainer_config.seed: 1337 -> 7"),
]


def test_a_resume_on_other_data_is_refused_in_one_line_and_the_snapshot_untouched(text_file, six_steps, capsys):
    before = sha256(six_steps)
    for change, named in REFUSED:
        result = run_main_in_process(tiny_overrides(text_file, six_steps, trainer_config__max_steps=12, **change),
                                     capsys)
        said = one_error_line(result)
        assert said.startswith(f"error: snapshot {six_steps} was trained on other data ({named}"), said
        assert said.endswith("set trainer_config.resume_on_other_data=true to go on from its weights with this "
                             "data's order from a new epoch, or set trainer_config.snapshot_path to a new location "
                             "to start afresh"), said
        assert result.returncode == 1 and sha256(six_steps) == before


def test_a_resume_on_other_data_asked_for_starts_a_new_epoch_of_its_order(text_file, six_steps, capsys):
    result = run_main_in_process(tiny_overrides(text_file, six_steps, trainer_config__max_steps=12,
                                                data_config__split="contiguous",
                                                trainer_config__resume_on_other_data=True), capsys)
    assert result.returncode == 0, result.stderr
    assert ("Resuming training from snapshot at Epoch 0 (step 6) on other data (the split (data_config.split, "
            "data_config.train_split, data_config.val_path): random 0.9 -> contiguous 0.9; "
            "trainer_config.resume_on_other_data=true): epoch 2 starts this data's sample order") in result.stdout
    assert "[RANK0] Epoch 2 | Iter 0 |" in result.stdout
    state = torch.load(six_steps, weights_only=True)
    assert (state["step"], state["finished_epoch"], state["sample_order"]["split"]) == (12, 1, "contiguous 0.9")


def test_the_same_data_resumes_as_before(text_file, six_steps, capsys):
    result = run_main_in_process(tiny_overrides(text_file, six_steps, trainer_config__max_steps=12), capsys)
    assert result.returncode == 0, result.stderr
    assert "Resuming training from snapshot at Epoch 0 (step 6, sample 192 of epoch 1)" in result.stdout
