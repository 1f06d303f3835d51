"""bench/bench_scaling.py on a tiny model: the CPU comparison runs and its ratio adds up."""
import json
import sys

import pytest
from helpers import REPO, assert_ok, run


def test_cpu_scaling_compares_processes_with_threads_on_one_global_batch(tmp_path):
    report = tmp_path / "scaling.json"
    result = run([sys.executable, REPO / "bench" / "bench_scaling.py", "--nproc", "2", "--layers", "2",
                  "--heads", "2", "--embd", "32", "--block-size", "16", "--global-batch", "4",
                  "--warmup", "1", "--steps", "2", "--json", report])
    assert_ok(result)
    figures = json.loads(report.read_text())
    assert figures["one"]["ranks"] == 1 and figures["many"]["ranks"] == 2
    assert figures["baseline"] == "1 process x 2 threads, same global batch"
    ratio = figures["many"]["tokens_per_s"] / figures["one"]["tokens_per_s"]
    assert figures["efficiency"] == pytest.approx(ratio)
    assert figures["machine"]["cores"] >= 1 and figures["machine"]["torch"]
