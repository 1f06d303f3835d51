"""bench/bench_fsdp.py on a tiny model: both methods run under torchrun and every rank reports
(with activation checkpointing, so that the flag reaches the workers' Trainers). The script runs in
this process; its workers are real torchrun processes."""
import json

import bench_fsdp
import pytest

pytestmark = pytest.mark.slow


def test_ddp_and_fsdp_report_every_rank_and_fsdp_holds_half(tmp_path, capsys):
    report = tmp_path / "fsdp.json"
    bench_fsdp.main(["--layers", "2", "--heads", "2", "--embd", "32", "--block-size", "16",
                     "--batch-size", "2", "--warmup", "1", "--steps", "2",
                     "--activation-checkpointing", "full", "--json", str(report)])
    stdout = capsys.readouterr().out
    written = json.loads(report.read_text())
    assert written["settings"]["activation_checkpointing"] == "full"
    ddp, fsdp = written["results"]
    assert (ddp["method"], fsdp["method"]) == ("ddp", "fsdp")
    assert [rank["rank"] for rank in fsdp["ranks"]] == [0, 1]
    for rank in ddp["ranks"] + fsdp["ranks"]:
        assert rank["tokens_per_s"] > 0 and rank["peak_mb"] > 0 and rank["activations_mb"] > 0
    # Parameters, gradients and AdamW state: FSDP holds about half of DDP's per rank.
    assert 0.4 < fsdp["ranks"][0]["state_mb"] / ddp["ranks"][0]["state_mb"] < 0.6
    assert "fsdp" in stdout
