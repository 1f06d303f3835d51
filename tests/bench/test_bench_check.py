"""bench/bench_check.py, one point of its grid (the committed grid is bench/results/check.json), and
bench/bench_check_gpu.py's CPU half (its GPU half runs in bench/gpu_checks.sh where a GPU is lent)."""
import json

import bench_check
import bench_check_gpu
import pytest

pytestmark = pytest.mark.slow


def test_a_point_of_the_grid_meets_its_targets(tmp_path):
    """gpt2 under fsdp at 512 ranks, its first and last rank: the state to the byte, activations within
    15%, and the table's row of what the planner said before (an even share: 15% short)."""
    out = tmp_path / "check.json"
    bench_check.main(["--models", "gpt2", "--worlds", "512", "--methods", "fsdp", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["all_within"] and [row["rank"] for row in saved["rows"]] == [0, 511]
    table = bench_check.markdown(saved["rows"])
    assert "| gpt2 | 512 | fsdp | 0 | 0.8 MB (+0.0%) |" in table and "-15.1%, -15.1% |" in table


def test_the_gpu_check_s_cpu_half_holds_what_the_check_says(tmp_path, capsys):
    bench_check_gpu.main(["--json", str(tmp_path / "gpu.json")])
    row = json.loads((tmp_path / "gpu.json").read_text())["row"]
    assert row["state_within"] and row["peak_within"] is None, row
    assert "no GPU: the state only" in capsys.readouterr().out
