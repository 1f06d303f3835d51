"""convert_snapshot.py's refusals (the conversion itself: tests/storage/test_sharded_store.py)."""
import pytest

from mingpt import convert_snapshot


@pytest.mark.parametrize("content", ["nothing", "an interrupted save", "single-file snapshots"])
def test_a_folder_without_a_complete_sharded_snapshot_is_one_line(tmp_path, capsys, content):
    folder = tmp_path / "run"
    folder.mkdir()
    if content == "an interrupted save":
        (folder / "sharded_000000010").mkdir()  # shards being written: no info.pt yet
        (folder / "sharded_000000010" / "__0_0.distcp").write_bytes(b"part")
    elif content == "single-file snapshots":
        (folder / "snapshot_000000010.pt").write_bytes(b"not sharded")
    with pytest.raises(SystemExit) as stop:
        convert_snapshot.main([str(folder), str(tmp_path / "out.pt")])
    assert stop.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: no complete sharded snapshot at {folder}; give the folder of a run with "
        "trainer_config.snapshot_format=sharded, or one of its sharded_<step> folders"]
    assert not (tmp_path / "out.pt").exists()
