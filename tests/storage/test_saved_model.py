"""storage/saved_model.py: the model a snapshot holds rebuilt to be read, not trained (generate.py's and
hellaswag.py's), and its refusals in one line: no snapshot there, a store that cannot be reached, a
snapshot that does not rebuild a model or whose vocabulary does not fit it, a folder that is no GPT-2
model (named by the command's option). The commands around it: test_generate.py, test_hellaswag.py."""
import dataclasses

import pytest
import torch

from mingpt.common.errors import MinGPTError, SnapshotError
from mingpt.storage.saved_model import build_model, find_snapshot, folder_model, snapshot_model
from mingpt.storage.snapshot import read_snapshot

CPU = torch.device("cpu")


def test_a_snapshot_rebuilds_the_model_it_was_trained_as_in_eval_mode(tiny_epoch):
    model, vocabulary, found = snapshot_model(str(tiny_epoch.snapshot), CPU)
    saved = read_snapshot(str(tiny_epoch.snapshot))
    assert found == str(tiny_epoch.snapshot) and not model.training
    assert {key: getattr(model.config, key) for key in saved.model_config} == saved.model_config
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in saved.model_state.items())
    assert vocabulary.tokens == saved.vocab and vocabulary.decode(vocabulary.encode("the king")) == "the king"


def test_no_snapshot_there_says_how_to_train_one(tmp_path):
    with pytest.raises(SnapshotError, match=r"^no snapshot at .*absent\.pt \(.*\); train one first "
                                            r"\(python mingpt/main.py\) or pass --snapshot PATH$"):
        find_snapshot(str(tmp_path / "absent.pt"))


def test_a_store_that_cannot_be_reached_is_one_line_naming_the_option():
    with pytest.raises(SnapshotError, match=r"^snapshot nosuchstore://bucket/snap\.pt cannot be reached "
                                            r"\(.*\); check --snapshot and its credentials$"):
        find_snapshot("nosuchstore://bucket/snap.pt")


def test_a_snapshot_that_does_not_rebuild_a_model_or_fit_its_vocabulary_is_refused(tiny_epoch):
    saved = read_snapshot(str(tiny_epoch.snapshot))
    other_version = dataclasses.replace(saved, model_config={**saved.model_config, "n_expert": 8})
    rebuilt_by_another_version = (r"^snapshot p does not rebuild a model \(TypeError: .*n_expert.*\); was it "
                                  r"written by another version of minGPT-DDP\?$")
    with pytest.raises(SnapshotError, match=rebuilt_by_another_version):
        build_model(other_version, "p", CPU)
    damaged = dataclasses.replace(saved, vocab=saved.vocab[:-1])
    with pytest.raises(SnapshotError, match=rf"^snapshot p has {len(saved.vocab) - 1} vocabulary tokens for "
                                            rf"a model of vocab_size {len(saved.vocab)}; it is damaged$"):
        build_model(damaged, "p", CPU)


def test_a_folder_that_is_no_gpt2_model_is_refused_naming_the_command_s_option(tmp_path):
    with pytest.raises(MinGPTError, match=r"^--model: .*empty does not exist; ") as refused:
        folder_model(str(tmp_path / "empty"), CPU, "--model")
    assert "gpt_config.init_from" not in str(refused.value)
