"""bench/bench_plan.py's worker under torchrun (2 ranks, gloo): the planner's memory rows against the
peaks measured on this machine, for a small model, with 1 and 2 ranks, ddp and fsdp, checkpointing
on and off (the suite's one torchrun run for the planner; the full grid is bench/results/plan.json)."""
import argparse
import json

import bench_plan
import pytest
from helpers import REPO, TORCHRUN, assert_ok, run

pytestmark = pytest.mark.slow

CONFIGS = "ddp:none:2,fsdp:none:2,fsdp:full:2,ddp:full:1"
TOLERANCE = bench_plan.TARGET


def test_predicted_peaks_are_within_the_tolerance_of_the_measured_ones():
    shape = argparse.Namespace(model="tiny", layers=2, heads=4, embd=128, block_size=64, batch_size=8)
    flags = ["--layers", shape.layers, "--heads", shape.heads, "--embd", shape.embd,
             "--block-size", shape.block_size, "--batch-size", shape.batch_size, "--steps", 2,
             "--configs", CONFIGS, "--no-timing"]
    script = REPO / "bench" / "bench_plan.py"
    result = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", script, "--worker", *flags])
    assert_ok(result)
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    measured = [entry for rank in json.loads(line[len("RESULT "):])["ranks"] for entry in rank]
    for text in CONFIGS.split(","):
        row = bench_plan.memory_row(shape, text, [entry for entry in measured if entry["config"] == text])
        assert len(row["errors"]) == 2, row  # both ranks measured
        assert all(abs(error) <= TOLERANCE for error in row["errors"]), (text, row)
