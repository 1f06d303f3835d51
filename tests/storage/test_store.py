"""storage/store.py's single-file store (FullStateStore): a folder of snapshots keeps the newest
keep_last and resumes from the newest, a file is replaced whole and written by rank 0 alone, and
tensors that do not fit the model and optimizer are refused with the file untouched. (What a snapshot
is and how it is written and read: test_snapshot.py; the stores' copies kept around a divergence:
test_checkpointer.py.)"""
import os
import re

import pytest
import torch
from helpers import sha256
from helpers import small_snapshot as snapshot

from mingpt.common.errors import SnapshotError
from mingpt.storage.snapshot import newest_snapshot
from mingpt.storage.store import FullStateStore


@pytest.fixture
def model_and_optimizer(world_of_one):
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters())


def test_folder_store_keeps_the_newest_and_resumes_from_the_newest(tmp_path, model_and_optimizer):
    store = FullStateStore(str(tmp_path / "run"), keep_last=2)
    assert store.is_folder and newest_snapshot(store.path) == (None, None)
    for step in (5, 10, 15):
        store.save(*model_and_optimizer, snapshot(step=step), is_main=True)
    (tmp_path / "run" / "snapshot_000000020.pt.tmp-1234abcd").write_bytes(b"an interrupted save")
    assert sorted(p.name for p in (tmp_path / "run").glob("*.pt")) == ["snapshot_000000010.pt",
                                                                        "snapshot_000000015.pt"]
    latest, path = newest_snapshot(store.path)
    assert latest.step == 15 and path.endswith("snapshot_000000015.pt")
    assert set(latest.model_state) == {"weight", "bias"}


def test_file_store_replaces_its_one_file_and_only_rank_zero_writes(tmp_path, model_and_optimizer):
    store = FullStateStore(str(tmp_path / "snap.pt"))
    store.save(*model_and_optimizer, snapshot(step=1), is_main=False)
    assert os.listdir(tmp_path) == []
    store.save(*model_and_optimizer, snapshot(step=1), is_main=True)
    store.save(*model_and_optimizer, snapshot(step=2), is_main=True)
    assert os.listdir(tmp_path) == ["snap.pt"] and newest_snapshot(store.path)[0].step == 2


def stepped(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """After one step, so that AdamW holds state (exp_avg, exp_avg_sq) for every parameter."""
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("alter, reason", [
    (lambda state: state["model_state"].pop("bias"), "the snapshot lacks bias"),
    (lambda state: state["model_state"].update(extra=torch.zeros(1)), "the model has no extra"),
    (lambda state: state["model_state"].update(weight=torch.zeros(3, 2)),
     "the snapshot's weight is (3, 2), the model's (2, 3)"),
    (lambda state: state["optimizer_state"]["state"]["bias"].update(exp_avg=torch.zeros(3)),
     "the snapshot's bias (exp_avg) is (3,), the model's (2,)"),
])
def test_tensors_that_do_not_fit_the_model_are_refused_untouched(tmp_path, model_and_optimizer, alter,
                                                                 reason):
    model, optimizer = stepped(*model_and_optimizer)
    store = FullStateStore(str(tmp_path / "snap.pt"))
    saved = snapshot()
    store.save(model, optimizer, saved, is_main=True)
    assert store.restore(model, optimizer, saved.model_config, saved.vocab)[0].step == saved.step  # fits
    state = torch.load(store.path, weights_only=True)
    alter(state)
    torch.save(state, store.path)
    before = sha256(tmp_path / "snap.pt")
    refusal = f"does not fit this model and optimizer (ValueError: {reason})"
    with pytest.raises(SnapshotError, match=re.escape(refusal)):
        store.restore(model, optimizer, saved.model_config, saved.vocab)
    assert sha256(tmp_path / "snap.pt") == before
