"""bench/bench_dropout.py: both paths train, each round is timed, and the figures come from those rounds."""
import json
import statistics
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.slow


def test_compares_the_project_path_with_torchs(tmp_path):
    report = tmp_path / "dropout.json"
    result = subprocess.run([sys.executable, REPO / "bench" / "bench_dropout.py", "--models", "gpt-nano",
                             "--rounds", "2", "--threads", "1", "--json", report],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (figures,) = json.loads(report.read_text())["results"]
    ours, theirs = figures["rounds_ms"]["ours"], figures["rounds_ms"]["torch"]
    assert len(ours) == len(theirs) == 2  # the warm-up round is not counted
    assert figures["ms_ours"] == pytest.approx(statistics.median(ours))
    assert figures["ms_torch"] == pytest.approx(statistics.median(theirs))
    assert figures["speedup"] == pytest.approx(statistics.median(t / o for o, t in zip(ours, theirs)))
    assert 0.2 < figures["speedup"] < 5, figures  # the same model's step both ways: a ratio near 1
    assert "gpt-nano:" in result.stdout and "speed-up" in result.stdout
