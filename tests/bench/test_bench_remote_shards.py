"""bench/bench_remote_shards.py: two small shards behind its own S3 server (moto): a main.py run on
them reaches its first step, and an epoch of the training loader through the bounded cache, and from
the local disk, counts its waits, the cache's copies never over data_config.shard_cache_gb."""
import json
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.slow


def test_starts_a_run_on_s3_shards_and_reads_an_epoch_through_the_cache(tmp_path):
    report = tmp_path / "remote_shards.json"
    result = subprocess.run([sys.executable, REPO / "bench" / "bench_remote_shards.py", "--shards", "2",
                             "--tokens-per-shard", "200000", "--cache-shards", "2", "--steps", "3",
                             "--batch-size", "2", "--block-size", "32", "--json", report],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(report.read_text())
    run = figures["startup_run"]
    assert run["error"] is None and run["steps_seen"] == 3, run
    assert 0 < run["first_step_s"] < run["total_s"], run
    assert run["data_line"].startswith("Data: 2 llm.c shards"), run
    assert figures["cache_bytes"] == 2 * figures["shard_bytes"]
    for steady in (figures["steady_state"], figures["steady_state_local"]):
        assert steady["batches"] >= 2, steady  # 400,000 tokens in batches of 32 x 1024
        assert 0 <= steady["waited_share"] <= 1, steady
    assert 0 < figures["steady_state"]["most_disk_bytes"] <= figures["cache_bytes"], figures
    assert "start-up to the first step" in result.stdout
