import torch

from mingpt.common.logger import configure_logging
from mingpt.reporting import monitor
from mingpt.reporting.monitor import TrainingMonitor, format_eta


def test_eta_format():
    assert format_eta(3725.9) == "1:02:05"


def tracker_at(monkeypatch, times: list[float], **settings) -> TrainingMonitor:
    """A monitor on rank 0 whose clock reads `times` in turn."""
    configure_logging(rank=0)
    clock = iter(times)
    monkeypatch.setattr(monitor.time, "monotonic", lambda: next(clock))
    options = {"flops_per_token": 1000, "peak_flops": 1e6, "world_size": 1, "total_steps": 30,
               "max_epochs": 3, "interval_s": 5, "active": True, **settings}
    return TrainingMonitor(**options)


def test_rate_mfu_and_eta_start_after_the_first_step_not_at_start_up(capsys, monkeypatch):
    # Start-up and the first step take 100 s; then 10 steps of 500 tokens take 10 s.
    tracker = tracker_at(monkeypatch, [100.0, 110.0, 110.0, 110.0])
    tracker.restart_window()
    tracker.update(epoch=1, step=1, tokens=500, loss=torch.tensor(2.0))  # opens the window at 100 s
    assert capsys.readouterr().out == ""
    tracker.update(epoch=1, step=11, tokens=5500, loss=torch.tensor(1.5))
    line = capsys.readouterr().out.strip()
    # 5,000 tokens in 10 s = 500 tok/s; x 1000 FLOP/token = 5e5 of a 1e6 peak; 19 steps at 1 s each.
    assert line == "epoch 1/3 | step 11/30 | loss 1.5000 | 500 tok/s | MFU 50.0% | ETA 0:00:19"
    assert tracker.tokens_per_s == 500


def test_mfu_is_per_device_not_the_whole_world_over_one_device(monkeypatch):
    tracker = tracker_at(monkeypatch, [0.0, 10.0, 10.0, 10.0], world_size=4)
    tracker.restart_window()
    tracker.update(1, 1, 0, torch.tensor(1.0))
    tracker.update(1, 11, 20_000, torch.tensor(1.0))  # 2,000 tok/s over 4 ranks: 500 each
    assert tracker.tokens_per_s == 2000
    assert tracker.mfu == 0.5


def test_rate_limited_and_silent_off_rank_zero(capsys, monkeypatch):
    tracker = tracker_at(monkeypatch, [100.0] * 4, peak_flops=None)
    tracker.restart_window()
    tracker.update(1, 1, 500, torch.tensor(1.0))
    tracker.update(1, 10, 5000, torch.tensor(1.0))  # no time has passed: no report
    quiet = TrainingMonitor(1000, None, 1, 30, 3, interval_s=0.0, active=False)
    quiet.update(1, 1, 500, torch.tensor(1.0))
    quiet.update(1, 10, 5000, torch.tensor(1.0))
    assert capsys.readouterr().out == "" and tracker.mfu is None


def test_a_step_budget_shows_no_epoch_count(capsys, monkeypatch):
    tracker = tracker_at(monkeypatch, [0.0, 10.0, 10.0, 10.0], max_epochs=None)
    tracker.update(epoch=2, step=1, tokens=500, loss=torch.tensor(2.0))
    tracker.update(epoch=2, step=11, tokens=5500, loss=torch.tensor(1.5))
    assert "epoch 2 | step 11/30 |" in capsys.readouterr().out


def test_the_eta_is_from_every_window_and_a_long_cpu_run_names_the_short_config(capsys, monkeypatch):
    """A window of 10 steps in 10 s, then one of 10 steps in 30 s (a busy machine): tok/s is the
    latest window's, the ETA the rate of both (40 s for 20 steps), so it does not jump threefold."""
    tracker = tracker_at(monkeypatch, [0.0, 10.0, 10.0, 10.0, 40.0, 40.0, 40.0], total_steps=3621,
                         long_run_hint="for a run of minutes: X")
    tracker.restart_window()
    tracker.update(1, 1, 0, torch.tensor(1.0))
    tracker.update(1, 11, 5000, torch.tensor(1.0))
    first = capsys.readouterr().out.splitlines()
    assert first[0].endswith("| ETA 1:00:10") and first[1] == "This run will take about 1:00:10 here; " \
        "for a run of minutes: X"
    tracker.update(1, 21, 10000, torch.tensor(1.0))
    later = capsys.readouterr().out.splitlines()
    assert len(later) == 1 and "| 167 tok/s |" in later[0] and later[0].endswith("| ETA 2:00:00")
