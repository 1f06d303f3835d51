"""bench/bench_text_set.py: a folder of two small texts prepared with 1 and with 2 processes (each file
made once, a second run making none: the script's own checks), each run timed and its processes'
memory sampled, and a start-up on the prepared set timed without and with its index."""
import json
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.slow


def test_prepares_a_set_with_one_and_two_processes(tmp_path):
    report = tmp_path / "text_set.json"
    result = subprocess.run([sys.executable, REPO / "bench" / "bench_text_set.py", "--files", "2", "--mb", "1",
                             "--vocab", "300", "--repeats", "1", "--workdir", tmp_path / "work", "--json", report],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    figures = json.loads(report.read_text())
    assert figures["files"] == 2 and 0.8 < figures["mb"] < 1.2, figures
    assert set(figures["runs"]) == {"1", "2"}
    for processes, run in figures["runs"].items():
        assert len(run["seconds"]) == len(run["cpu_s"]) == 1  # --repeats 1
        assert run["median_s"] == run["seconds"][0] > 0
        assert len(run["peak_rss_mb_per_process"]) >= int(processes), run  # every preparer sampled
        assert 0 < max(run["peak_rss_mb_per_process"]) < 1000, run
    assert 0.1 < figures["speedup_2_over_1"] < 10, figures
    assert set(figures["start_up"]) == {"without_index_s", "with_index_s"}
    assert "speed-up of 2 processes over 1" in result.stdout
