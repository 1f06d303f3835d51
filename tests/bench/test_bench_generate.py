"""bench/bench_generate.py, small: cached and uncached generation timed, their ratio written."""
import json
import sys

import pytest
from helpers import REPO, assert_ok, run

pytestmark = pytest.mark.slow


def test_reports_first_token_and_tokens_per_second_with_and_without_the_cache(tmp_path):
    report = tmp_path / "generate.json"
    result = run([sys.executable, REPO / "bench" / "bench_generate.py", "--models", "default", "--prompts", "1",
                  "--threads", "1", "--new-tokens", "4", "--repeats", "1", "--json", report])
    assert_ok(result)
    [row] = json.loads(report.read_text())["rows"]
    assert row["cached_tokens_per_s"] > 0 and row["uncached_first_token_s"] > 0 and row["speedup"] > 0
