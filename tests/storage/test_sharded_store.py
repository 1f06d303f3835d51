"""Sharded snapshots: each rank writes its shard (torch.distributed.checkpoint); real 2-process runs.

The runs go through tests/workers/full_state_probe.py, which writes the full state (gathered from every
rank) when a snapshot is saved and when one is restored: what was restored is compared, bitwise,
with what was saved.
"""
import os
import pickle
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from helpers import (
    MINGPT,
    WORKER_SCRIPTS,
    RunsCode,
    assert_ok,
    one_error_line,
    run_main,
    run_main_in_process,
    sha256,
    tiny_overrides,
)
from state_equality import assert_same_state

from mingpt.storage.snapshot import read_snapshot

SHARDED = {"trainer_config__snapshot_format": "sharded"}
FULL_STATE_PROBE = WORKER_SCRIPTS / "full_state_probe.py"
SAVED_STEP = 85  # one epoch of the tiny run on 2 ranks


def train(text_file, folder, method, full_state, epochs=1, nproc=2, **extra):
    """main.py with sharded snapshots in folder; the full state at each save and resume lands in
    full_state (see tests/workers/full_state_probe.py)."""
    full_state.mkdir(exist_ok=True)
    overrides = tiny_overrides(text_file, folder, trainer_config__distributed_method=method,
                               trainer_config__max_epochs=epochs, **SHARDED, **extra)
    result = run_main(overrides, nproc=nproc if nproc > 1 else None, script=FULL_STATE_PROBE,
                      env={"FULL_STATE_DIR": str(full_state)})
    assert_ok(result)
    return result


def full_state(folder, kind, step=SAVED_STEP) -> dict:
    return torch.load(folder / f"{kind}_{step:09d}.pt", weights_only=True)


@pytest.fixture(scope="module")
def sharded_run(text_file, tmp_path_factory):
    """A folder of sharded snapshots from one FSDP epoch on 2 ranks, and the full state it saved."""
    root = tmp_path_factory.mktemp("sharded")
    train(text_file, root / "run", "fsdp", root / "full_state")
    return root / "run"


@pytest.fixture(scope="module")
def saved(sharded_run):
    """The full model and optimizer state as it was when the sharded snapshot was saved."""
    return full_state(sharded_run.parent / "full_state", "saved")


def assert_restored(restored, saved):
    assert_same_state(restored["model"], saved["model"], "model")
    assert_same_state(restored["optimizer"], saved["optimizer"], "optimizer")


@pytest.mark.slow
def test_each_rank_writes_its_shard_and_rank_zero_completes_it(sharded_run):
    entry = sharded_run / "sharded_000000085"
    names = sorted(os.listdir(entry))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "info.pt"]
    info = read_snapshot(str(entry / "info.pt"))
    assert info.finished_epoch == 1 and info.model_state == {}  # tensors live in the shards


@pytest.mark.slow
def test_resumes_the_saved_values_at_the_same_world_size(sharded_run, saved, text_file, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(sharded_run, folder)
    result = train(text_file, folder, "fsdp", tmp_path / "full_state", epochs=2,
                   trainer_config__max_steps=SAVED_STEP + 2)  # two steps of the second epoch
    assert "Resuming training from snapshot at Epoch 1" in result.stdout
    assert_restored(full_state(tmp_path / "full_state", "restored"), saved)
    assert (folder / f"sharded_{SAVED_STEP + 2:09d}" / "info.pt").exists()


@pytest.mark.slow
def test_resumes_at_another_world_size_never_from_an_interrupted_save(sharded_run, saved, text_file,
                                                                      tmp_path):
    """One DDP process resumes FSDP's 2 shards, past a newer folder whose shards were being written
    (one cut short) and that has no info.pt yet."""
    folder = tmp_path / "run"
    shutil.copytree(sharded_run, folder)
    interrupted = folder / "sharded_000000100"
    shutil.copytree(folder / "sharded_000000085", interrupted, ignore=shutil.ignore_patterns("info.pt"))
    shard = interrupted / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    result = train(text_file, folder, "ddp", tmp_path / "full_state", epochs=2, nproc=1,
                   trainer_config__max_steps=SAVED_STEP + 2)
    assert "Resuming training from snapshot at Epoch 1" in result.stdout
    assert_restored(full_state(tmp_path / "full_state", "restored"), saved)
    assert (folder / f"sharded_{SAVED_STEP + 2:09d}" / "info.pt").exists()


@pytest.mark.slow
def test_converts_to_a_single_file_of_the_saved_values_that_resumes(sharded_run, saved, text_file, tmp_path,
                                                                     capsys, one_torch_thread):
    """Given the run's folder (its newest complete snapshot, sharded_000000085, is converted); then
    generate.py reads the run folder itself and writes what it writes from the converted file."""
    single = tmp_path / "converted.pt"
    converted = subprocess.run([sys.executable, MINGPT / "convert_snapshot.py", sharded_run, single],
                               capture_output=True, text=True)
    assert converted.returncode == 0, converted.stderr
    assert converted.stdout == f"wrote {single} (from {sharded_run / 'sharded_000000085'})\n"
    from mingpt import generate

    written = [generate.generate(generate.parse_args(["--snapshot", str(path), "--length", "40"]))
               for path in (sharded_run, single)]
    assert written[0] == written[1] and len(written[0]) == 41
    snapshot = read_snapshot(str(single))
    assert snapshot.finished_epoch == 1
    assert_restored({"model": snapshot.model_state, "optimizer": snapshot.optimizer_state}, saved)
    # Resumed by one process here, in this one, for a step (the world size is the resume's own choice)
    result = run_main_in_process(tiny_overrides(text_file, single, trainer_config__max_steps=SAVED_STEP + 1),
                                 capsys)
    assert_ok(result)
    assert "Resuming training from snapshot at Epoch 1" in result.stdout
    assert read_snapshot(str(single)).step == SAVED_STEP + 1



@pytest.mark.slow
def test_a_complete_snapshot_with_a_damaged_shard_is_refused_naming_the_one_before(sharded_run, text_file,
                                                                                    tmp_path, capsys):
    """A shard cut short after its folder was completed (a disk that lost its tail): one line with
    the cause and the snapshot to fall back to, and nothing rewritten."""
    folder = tmp_path / "run"
    shutil.copytree(sharded_run, folder)
    damaged = folder / "sharded_000000090"
    shutil.copytree(folder / "sharded_000000085", damaged)
    shard = damaged / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    before = sha256(shard)
    overrides = tiny_overrides(text_file, folder, trainer_config__max_epochs=2, **SHARDED)
    line = one_error_line(run_main_in_process(overrides, capsys))
    assert line.startswith(f"error: sharded snapshot {damaged} cannot be loaded (RuntimeError: "), line
    assert line.endswith(f"move it away (the run then resumes from {folder / 'sharded_000000085'}) or set "
                         "trainer_config.snapshot_path to another location"), line
    assert sha256(shard) == before


@pytest.mark.slow
def test_metadata_that_would_run_code_is_refused(sharded_run, text_file, tmp_path, capsys):
    folder = tmp_path / "run"
    shutil.copytree(sharded_run, folder)
    metadata = folder / "sharded_000000085" / ".metadata"
    metadata.write_bytes(pickle.dumps(RunsCode(tmp_path / "executed")))
    before = sha256(metadata)
    overrides = tiny_overrides(text_file, folder, trainer_config__max_epochs=2, **SHARDED)
    result = run_main_in_process(overrides, capsys)
    line = one_error_line(result)
    assert "sharded snapshot" in line and "cannot be loaded" in line and "refusing posix.system" in line
    assert not (tmp_path / "executed").exists() and sha256(metadata) == before


def test_a_second_save_at_the_same_step_rewrites_info_only(world_of_one, tmp_path, monkeypatch):
    """The epoch's snapshot right after a step snapshot of the same step: the shards are already
    there, so only info.pt is written again. Rewriting them in place would leave, if the process were
    killed meanwhile, half-written shards in a folder whose info.pt marks it complete."""
    from mingpt.model import GPT, GPTConfig
    from mingpt.storage import sharded_store as sharded_snapshot
    from mingpt.storage.snapshot import Snapshot

    config = GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=4, block_size=4)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters())
    store = sharded_snapshot.ShardedSnapshotStore(str(tmp_path), keep_last=2)
    info = Snapshot(step=7, epoch_step=7, vocab=list("abcd"), model_config=vars(config))
    store.save(model, optimizer, info, is_main=True)
    shard_writes = []
    monkeypatch.setattr(sharded_snapshot.dcp, "save", lambda *args, **kwargs: shard_writes.append(args))
    store.save(model, optimizer, replace(info, finished_epoch=1, epoch_step=0), is_main=True)
    assert shard_writes == [], "the shards of step 7 were written again, in place"
    written = read_snapshot(str(tmp_path / "sharded_000000007" / "info.pt"))
    assert (written.finished_epoch, written.epoch_step) == (1, 0)


def test_each_rank_stages_and_writes_only_its_share_of_what_every_rank_holds(world_of_one):
    """Under DDP every rank holds the whole state: each stages and writes a part of about equal bytes,
    the parts together the whole state, once. A shard (DTensor) is its own rank's on every rank."""
    from torch.distributed.fsdp import fully_shard

    from mingpt.storage.sharded_store import rank_share

    sizes = {"a": 100, "b": 70, "c": 40, "d": 30, "e": 20, "f": 1}
    state = {"model": {name: torch.zeros(size) for name, size in sizes.items()},
             "optimizer": {"a": {"exp_avg": torch.zeros(100), "step": torch.zeros(())}}}
    shares = [rank_share(state, rank, world_size=2) for rank in range(2)]

    def leaves(share, path=()):
        for key, value in share.items():
            yield from leaves(value, (*path, key)) if isinstance(value, dict) else [((*path, key), value)]

    owned = [dict(leaves(share)) for share in shares]
    assert owned[0].keys().isdisjoint(owned[1].keys())
    assert owned[0].keys() | owned[1].keys() == dict(leaves(state)).keys()
    assert all(value is dict(leaves(state))[path] for part in owned for path, value in part.items())
    part_bytes = [sum(t.numel() * t.element_size() for t in part.values()) for part in owned]
    assert abs(part_bytes[0] - part_bytes[1]) <= 100 * 4  # within the largest tensor
    assert rank_share(state, 0, world_size=1) == state
    shard = fully_shard(torch.nn.Linear(4, 4)).weight  # a DTensor: this rank's part, kept by it
    assert all(rank_share({"w": shard}, rank, world_size=2) == {"w": shard} for rank in range(2))


@pytest.mark.slow
def test_a_sharded_snapshot_exports_to_a_hugging_face_folder_with_its_logits(sharded_run, saved, tmp_path,
                                                                             one_torch_thread):
    transformers = pytest.importorskip("transformers")
    from mingpt import export_hf
    from mingpt.generate import build_model

    entry = sharded_run / "sharded_000000085"
    export_hf.main([str(sharded_run), str(tmp_path / "hf")])  # the run's folder: its newest, entry
    info = read_snapshot(str(entry / "info.pt"))
    ours = build_model(replace(info, model_state=saved["model"]), str(entry), torch.device("cpu"))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.arange(2 * ours.config.block_size).view(2, -1) % ours.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids)[0], rtol=0, atol=1e-5)
