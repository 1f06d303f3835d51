"""reporting/run_report.py: what a run tells as it goes, in one place. On global rank 0: the original's
loss line every log_every iterations, each step's numbers in the metrics file, the evaluation's line,
the closing line naming the command to sample from the snapshot, a step's missed samples only when
there are any; on another rank nothing said and nothing written. (Its parts: test_monitor.py,
test_metrics.py, test_trackers.py, test_stragglers.py; a whole run's lines: test_trainer.py.)"""
import sys

import torch

from mingpt.common.logger import configure_logging
from mingpt.distributed.process_group import DistEnv
from mingpt.reporting.metrics import open_run_metrics, read_metrics
from mingpt.reporting.monitor import TrainingMonitor
from mingpt.reporting.run_report import ReportSettings, RunReport
from mingpt.storage.snapshot import Progress

TOKENS_PER_STEP = 512


def report_of(path, rank: int = 0, log_every: int = 2) -> RunReport:
    """A report as RunReport.open makes one, without a measured peak (no MFU) and with no progress line
    due (an hour apart)."""
    configure_logging(rank)
    metrics = open_run_metrics(str(path), check_folder=False, active=rank == 0)
    metrics.start(0)
    monitor = TrainingMonitor(flops_per_token=100, peak_flops=None, world_size=2, total_steps=4, max_epochs=1,
                              interval_s=3600, active=rank == 0)
    return RunReport(metrics, monitor, rank, log_every, rank_times=lambda: ({}, {}))


def train(report: RunReport, progress: Progress, losses: list[float]) -> None:
    for iteration, loss in enumerate(losses):
        progress.advance(samples=4, tokens=TOKENS_PER_STEP)
        report.train_step(1, iteration, progress, torch.tensor(loss), grad_norm=torch.tensor(0.5), lr=3e-4)


def test_the_original_s_line_every_log_every_iterations_and_every_step_in_the_metrics(tmp_path, capsys):
    report, progress = report_of(tmp_path / "snap.metrics.jsonl"), Progress()
    train(report, progress, [4.0, 3.5, 3.0, 2.5])
    report.flush()
    assert capsys.readouterr().out.splitlines() == ["[RANK0] Epoch 1 | Iter 0 | Train Loss 4.00000",
                                                    "[RANK0] Epoch 1 | Iter 2 | Train Loss 3.00000"]
    lines = read_metrics(str(tmp_path / "snap.metrics.jsonl"), "train")
    recorded = [tuple(line[key] for key in ("step", "iter", "loss", "grad_norm", "tokens")) for line in lines]
    assert recorded == [(step, step - 1, loss, 0.5, step * TOKENS_PER_STEP)
                        for step, loss in zip(range(1, 5), [4.0, 3.5, 3.0, 2.5])]


def test_the_evaluation_and_the_end_say_what_the_run_did_and_what_to_run_next(tmp_path, capsys,
                                                                               monkeypatch):
    monkeypatch.setattr(sys, "argv", ["mingpt/main.py"])  # the command as the user named it
    report, progress = report_of(tmp_path / "snap.metrics.jsonl"), Progress()
    train(report, progress, [4.0, 3.5, 3.0, 2.5])
    report.evaluation(1, progress, torch.tensor(2.25), samples=100, world_size=2)
    progress.finish_epoch(1)
    report.finished(progress, "snap.pt")
    said = capsys.readouterr().out.splitlines()
    assert said[-3:] == [
        "[RANK0] Epoch 1 | Step 4 | Eval Loss 2.25000 (mean over 100 samples on 2 ranks)",
        "Finished: epoch 1, step 4, 2,048 tokens (4 steps in 0:00:00 in this run); train loss 2.5000, "
        "eval loss 2.2500",
        "Sample from its snapshot: python mingpt/generate.py --snapshot snap.pt"]
    evaluated = read_metrics(str(tmp_path / "snap.metrics.jsonl"), "eval")
    assert [(line["step"], line["loss"], line["samples"]) for line in evaluated] == [(4, 2.25, 100)]


def test_missed_samples_are_recorded_only_when_there_are_some(tmp_path):
    report, progress = report_of(tmp_path / "m.jsonl"), Progress()
    train(report, progress, [4.0])
    report.missed(1, progress, samples=0)
    report.missed(1, progress, samples=6)
    report.flush()
    missed = read_metrics(str(tmp_path / "m.jsonl"), "missed")
    assert [(line["step"], line["samples"]) for line in missed] == [(1, 6)]


def test_another_rank_says_nothing_and_writes_nothing(tmp_path, capsys):
    """Opened as the Trainer opens it, on rank 1 of 2 (rank 0's would measure this CPU's peak)."""
    configure_logging(rank=1)
    rank_1 = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, device=torch.device("cpu"),
                     backend="gloo")
    settings = ReportSettings(str(tmp_path / "snap.metrics.jsonl"), metrics_folder_of_its_own=True,
                              log_every=1, progress_interval_s=0.0, max_epochs=1)
    report = RunReport.open(settings, rank_1, "float32", flops_per_token=100, total_steps=2, resumed_step=0,
                            rank_times=lambda: ({}, {}))
    progress = Progress()
    train(report, progress, [4.0, 3.5])
    report.evaluation(1, progress, torch.tensor(2.0), samples=10, world_size=2)
    report.finished(progress, "snap.pt")
    assert capsys.readouterr().out == "" and list(tmp_path.iterdir()) == []
