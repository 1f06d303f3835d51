import re

import pytest
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


def test_a_window_above_the_peak_measures_the_peak_again_once(capsys, monkeypatch):
    """500 tok/s x 1000 FLOP/token is 5e5 FLOP/s against a peak of 1e5 (measured while other processes
    held the CPU): an MFU of 500% is a wrong peak. It is measured again, once, and the line shows the
    MFU against the new one."""
    asked = []

    def peak_above(achieved: float) -> float:
        asked.append(achieved)
        return 1e6

    tracker = tracker_at(monkeypatch, [0.0, 10.0, 10.0, 10.0, 20.0, 20.0, 20.0], peak_flops=1e5,
                         peak_above=peak_above)
    tracker.update(1, 1, 0, torch.tensor(1.0))
    tracker.update(1, 11, 5000, torch.tensor(1.0))
    assert "| 500 tok/s | MFU 50.0% |" in capsys.readouterr().out
    tracker.update(1, 21, 15000, torch.tensor(1.0))  # 1,000 tok/s: 100%, not above
    assert "| MFU 100.0% |" in capsys.readouterr().out
    assert asked == [5e5] and tracker.peak_flops == 1e6


def test_an_mfu_over_100_percent_is_never_shown_nor_recorded(capsys, monkeypatch):
    """The peak measured again is still below what training does (or cannot be measured again: a
    GPU's datasheet figure): no MFU from then on, said once."""
    tracker = tracker_at(monkeypatch, [0.0, 10.0, 10.0, 10.0, 20.0, 20.0, 20.0], flops_per_token=10**7,
                         peak_flops=1e9, peak_above=lambda achieved: None)
    tracker.update(1, 1, 0, torch.tensor(1.0))
    tracker.update(1, 11, 5000, torch.tensor(1.0))
    first = capsys.readouterr().out.splitlines()
    assert first[0] == ("warning: MFU is not shown: training does 5.0 GFLOP/s per device, more than its peak "
                        "(1.0 GFLOP/s) even measured again, so the peak cannot be trusted (on a CPU: "
                        "measured while other processes held its cores)")
    assert first[1] == "epoch 1/3 | step 11/30 | loss 1.0000 | 500 tok/s | ETA 0:00:19"
    assert tracker.mfu is None
    tracker.update(1, 21, 15000, torch.tensor(1.0))
    assert "MFU" not in capsys.readouterr().out
    plain = TrainingMonitor(1000, 1e5, 1, 30, 3, interval_s=0.0, active=False)  # no way to measure again
    plain.tokens_per_s = 500.0
    assert plain.mfu is None


@pytest.mark.slow
def test_a_run_whose_cpu_peak_was_measured_on_a_crowded_cpu_measures_it_again(
        text_file, tmp_path, capsys, monkeypatch, one_torch_thread):
    """Through main.run: the CPU's peak comes out at 1 MFLOP/s (as the wall clock reads a matmul while
    other processes hold the cores), far below what the tiny model then does. At its first progress
    line the run measures the peak again (the report's hook to flops.peak_above), and no line or
    metric ever holds an MFU over 100%."""
    from helpers import assert_ok, run_main_in_process, tiny_overrides

    from mingpt.reporting import flops
    from mingpt.reporting.metrics import default_metrics_path, read_metrics

    measurements = iter([flops.CpuPeak(1e6, clean=False), flops.CpuPeak(1e12, clean=True)])
    monkeypatch.setattr(flops, "measure_cpu_peak", lambda dtype: next(measurements))
    monkeypatch.setenv("MINGPT_CACHE_DIR", str(tmp_path))
    flops.peak_flops.cache_clear()
    snapshot = tmp_path / "snap.pt"
    try:
        result = run_main_in_process(tiny_overrides(text_file, snapshot, trainer_config__max_steps=60,
                                                    trainer_config__progress_interval_s=0.2), capsys)
    finally:
        flops.peak_flops.cache_clear()
    assert_ok(result)
    shown = [float(mfu) for mfu in re.findall(r"\| MFU ([\d.]+)% \|", result.stdout)]
    assert shown and all(mfu <= 100 for mfu in shown), result.stdout
    assert next(measurements, None) is None  # measured twice: at start-up, then again
    recorded = [line["mfu"] for line in read_metrics(default_metrics_path(str(snapshot)), "train")]
    assert all(mfu is None or mfu <= 1 for mfu in recorded)
