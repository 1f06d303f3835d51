"""checkpointer.py: the one decision of when a snapshot is due, saving, and resuming."""
import signal

import pytest
import torch

from mingpt.common.errors import SnapshotError
from mingpt.distributed.control import Decision
from mingpt.distributed.divergence import Health
from mingpt.distributed.process_group import DistEnv
from mingpt.model import GPT, GPTConfig, OptimizerConfig, create_optimizer
from mingpt.storage.checkpointer import Checkpointer, SnapshotPolicy
from mingpt.storage.snapshot import Progress

ONE_PROCESS = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                      backend="gloo")
STOP = Decision(stop_signal=signal.SIGTERM)


def checkpointer(tmp_path, **policy) -> Checkpointer:
    path = tmp_path if policy.get("snapshot_format") == "sharded" else tmp_path / "snap.pt"
    policy = SnapshotPolicy(path=str(path), **policy)
    return Checkpointer(policy, ONE_PROCESS, vocab=list("ab"))


def mid_epoch(step: int) -> Progress:
    return Progress(epoch_step=step, epoch_samples=4 * step, step=step)


def test_one_decision_names_why_a_snapshot_is_due(tmp_path):
    due = checkpointer(tmp_path, every_epochs=2, every_steps=10, every_minutes=5).due
    assert due(mid_epoch(7)) is None
    assert due(mid_epoch(10)) == "step 10"
    assert due(mid_epoch(7), Decision(save=True)) == "step 7 (5 minutes since the last)"
    assert due(mid_epoch(7), STOP) == "step 7"
    assert due(Progress(finished_epoch=1, step=7), epoch_ended=True) is None  # every 2 epochs
    assert due(Progress(finished_epoch=2, step=14), epoch_ended=True) == "epoch 2"
    # The end of a run is saved whatever its budget and cadence (the original's 10 epochs every 3
    # never saved epoch 10).
    assert due(mid_epoch(7), run_ended=True) == "step 7 (the last)"
    assert due(Progress(finished_epoch=3, step=21), run_ended=True) == "epoch 3 (the last)"


def test_a_position_already_saved_is_not_saved_again_and_resumes_there(tmp_path, world_of_one):
    saver = checkpointer(tmp_path, every_steps=10)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=2, block_size=4))
    optimizer = create_optimizer(model, OptimizerConfig())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    saver.save("step 10", mid_epoch(10), model, optimizer, scaler)
    assert saver.due(mid_epoch(10), STOP) is None  # the stop at the step just saved writes nothing
    # The epoch's end at that step is another position (the next epoch starts from its first sample).
    assert saver.due(Progress(finished_epoch=1, step=10), epoch_ended=True) == "epoch 1"

    resumed = checkpointer(tmp_path, every_steps=10)
    assert resumed.resume(model, optimizer, scaler) == mid_epoch(10)
    assert resumed.due(mid_epoch(10), STOP) is None  # what it resumed from is saved already
    assert resumed.restore_rng(fallback_seed=0) and not resumed.restore_rng(fallback_seed=0)  # once


@pytest.mark.slow
def test_a_snapshot_of_another_vocabulary_padding_resumes_the_same_model(tmp_path, world_of_one):
    """Written unpadded (a vocabulary of 2 in 2 rows, as before padding), resumed into 64 rows: the
    same logits, before and after a step (the optimizer's state re-padded too). A sharded snapshot
    cannot re-pad its shards: it is refused, naming the key that resumes it."""
    def model_and_optimizer(vocab_multiple: int, seed: int):
        model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=2, block_size=4,
                              vocab_multiple=vocab_multiple, embd_pdrop=0, resid_pdrop=0, attn_pdrop=0),
                    seed=seed)
        return model, create_optimizer(model, OptimizerConfig(learning_rate=0.1))

    def step(model, optimizer):
        optimizer.zero_grad()
        model(ids, ids)[1].backward()
        optimizer.step()
        return model(ids)[0]

    ids = torch.tensor([[0, 1, 1, 0]])
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for snapshot_format in ("single", "sharded"):
        saver = checkpointer(tmp_path / snapshot_format, snapshot_format=snapshot_format)
        unpadded, optimizer = model_and_optimizer(vocab_multiple=1, seed=0)
        step(unpadded, optimizer)
        saver.save("step 1", mid_epoch(1), unpadded, optimizer, scaler)
        padded, padded_optimizer = model_and_optimizer(vocab_multiple=64, seed=1)  # other weights
        resumed = checkpointer(tmp_path / snapshot_format, snapshot_format=snapshot_format)
        if snapshot_format == "sharded":
            with pytest.raises(SnapshotError, match=r"another model: vocab_multiple=1 \(config: 64\)"):
                resumed.resume(padded, padded_optimizer, scaler)
            continue
        assert resumed.resume(padded, padded_optimizer, scaler) == mid_epoch(1)
        assert padded.head.weight.shape[0] == 64 and not padded.head.weight[2:].any()
        torch.testing.assert_close(padded(ids)[0], unpadded(ids)[0])
        torch.testing.assert_close(step(padded, padded_optimizer), step(unpadded, optimizer))


@pytest.mark.parametrize("layout", ["file", "folder", "sharded"])
def test_a_diverged_run_goes_back_to_the_newest_snapshot_healthy_steps_followed(tmp_path, world_of_one, layout):
    """Snapshots at steps 1, 2 and 3; a healthy step followed step 1's, an unhealthy one step 2's (a
    spike began). Pruning to keep_last=1 keeps step 1's all the same, and when the run stops as
    diverged, steps 2 and 3 are set aside: a resume picks step 1's weights."""
    path = {"file": tmp_path / "snap.pt", "folder": tmp_path / "run", "sharded": tmp_path / "run"}[layout]
    policy = SnapshotPolicy(path=str(path), keep_last=1,
                            snapshot_format="sharded" if layout == "sharded" else "single")
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=2, block_size=4))
    optimizer = create_optimizer(model, OptimizerConfig())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    saver = Checkpointer(policy, ONE_PROCESS, vocab=list("ab"))
    for step, health in ((1, Health(as_of=2, last_unhealthy=0)), (2, Health(as_of=3, last_unhealthy=3)),
                         (3, Health(as_of=3, last_unhealthy=3))):
        with torch.no_grad():
            model.head.weight.fill_(step)
        saver.save(f"step {step}", mid_epoch(step), model, optimizer, scaler)
        saver.note_health(health)
    said = saver.go_back_to_healthy("with a lower learning rate")
    assert said.startswith(f"resume from {path}") and "(step 1, the newest snapshot healthy steps followed)" in said
    assert "set aside so that no run resumes from them" in said and "\n" not in said
    assert saver.resume(model, optimizer, scaler) == mid_epoch(1)
    assert (model.head.weight == 1).all()
    set_aside = {"file": ["snap.diverged.pt"], "folder": ["diverged_000000003.pt"],
                 "sharded": ["sharded_000000003/diverged_info.pt"]}[layout]
    assert all((tmp_path / ("" if layout == "file" else "run") / name).exists() for name in set_aside), \
        sorted(p.name for p in tmp_path.rglob("*"))


def test_a_run_that_diverged_before_any_healthy_snapshot_leaves_none_to_resume(tmp_path, world_of_one):
    saver = checkpointer(tmp_path)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=2, block_size=4))
    optimizer = create_optimizer(model, OptimizerConfig())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    saver.save("step 1", mid_epoch(1), model, optimizer, scaler)
    saver.note_health(Health(as_of=2, last_unhealthy=2))
    said = saver.go_back_to_healthy("with a lower learning rate")
    assert said.startswith("no snapshot of this run was followed by healthy steps") and "starts afresh" in said
    assert not (tmp_path / "snap.pt").exists() and (tmp_path / "snap.diverged.pt").exists()
