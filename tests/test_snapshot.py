import os
import pickle
from dataclasses import asdict

import pytest
import torch

from errors import SnapshotError
from helpers import sha256
from snapshot import Snapshot, load_snapshot, save_snapshot


def snapshot(epoch: int = 1, n_layer: int = 2) -> Snapshot:
    return Snapshot(
        model_state={"w": torch.full((3,), float(epoch))},
        optimizer_state={"state": {}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}]},
        finished_epoch=epoch,
        scaler_state={},
        vocab=list("abc"),
        model_config={"n_layer": n_layer, "n_head": 2, "n_embd": 8, "vocab_size": 3, "block_size": 4},
    )


def test_round_trip(tmp_path):
    path = str(tmp_path / "sub" / "snap.pt")  # the folder is created
    save_snapshot(snapshot(2), path)
    loaded = load_snapshot(path)
    assert loaded.finished_epoch == 2 and loaded.vocab == list("abc")
    assert torch.equal(loaded.model_state["w"], torch.full((3,), 2.0))
    assert loaded.optimizer_state["param_groups"][0]["betas"] == (0.9, 0.95)


def test_round_trip_through_an_fsspec_url():
    save_snapshot(snapshot(4), "memory://bucket/snap.pt")
    assert load_snapshot("memory://bucket/snap.pt").finished_epoch == 4


def test_missing_snapshot_is_none(tmp_path):
    assert load_snapshot(str(tmp_path / "absent.pt")) is None


def test_a_save_that_dies_half_way_leaves_the_previous_snapshot(tmp_path, monkeypatch):
    path = tmp_path / "snap.pt"
    save_snapshot(snapshot(1), str(path))
    before = sha256(path)

    def dies_half_way(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(SnapshotError, match="could not write snapshot"):
        save_snapshot(snapshot(2), str(path))
    assert sha256(path) == before
    assert os.listdir(tmp_path) == ["snap.pt"]  # no temporary left behind
    monkeypatch.undo()
    assert load_snapshot(str(path)).finished_epoch == 1


@pytest.mark.parametrize("content", [b"", b"garbage bytes", b"PK\x03\x04truncated zip"])
def test_corrupt_snapshot_is_refused_and_untouched(tmp_path, content):
    path = tmp_path / "snap.pt"
    path.write_bytes(content)
    with pytest.raises(SnapshotError, match="cannot be loaded"):
        load_snapshot(str(path))
    assert path.read_bytes() == content


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_snapshot_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "executed"
    _RunsCode.marker = marker
    path = tmp_path / "snap.pt"
    torch.save({**asdict(snapshot()), "model_state": _RunsCode()}, path, pickle_module=pickle)
    before = sha256(path)
    with pytest.raises(SnapshotError, match="cannot be loaded"):
        load_snapshot(str(path))
    assert not marker.exists()
    assert sha256(path) == before


def test_a_file_that_is_not_a_snapshot_is_refused(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(SnapshotError, match="not a minGPT-DDP snapshot"):
        load_snapshot(str(path))


def test_a_snapshot_of_another_model_or_vocabulary_is_refused():
    saved = snapshot(n_layer=2)
    config = dict(saved.model_config)
    saved.check_matches(config, list("abc"), "p")
    with pytest.raises(SnapshotError, match=r"another model: n_layer=2 \(config: 3\)"):
        saved.check_matches({**config, "n_layer": 3}, list("abc"), "p")
    with pytest.raises(SnapshotError, match="another vocabulary"):
        saved.check_matches(config, list("abd"), "p")
