"""bench/bench_train.py: the figures it promises are there and add up, in one process and under torchrun."""
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, TORCHRUN

BENCH = REPO / "bench" / "bench_train.py"
PHASES = {"data", "forward", "backward", "optimizer", "communication"}


def run_bench(tmp_path, text_file, launcher: list[str], *flags: str) -> tuple[dict, str]:
    report = tmp_path / "train.json"
    command = [*launcher, str(BENCH), "--models", "gpt-nano", "--block-size", "32", "--batch-size", "4",
               "--warmup", "1", "--steps", "2", "--split-steps", "2", "--threads", "1", "--workers", "0",
               "--peak-sizes", "128", "--data", str(text_file), "--json", str(report), *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(report.read_text()), result.stdout


def test_one_process_reports_speed_split_mfu_and_memory(tmp_path, text_file):
    report, stdout = run_bench(tmp_path, text_file, [sys.executable])
    (result,) = report["results"]
    assert result["tokens_per_s"] > 0
    split = result["split"]
    assert set(split["ms"]) == set(split["pct"]) == PHASES
    assert sum(split["pct"].values()) == pytest.approx(100)
    assert split["ms"]["communication"] == 0  # nothing to reduce in one process
    assert min(split["ms"][phase] for phase in PHASES - {"communication"}) > 0
    assert 0 < result["mfu"]["fp32"] < result["matmul_efficiency"]["fp32"]
    assert 0 < result["matmuls"]["pct_of_step"] < 100
    assert result["peak_memory_mb"] > result["state_mb"] > 0
    assert report["peak"]["fp32"]["gflops_by_size"].keys() == {"128"}
    assert "split: data" in stdout and "Linear matmuls in the step" in stdout


def test_under_torchrun_rank_zero_reports_for_the_world(tmp_path, text_file):
    report, stdout = run_bench(tmp_path, text_file,
                               [*TORCHRUN, "--standalone", "--nproc_per_node=2"])
    (result,) = report["results"]
    assert report["environment"]["world_size"] == 2
    assert result["tokens_per_step"] == 2 * 4 * 32
    assert result["split"]["ms"]["communication"] >= 0
    assert stdout.count("summary:") == 1  # rank 1 trains but says nothing
