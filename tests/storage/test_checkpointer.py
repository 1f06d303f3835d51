"""checkpointer.py: the one decision of when a snapshot is due, saving, and resuming."""
import signal

import torch

from mingpt.distributed.control import Decision
from mingpt.distributed.process_group import DistEnv
from mingpt.model import GPT, GPTConfig, OptimizerConfig, create_optimizer
from mingpt.storage.checkpointer import Checkpointer, SnapshotPolicy
from mingpt.storage.snapshot import Progress

ONE_PROCESS = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                      backend="gloo")
STOP = Decision(stop_signal=signal.SIGTERM)


def checkpointer(tmp_path, **policy) -> Checkpointer:
    policy = SnapshotPolicy(path=str(tmp_path / "snap.pt"), **policy)
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
