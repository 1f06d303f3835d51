"""bench/bench_data.py on a 1 MB text: every figure it promises is there (BPE preparation too), for both
ranks, and sane. The script runs in this process; what it measures runs in processes of its own."""
import json

import bench_data
import pytest

pytestmark = pytest.mark.slow


def test_reports_preparation_startup_memory_per_rank_and_loader_speed(tmp_path, capsys):
    report = tmp_path / "data.json"
    bench_data.main(["--mb", "1", "--small-mb", "0.2", "--steps", "3", "--loader-batches", "5",
                     "--workdir", str(tmp_path / "work"), "--json", str(report)])
    stdout = capsys.readouterr().out
    figures = json.loads(report.read_text())
    assert not any(figures["errors"].values()), figures["errors"]
    assert figures["corpus"]["bytes"] == 1_000_000
    assert (tmp_path / "work" / "text_1mb.txt").stat().st_size == 1_000_000

    prepare = figures["prepare"]
    assert 50 < prepare["vocab_size"] < 100  # word salad with a few multi-byte characters
    for run_ in (prepare["from_scratch"], prepare["up_to_date"]):
        assert run_["seconds"] > 0 and run_["mb_per_s"] > 0
        assert 10 < run_["peak_rss_mb"] < 1000  # the prepare process's own, not the benchmark's
    assert prepare["from_scratch"]["output"].startswith("prepared ")
    assert prepare["up_to_date"]["output"].startswith("up to date")

    startup = figures["startup"]
    assert (0 < startup["data_loaded_s"] < startup["trainer_built_s"] < startup["first_step_s"]
            < startup["total_s"])

    memory = figures["memory"]
    for text in ("big", "small"):
        ranks = memory[text]["ranks"]
        assert set(ranks) == {"0", "1"}
        for rank in ranks.values():
            assert 0 < rank["uss"] <= rank["pss"] <= rank["rss"]  # a process's private pages, shares, all
        assert set(memory[text]["ranks_training"]) == {"0", "1"}  # sampled after the first step too
    assert set(memory["extra_uss_mb"]) == {"0", "1"}
    assert all(abs(extra) < 300 for extra in memory["extra_uss_mb"].values())  # 1 MB vs 0.2 MB of text

    loader = figures["loader"]["runs"]
    assert [r["workers"] for r in loader] == [0, 1]
    assert all(r["samples_per_s"] > 0 and r["first_batch_s"] > 0 and r["batch_shape"] == [216, 128]
               for r in loader)

    bpe = figures["prepare_bpe"]
    assert bpe["seconds"] > 0 and bpe["mb_per_s"] > 0 and 10 < bpe["peak_rss_mb"] < 1000
    assert bpe["output"].startswith("prepared ") and ".bpe.tokens" in bpe["output"]
    assert 256 < bpe["vocab_size"] <= 8192 and bpe["bytes_per_token"] > 1

    assert set(figures["verdicts"]) == {"prepare_mb_per_s", "prepare_peak_mb", "bpe_prepare_mb_per_s",
                                        "bpe_prepare_peak_mb", "startup_s", "extra_private_mb_per_rank"}
    assert figures["machine"]["cores"] >= 1
    assert "start-up to the first step" in stdout and "USS difference per rank" in stdout
