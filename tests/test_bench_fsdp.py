"""bench/bench_fsdp.py on a tiny model: both methods run under torchrun and every rank reports."""
import json
import sys

from helpers import REPO, assert_ok, run


def test_ddp_and_fsdp_report_every_rank_and_fsdp_holds_half(tmp_path):
    report = tmp_path / "fsdp.json"
    result = run([sys.executable, REPO / "bench" / "bench_fsdp.py", "--layers", "2", "--heads", "2",
                  "--embd", "32", "--block-size", "16", "--batch-size", "2", "--warmup", "1", "--steps", "2",
                  "--json", report])
    assert_ok(result)
    ddp, fsdp = json.loads(report.read_text())["results"]
    assert (ddp["method"], fsdp["method"]) == ("ddp", "fsdp")
    assert [rank["rank"] for rank in fsdp["ranks"]] == [0, 1]
    assert all(rank["tokens_per_s"] > 0 and rank["peak_mb"] > 0 for rank in ddp["ranks"] + fsdp["ranks"])
    # Parameters, gradients and AdamW state: FSDP holds about half of DDP's per rank.
    assert 0.4 < fsdp["ranks"][0]["state_mb"] / ddp["ranks"][0]["state_mb"] < 0.6
    assert "fsdp" in result.stdout
