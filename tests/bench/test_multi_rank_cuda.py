"""bench/multi_rank_cuda.py: the GPU machines' multi-rank check, run here on the CPU (one scenario)."""
import json
import sys

from helpers import REPO, run

SCRIPT = REPO / "bench" / "multi_rank_cuda.py"


def test_a_scenario_runs_its_ranks_and_is_recorded(tmp_path):
    """FSDP on 2 ranks under one torchrun, as the script runs it on a GPU (HSDP's two agents run in
    tests/end_to_end/test_cluster.py, across two hosts)."""
    out = tmp_path / "multi_rank.json"
    result = run([sys.executable, SCRIPT, "--only", "fsdp", "--out", out], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fsdp: passed" in result.stdout
    recorded = json.loads(out.read_text())
    assert recorded["device"] == "cpu" and list(recorded["scenarios"]) == ["fsdp"]
    assert recorded["scenarios"]["fsdp"]["outcome"] == "passed"


def test_an_unknown_scenario_is_one_line_naming_the_choices(tmp_path):
    result = run([sys.executable, SCRIPT, "--only", "hsdp,nccl", "--out", tmp_path / "x.json"])
    assert result.returncode == 1 and not (tmp_path / "x.json").exists()
    assert result.stderr.strip().splitlines() == [
        "error: --only: unknown scenario(s) nccl; choose from ddp-fp16, ddp-bf16, fsdp, fsdp-offload, hsdp, "
        "activation-checkpointing, async-single, async-sharded-then-one-rank, stop-signal-and-resume"]
