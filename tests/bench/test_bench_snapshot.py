"""bench/bench_snapshot.py on a tiny model: local and S3 (the loopback server) saves and loads."""
import json
import sys

from helpers import REPO, assert_ok, run


def test_reports_save_and_load_locally_and_on_s3_and_the_pauses(tmp_path):
    report = tmp_path / "snapshot.json"
    result = run([sys.executable, REPO / "bench" / "bench_snapshot.py", "--repeats", "1", "--layers", "1",
                  "--heads", "2", "--embd", "32", "--json", report])
    assert_ok(result)
    figures = json.loads(report.read_text())
    assert figures["size_mb"] > 0
    for where in ("local", "s3"):
        assert all(figures[where][key] > 0 for key in ("save_s", "load_s", "load_streamed_s", "sync_pause_s",
                                                       "async_pause_s", "async_first_pause_s"))
    assert "s3: save" in result.stdout and "s3: training waits" in result.stdout
