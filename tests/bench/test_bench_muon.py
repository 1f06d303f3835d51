"""bench/bench_muon.py, small: one AdamW and one Muon run to a loss every run reaches at once."""
import json
import sys

import pytest
from helpers import REPO, assert_ok, run

pytestmark = pytest.mark.slow


def test_reports_each_optimizer_s_time_to_the_target_loss_and_their_ratio(tmp_path):
    report = tmp_path / "muon.json"
    result = run([sys.executable, REPO / "bench" / "bench_muon.py", "--target", "10", "--max-steps", "10",
                  "--eval-every", "5", "--adamw-rates", "3e-3", "--muon-rates", "0.02", "--json", report],
                 timeout=300)
    assert_ok(result)
    figures = json.loads(report.read_text())
    assert figures["sweep"]["adamw_best"]["step"] == figures["sweep"]["muon_best"]["step"] == 5
    verdict = figures["verdict"]
    assert verdict["adamw"]["step"] == verdict["muon"]["step"] == 5 and verdict["speedup"] > 0
