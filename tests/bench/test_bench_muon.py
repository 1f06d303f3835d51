"""bench/bench_muon.py, small: one AdamW and one Muon run to a loss every run reaches at once."""
import json
import sys

import bench_muon
import pytest
from helpers import REPO, assert_ok, run


def run_ending(final: float, *evaluations: tuple[int, float]) -> dict:
    return {"final": final, "evaluations": [*evaluations, (3000, final)]}


def test_the_verdict_reads_sooner_from_a_shorter_budget_that_still_ends_at_adamw_s_loss():
    """A shorter run cools down within its own budget: a Muon run of 2,000 steps that ends below
    AdamW's 3,000-step loss is 1.5x sooner, though the 3,000-step run passed it only at 2,400; the
    shorter runs are no one's best, and one that ends above AdamW's loss does not count."""
    runs = {"adamw:learning_rate=0.003": run_ending(1.63),
            "muon:": run_ending(1.58, (2400, 1.62)),
            "muon:steps=2000": run_ending(1.625),
            "muon:steps=1500": run_ending(1.66)}
    verdict = bench_muon.end_verdict(runs, steps=3000)
    assert verdict["best"]["muon"] == {"label": "muon:", "final": 1.58}
    assert verdict["muon_steps_to_adamw_end"] == 2400
    assert verdict["muon_shortest_budget_to_adamw_end"] == 2000
    assert verdict["sooner"] == 1.5 and verdict["sooner_met"]


@pytest.mark.slow
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
