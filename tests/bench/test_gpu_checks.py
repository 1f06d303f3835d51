"""bench/gpu_checks.sh on a machine without a GPU: the steps that need one are listed as such, the
CPU-able ones run small and pass, a summary is written, and the script exits 0."""
import json
import sys

import pytest
from helpers import REPO, assert_ok, run

pytestmark = pytest.mark.slow


def test_without_a_gpu_the_script_runs_its_cpu_parts_and_says_what_needs_one(tmp_path):
    result = run(["bash", REPO / "bench" / "gpu_checks.sh"], env={"PYTHON": sys.executable,
                                                                  "GPU_CHECKS_OUT": str(tmp_path)}, timeout=600)
    assert_ok(result)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gpu"] is None and len(summary["commit"]) == 40
    status = {(step["step"], step["status"]) for step in summary["steps"]}
    assert {("a", "needs a GPU"), ("d", "needs a GPU"), ("b", "passed"), ("c", "passed"), ("e", "passed"),
            ("f", "passed")} <= status, summary
    assert "error: training diverged" in (tmp_path / "divergence_fp16.log").read_text()
