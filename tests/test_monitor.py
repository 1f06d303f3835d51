import torch

import monitor
from logger import configure_logging
from monitor import TrainingMonitor, format_eta


def test_eta_format():
    assert format_eta(3725.9) == "1:02:05"


def test_reports_tokens_per_second_mfu_and_eta(capsys, monkeypatch):
    configure_logging(rank=0)
    clock = iter([0.0, 100.0, 110.0, 110.0, 110.0])  # init, window start, then the report
    monkeypatch.setattr(monitor.time, "monotonic", lambda: next(clock))
    tracker = TrainingMonitor(flops_per_token=1000, peak_flops=1e6, total_steps=30, max_epochs=3,
                              interval_s=5, active=True)
    tracker.restart_window(step=0, tokens=0)
    tracker.update(epoch=1, step=10, tokens=5000, loss=torch.tensor(1.5))
    line = capsys.readouterr().out.strip()
    # 5,000 tokens in 10 s = 500 tok/s; x 1000 FLOP/token = 5e5 of a 1e6 peak; 20 steps at 1 s each.
    assert line == "epoch 1/3 | step 10/30 | loss 1.5000 | 500 tok/s | MFU 50.0% | ETA 0:00:20"
    assert tracker.tokens_per_s == 500


def test_rate_limited_and_silent_off_rank_zero(capsys, monkeypatch):
    configure_logging(rank=0)
    monkeypatch.setattr(monitor.time, "monotonic", lambda: 100.0)
    tracker = TrainingMonitor(1000, None, 30, 3, interval_s=5, active=True)
    tracker.restart_window(0, 0)
    tracker.update(1, 10, 5000, torch.tensor(1.0))  # no time has passed: no report
    quiet = TrainingMonitor(1000, None, 30, 3, interval_s=0.0, active=False)
    quiet.update(1, 10, 5000, torch.tensor(1.0))
    assert capsys.readouterr().out == ""
