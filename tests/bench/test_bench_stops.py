"""bench/bench_stops.py: a stop signal sent while a real run starts up ends it with the stop line and exit
status 75, timed; the phase's figures are merged into the --json file, whose other phases are kept."""
import json
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.slow


def test_times_a_stop_during_start_up_and_keeps_the_other_phases(tmp_path):
    report = tmp_path / "stops.json"
    earlier = {"phase": "evaluation", "signal_to_exit_s": 1.0, "exit_status": 75}
    report.write_text(json.dumps({"phases": [earlier]}))
    result = subprocess.run([sys.executable, REPO / "bench" / "bench_stops.py", "--phases", "startup",
                             "--threads", "1", "--json", report], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    figures = json.loads(report.read_text())
    assert figures["bound_s"] == 15.0
    kept, measured = figures["phases"]
    assert kept == earlier  # a phase not run this time is kept as it was
    assert measured["phase"] == "startup"
    assert measured["exit_status"] == 75, measured  # the run's exit status for a stop
    assert measured["stop_line"].startswith("Stopping on SIGTERM"), measured
    assert measured["batch_s"] is None and measured["bound_s"] == 15.0  # no batch under way at start-up
    assert 0 <= measured["signal_to_exit_s"] < 60, measured
