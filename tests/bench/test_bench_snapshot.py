"""bench/bench_snapshot.py on a tiny model: local and S3 (the loopback server) saves and loads."""
import json
import sys

import pytest
from helpers import REPO, assert_ok, run

from mingpt.model_size import measure

pytestmark = pytest.mark.slow


def test_reports_save_and_load_locally_and_on_s3_and_the_pauses(tmp_path):
    report = tmp_path / "snapshot.json"
    result = run([sys.executable, REPO / "bench" / "bench_snapshot.py", "--repeats", "1", "--layers", "1",
                  "--heads", "2", "--embd", "32", "--json", report])
    assert_ok(result)
    figures = json.loads(report.read_text())
    _, model_bytes = measure(n_layer=1, n_head=2, n_embd=32, vocab_size=65, block_size=128)
    # the weights and AdamW's two moments, in fp32, plus a few kB of progress, RNG and vocabulary
    assert 3 * model_bytes / 1e6 < figures["size_mb"] < 3 * model_bytes / 1e6 + 0.1
    for where in ("local", "s3"):
        assert all(figures[where][key] > 0 for key in ("save_s", "load_s", "load_streamed_s", "sync_pause_s",
                                                       "async_pause_s", "async_first_pause_s"))
    assert "s3: save" in result.stdout and "s3: training waits" in result.stdout
