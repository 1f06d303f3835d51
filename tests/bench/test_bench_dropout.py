"""bench/bench_dropout.py: both paths train, and the comparison is reported."""
import json
import subprocess
import sys

from helpers import REPO


def test_compares_the_project_path_with_torchs(tmp_path):
    report = tmp_path / "dropout.json"
    result = subprocess.run([sys.executable, REPO / "bench" / "bench_dropout.py", "--models", "gpt-nano",
                             "--rounds", "2", "--threads", "1", "--json", report],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (figures,) = json.loads(report.read_text())["results"]
    assert figures["ms_ours"] > 0 and figures["ms_torch"] > 0 and figures["speedup"] > 0
    assert "gpt-nano:" in result.stdout and "speed-up" in result.stdout
