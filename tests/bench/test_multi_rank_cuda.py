"""bench/multi_rank_cuda.py: the GPU machines' multi-rank check, run here on the CPU (one scenario).
The script runs in this process (what it runs are real torchrun processes)."""
import json

import multi_rank_cuda
import pytest


@pytest.mark.slow
def test_a_scenario_runs_its_ranks_and_is_recorded(tmp_path, capsys):
    """FSDP on 2 ranks under one torchrun, as the script runs it on a GPU (HSDP's two agents run in
    tests/end_to_end/test_cluster.py, across two hosts)."""
    out = tmp_path / "multi_rank.json"
    with pytest.raises(SystemExit) as ended:
        multi_rank_cuda.main(["--only", "fsdp", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert ended.value.code == 0, stdout
    assert "fsdp: passed" in stdout
    recorded = json.loads(out.read_text())
    assert recorded["device"] == "cpu" and list(recorded["scenarios"]) == ["fsdp"]
    assert recorded["scenarios"]["fsdp"]["outcome"] == "passed"


def test_an_unknown_scenario_is_one_line_naming_the_choices(tmp_path):
    with pytest.raises(SystemExit) as ended:  # sys.exit(text): the text on stderr, exit status 1
        multi_rank_cuda.main(["--only", "hsdp,nccl", "--out", str(tmp_path / "x.json")])
    assert ended.value.code == (
        "error: --only: unknown scenario(s) nccl; choose from ddp-fp16, ddp-bf16, fsdp, fsdp-offload, hsdp, "
        "activation-checkpointing, async-single, async-sharded-then-one-rank, stop-signal-and-resume")
    assert not (tmp_path / "x.json").exists()
