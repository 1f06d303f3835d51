"""bench/bench_suite.py: pytest's counts read back, and a run of a small selection recorded."""
import json
import sys

import pytest
from bench_suite import counts
from helpers import REPO, assert_ok, run


def test_pytests_last_line_is_read_as_counts_by_kind():
    assert counts("2 failed, 519 passed, 1 warning in 123.91s (0:02:03)") == {"failed": 2, "passed": 519,
                                                                             "warning": 1}
    assert counts("=== 1 passed, 673 deselected, 3 errors in 9.79s ===") == {"deselected": 673, "error": 3,
                                                                            "passed": 1}


@pytest.mark.slow
def test_a_run_of_one_file_is_timed_and_counted(tmp_path):
    report = tmp_path / "suite.json"
    result = run([sys.executable, REPO / "bench" / "bench_suite.py", "--runs", "1", "--json", report, "--",
                  "tests/test_model_generate.py", "-n", "0"], timeout=300)
    assert_ok(result)
    figures = json.loads(report.read_text())
    assert figures["quick_tests"] == figures["suite_tests"] == figures["runs"][0]["counts"]["passed"] > 10
    assert figures["quick_wall_s"] == [figures["runs"][0]["wall_s"]] and figures["machine"]["cores"] >= 1
