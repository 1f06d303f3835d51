"""bench/bench_step_checks.py, small: the divergence watch's cost before and after the spike rule, and
a counted write against an uncounted one."""
import json
import sys

import pytest
from helpers import REPO, assert_ok, run

pytestmark = pytest.mark.slow


def test_reports_the_watch_s_cost_against_a_step_and_a_counted_write(tmp_path):
    report = tmp_path / "step_checks.json"
    result = run([sys.executable, REPO / "bench" / "bench_step_checks.py", "--batch", "1", "--repeats", "200",
                  "--mb", "1", "--json", report])
    assert_ok(result)
    figures = json.loads(report.read_text())["result"]
    assert figures["watch_us_before"] > 0 and figures["watch_us_after"] > 0 and figures["step_ms"] > 0
    assert set(figures["write_s"]) == {"counted", "uncounted"}
    assert "divergence watch per step" in result.stdout
