"""Snapshots a run cannot resume are refused in one line naming the key, never ignored: a folder whose
newest snapshot is of the other format (snapshot_format single against sharded), and a snapshot of
another optimizer (optimizer_config.name adamw against muon), in either format."""
import os
from dataclasses import asdict

import pytest
import torch
from helpers import assert_ok, one_error_line, run_main_in_process, sha256, tiny_overrides

from mingpt.common.errors import SnapshotError
from mingpt.model import GPT, GPTConfig
from mingpt.optimizer import OptimizerConfig, create_optimizer
from mingpt.storage.sharded_store import ShardedSnapshotStore
from mingpt.storage.snapshot import Snapshot
from mingpt.storage.store import FullStateStore

CONFIG = GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=4, block_size=4)
VOCAB = list("abcd")


def trained(optimizer_name: str = "adamw"):
    """The tiny model and its optimizer after one step (every parameter has its optimizer state)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = create_optimizer(model, OptimizerConfig(name=optimizer_name))
    _, loss = model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    loss.backward()
    optimizer.step()
    return model, optimizer


def info(step: int) -> Snapshot:
    return Snapshot(step=step, epoch_step=step, epoch_samples=step, vocab=VOCAB, model_config=asdict(CONFIG))


def store_of(kind: str, folder) -> "FullStateStore | ShardedSnapshotStore":
    return FullStateStore(str(folder), keep_last=2) if kind == "single" else ShardedSnapshotStore(str(folder), 2)


def listing(folder) -> dict[str, str]:
    return {str(path.relative_to(folder)): sha256(path) for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("theirs, ours", [("sharded", "single"), ("single", "sharded")])
def test_a_folder_whose_newest_snapshot_is_of_the_other_format_is_refused_naming_the_key(
        world_of_one, tmp_path, theirs, ours):
    """It said 'Snapshot not found', trained from scratch, and wrote its own format beside the other's.
    Refused, the folder is as it was; once the run's own format holds the newest snapshot, the other
    format's older ones are history and it resumes."""
    model, optimizer = trained()
    folder = tmp_path / "run"
    store_of(theirs, folder).save(model, optimizer, info(8), is_main=True)
    newest = folder / ("sharded_000000008" if theirs == "sharded" else "snapshot_000000008.pt")
    before = listing(folder)
    with pytest.raises(SnapshotError) as refused:
        store_of(ours, folder).restore(model, optimizer, asdict(CONFIG), VOCAB)
    assert str(refused.value) == (
        f"trainer_config.snapshot_format: {folder} holds {theirs} snapshots, the newest {newest} (step 8), and "
        f"this run reads and writes {ours} ones; set trainer_config.snapshot_format={theirs} to resume from it, "
        "or set trainer_config.snapshot_path to another location")
    assert listing(folder) == before
    store_of(ours, folder).save(model, optimizer, info(8), is_main=True)  # converted at the same step
    restored, path = store_of(ours, folder).restore(model, optimizer, asdict(CONFIG), VOCAB)
    assert restored.step == 8 and os.path.basename(path).startswith("sharded" if ours == "sharded" else "snapshot")


@pytest.mark.parametrize("kind", ["single", "sharded"])
@pytest.mark.parametrize("saved_with, resumed_with", [("adamw", "muon"), ("muon", "adamw")])
def test_a_snapshot_of_another_optimizer_is_refused_naming_the_key(world_of_one, tmp_path, kind, saved_with,
                                                                    resumed_with):
    """It ended in KeyError: 'state.blocks.0.attn.qkv.weight.step' (AdamW's state looked for in a
    Muon snapshot's, or the reverse), deep inside torch. Refused before anything is loaded."""
    folder = tmp_path / "run"
    store_of(kind, folder).save(*trained(saved_with), info(8), is_main=True)
    entry = folder / ("sharded_000000008" if kind == "sharded" else "snapshot_000000008.pt")
    model, optimizer = trained(resumed_with)
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(SnapshotError) as refused:
        store_of(kind, folder).restore(model, optimizer, asdict(CONFIG), VOCAB)
    assert str(refused.value) == (
        f"snapshot {entry} was trained with optimizer_config.name={saved_with}, and this run's is {resumed_with}; "
        f"set optimizer_config.name={saved_with} to resume it, or set trainer_config.snapshot_path to a new "
        f"location to start afresh with {resumed_with}")
    assert all(torch.equal(weights[name], tensor) for name, tensor in model.state_dict().items())  # untouched
    restored, _ = store_of(kind, folder).restore(*trained(saved_with), asdict(CONFIG), VOCAB)
    assert restored.step == 8  # its own optimizer resumes it


@pytest.mark.slow
def test_a_run_on_a_sharded_folder_without_the_sharded_format_stops_in_one_line(text_file, tmp_path, capsys,
                                                                                 one_torch_thread):
    """The issue's run: a folder of sharded snapshots resumed without snapshot_format=sharded. One
    line naming the key, exit status 1, and no snapshot_<step>.pt written beside the sharded folders;
    with the key set, it resumes."""
    folder = tmp_path / "run"
    sharded = tiny_overrides(text_file, folder, trainer_config__max_steps=8,
                             trainer_config__snapshot_format="sharded")
    assert_ok(run_main_in_process(sharded, capsys))
    snapshots = {name: digest for name, digest in listing(folder).items() if "metrics" not in name}
    line = one_error_line(run_main_in_process(tiny_overrides(text_file, folder, trainer_config__max_steps=12),
                                              capsys))
    assert line.startswith(f"error: trainer_config.snapshot_format: {folder} holds sharded snapshots, the newest "
                           f"{folder / 'sharded_000000008'} (step 8)"), line
    assert {name: digest for name, digest in listing(folder).items() if "metrics" not in name} == snapshots
    resumed = run_main_in_process([*sharded, "trainer_config.max_steps=12"], capsys)
    assert_ok(resumed)
    assert "Resuming training from snapshot at Epoch 0 (step 8" in resumed.stdout


@pytest.mark.slow
def test_muon_started_on_an_adamw_snapshot_stops_in_one_line(text_file, tmp_path, capsys, one_torch_thread):
    snapshot = tmp_path / "snap.pt"
    assert_ok(run_main_in_process(tiny_overrides(text_file, snapshot, trainer_config__max_steps=8), capsys))
    before = sha256(snapshot)
    muon = tiny_overrides(text_file, snapshot, trainer_config__max_steps=12, optimizer_config__name="muon")
    line = one_error_line(run_main_in_process(muon, capsys))
    assert line == (f"error: snapshot {snapshot} was trained with optimizer_config.name=adamw, and this run's is "
                    "muon; set optimizer_config.name=adamw to resume it, or set trainer_config.snapshot_path to "
                    "a new location to start afresh with muon"), line
    assert sha256(snapshot) == before
