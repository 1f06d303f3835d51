"""Sharded snapshots: each rank writes its shard (torch.distributed.checkpoint); real 2-process runs."""
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from helpers import MINGPT, RunsCode, run_main, sha256, tiny_overrides
from snapshot import read_snapshot
from test_main import one_error_line
from test_parallel import train

SHARDED = {"trainer_config__snapshot_format": "sharded"}


@pytest.fixture(scope="module")
def sharded_run(text_file, tmp_path_factory):
    """A folder of sharded snapshots from one FSDP epoch on 2 ranks."""
    folder = tmp_path_factory.mktemp("sharded") / "run"
    train(text_file, folder, "fsdp", **SHARDED)
    return folder


def test_each_rank_writes_its_shard_and_rank_zero_completes_it(sharded_run):
    entry = sharded_run / "sharded_000000085"
    names = sorted(os.listdir(entry))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "info.pt"]
    info = read_snapshot(str(entry / "info.pt"))
    assert info.finished_epoch == 1 and info.model_state == {}  # tensors live in the shards


@pytest.mark.parametrize("method, nproc", [("fsdp", 2), ("ddp", 1)])
def test_resumes_at_the_same_and_another_world_size(sharded_run, text_file, tmp_path, method, nproc):
    folder = tmp_path / "run"
    shutil.copytree(sharded_run, folder)
    result = train(text_file, folder, method, epochs=2, nproc=nproc, **SHARDED)
    assert "Resuming training from snapshot at Epoch 1" in result.stdout
    steps = 85 if nproc == 2 else 169  # the second epoch: 2 ranks or 1 rank of 32-sample batches
    assert (folder / f"sharded_{85 + steps:09d}" / "info.pt").exists()


def test_converts_to_a_single_file_that_resumes(sharded_run, text_file, tmp_path):
    single = tmp_path / "converted.pt"
    newest = sharded_run / "sharded_000000085"
    converted = subprocess.run([sys.executable, MINGPT / "sharded_snapshot.py", newest, single],
                               capture_output=True, text=True)
    assert converted.returncode == 0, converted.stderr
    snapshot = read_snapshot(str(single))
    assert snapshot.finished_epoch == 1 and "blocks.0.attn.qkv.weight" in snapshot.model_state
    assert len(snapshot.optimizer_state["state"]) == len(snapshot.model_state)
    result = train(text_file, single, "ddp", epochs=2)
    assert "Resuming training from snapshot at Epoch 1" in result.stdout



def test_metadata_that_would_run_code_is_refused(sharded_run, text_file, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(sharded_run, folder)
    metadata = folder / "sharded_000000085" / ".metadata"
    metadata.write_bytes(pickle.dumps(RunsCode(tmp_path / "executed")))
    before = sha256(metadata)
    result = run_main(tiny_overrides(text_file, folder, trainer_config__max_epochs=2, **SHARDED))
    line = one_error_line(result)
    assert "sharded snapshot" in line and "cannot be loaded" in line and "refusing posix.system" in line
    assert not (tmp_path / "executed").exists() and sha256(metadata) == before
