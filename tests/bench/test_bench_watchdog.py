"""bench/bench_watchdog.py: the default model's steps with and without the watchdog, paired, and the
watchdog's own work timed alone (it reaches into the Trainer's guard: a rename there breaks it)."""
import json
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.slow


def test_pairs_watched_and_unwatched_steps_and_times_the_watchdogs_work(tmp_path):
    report = tmp_path / "watchdog.json"
    result = subprocess.run([sys.executable, REPO / "bench" / "bench_watchdog.py", "--batch", "1", "--rounds", "2",
                             "--threads", "1", "--json", report], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    figures = json.loads(report.read_text())["result"]
    assert len(figures["rounds_ms"]["watched"]) == len(figures["rounds_ms"]["unwatched"]) == 2  # warm-up aside
    assert 0.2 < figures["ratio"] < 5, figures  # the same step both ways
    assert 0 < figures["added_us_per_step"] < 1000, figures  # five attribute sets and two clock reads
    assert "without the watchdog" in result.stdout
