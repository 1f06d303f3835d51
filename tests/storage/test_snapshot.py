"""storage/snapshot.py: what a snapshot is, written atomically (a save that dies half-way leaves the
previous one) to a path or any fsspec URL, read as tensors only (a file that would run code, or is
corrupt, refused untouched), checked against the model and vocabulary it resumes, and found as the
newest in a folder. The stores that write it: test_store.py, test_sharded_store.py."""
import os
import pickle
from dataclasses import asdict

import pytest
import torch
from helpers import RunsCode, sha256
from helpers import small_snapshot as snapshot

from mingpt.common.errors import SnapshotError
from mingpt.storage.snapshot import newest_snapshot, read_snapshot, write_snapshot


def test_round_trip(tmp_path):
    path = str(tmp_path / "sub" / "snap.pt")  # the folder is created
    write_snapshot(snapshot(2), path)
    loaded = read_snapshot(path)
    assert loaded.finished_epoch == 2 and loaded.vocab == list("abc")
    assert torch.equal(loaded.model_state["w"], torch.full((3,), 2.0))
    assert loaded.optimizer_state["param_groups"][0]["betas"] == (0.9, 0.95)


def test_round_trip_through_an_fsspec_url():
    write_snapshot(snapshot(4), "memory://bucket/snap.pt")
    assert read_snapshot("memory://bucket/snap.pt").finished_epoch == 4


def test_missing_snapshot_is_none(tmp_path):
    assert read_snapshot(str(tmp_path / "absent.pt")) is None


def test_a_save_that_dies_half_way_leaves_the_previous_snapshot(tmp_path, monkeypatch):
    path = tmp_path / "snap.pt"
    write_snapshot(snapshot(1), str(path))
    before = sha256(path)

    def dies_half_way(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(SnapshotError, match="could not write snapshot"):
        write_snapshot(snapshot(2), str(path))
    assert sha256(path) == before
    assert os.listdir(tmp_path) == ["snap.pt"]  # no temporary left behind
    monkeypatch.undo()
    assert read_snapshot(str(path)).finished_epoch == 1


@pytest.mark.parametrize("content", [b"", b"garbage bytes", b"PK\x03\x04truncated zip"])
def test_corrupt_snapshot_is_refused_and_untouched(tmp_path, content):
    path = tmp_path / "snap.pt"
    path.write_bytes(content)
    with pytest.raises(SnapshotError, match="cannot be loaded"):
        read_snapshot(str(path))
    assert path.read_bytes() == content


def test_a_snapshot_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "executed"
    path = tmp_path / "snap.pt"
    torch.save({**asdict(snapshot()), "model_state": RunsCode(marker)}, path, pickle_module=pickle)
    before = sha256(path)
    with pytest.raises(SnapshotError, match="cannot be loaded"):
        read_snapshot(str(path))
    assert not marker.exists()
    assert sha256(path) == before


def test_a_file_that_is_not_a_snapshot_is_refused(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(SnapshotError, match="not a minGPT-DDP snapshot"):
        read_snapshot(str(path))


def test_a_snapshot_from_before_a_field_existed_loads_with_its_default_and_an_unknown_field_is_refused(
        tmp_path):
    older, other = tmp_path / "older.pt", tmp_path / "other.pt"
    state = snapshot(1).as_dict()
    del state["tracked_runs"]  # snapshots written before run trackers
    torch.save(state, older)
    assert read_snapshot(str(older)).tracked_runs == {}
    torch.save({**state, "weights": torch.zeros(2)}, other)
    with pytest.raises(SnapshotError, match="not a minGPT-DDP snapshot"):
        read_snapshot(str(other))


def test_the_tracked_runs_travel_with_the_snapshot_but_are_no_part_of_the_position(tmp_path):
    tracked = snapshot(1)
    tracked.tracked_runs = {"wandb": "a1b2c3d4"}
    write_snapshot(tracked, str(tmp_path / "snap.pt"))
    loaded = read_snapshot(str(tmp_path / "snap.pt"))
    assert loaded.tracked_runs == {"wandb": "a1b2c3d4"}
    assert loaded.progress == snapshot(1).progress  # ranks that know no run ids agree on where they are


def test_a_snapshot_of_another_model_or_vocabulary_is_refused():
    saved = snapshot(n_layer=2)
    config = dict(saved.model_config)
    saved.check_matches(config, list("abc"), "p")
    with pytest.raises(SnapshotError, match=r"another model: n_layer=2 \(config: 3\)"):
        saved.check_matches({**config, "n_layer": 3}, list("abc"), "p")
    with pytest.raises(SnapshotError, match="another vocabulary"):
        saved.check_matches(config, list("abd"), "p")
    with pytest.raises(SnapshotError, match="another vocabulary"):  # the same tokens of another BPE
        saved.check_matches(config, list("abc"), "p", tokenizer='{"model": {"type": "BPE"}}')


def test_a_snapshot_of_before_a_model_key_was_built_as_that_key_s_older_default(tmp_path):
    """Written without activation and vocab_multiple: GELU exact, and no vocabulary padding."""
    written = snapshot()
    del written.model_config["activation"], written.model_config["vocab_multiple"]
    write_snapshot(written, str(tmp_path / "old.pt"))
    old = read_snapshot(str(tmp_path / "old.pt"))
    assert old.model_config["activation"] == "gelu" and old.model_config["vocab_multiple"] == 1
    config = {**old.model_config, "activation": "gelu_tanh", "vocab_multiple": 64}
    with pytest.raises(SnapshotError, match=r"another model: vocab_multiple=1 \(config: 64\), "
                                            r"activation=gelu \(config: gelu_tanh\)"):
        old.check_matches(config, list("abc"), "p")


def test_rng_states_and_progress_round_trip(tmp_path):
    saved = snapshot(step=7)
    write_snapshot(saved, str(tmp_path / "s.pt"))
    loaded = read_snapshot(str(tmp_path / "s.pt"))
    assert torch.equal(loaded.rng_states[0]["cpu"], saved.rng_states[0]["cpu"])
    assert loaded.progress.step == 7 and loaded.progress.finished_epoch == 1


def test_a_snapshot_folder_that_vanishes_while_listed_holds_no_snapshots():
    """On an object store, rank 0's write probe makes the folder exist for a moment: another rank
    may see it exist, then find nothing to list. That is an empty folder, not an error."""
    from fsspec import register_implementation
    from fsspec.implementations.memory import MemoryFileSystem

    class ProbedFolder(MemoryFileSystem):
        protocol = "probed"

        def exists(self, path, **kwargs):
            return True  # asked while the probe object was there; listed once it had gone

    register_implementation("probed", ProbedFolder, clobber=True)
    assert newest_snapshot("probed://bucket/run/") == (None, None)
