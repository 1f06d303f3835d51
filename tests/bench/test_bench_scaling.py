"""bench/bench_scaling.py on a tiny model: the two CPU runs are the like-for-like pair it promises.
The script runs in this process; the runs it compares are real processes."""
import json

import bench_scaling
import pytest

pytestmark = pytest.mark.slow


def test_cpu_scaling_compares_processes_with_threads_on_one_global_batch(tmp_path, capsys):
    report = tmp_path / "scaling.json"
    bench_scaling.main(["--nproc", "2", "--layers", "2", "--heads", "2", "--embd", "32", "--block-size", "16",
                        "--global-batch", "4", "--warmup", "1", "--steps", "2", "--json", str(report)])
    assert "DDP scaling efficiency:" in capsys.readouterr().out
    figures = json.loads(report.read_text())
    one, many = figures["one"], figures["many"]
    # What each run's workers report they ran: the baseline's threads match the ranks it stands for,
    # and both train the same global batch, so that their throughputs compare like for like.
    assert (one["ranks"], one["threads"]) == (1, 2) and (many["ranks"], many["threads"]) == (2, 1)
    assert one["global_batch"] == many["global_batch"] == 4
    assert figures["baseline"] == "1 process x 2 threads, same global batch"
    assert figures["efficiency"] == pytest.approx(many["tokens_per_s"] / one["tokens_per_s"])
    assert figures["machine"]["cores"] >= 1 and figures["machine"]["torch"]
