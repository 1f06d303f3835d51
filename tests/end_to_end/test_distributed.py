"""Real multi-process runs: torchrun with 2 gloo workers on the CPU."""
import os

import pytest
from helpers import (
    WORKER_SCRIPTS,
    assert_ok,
    check_two_rank_run,
    make_text,
    run_main,
    serving,
    tiny_overrides,
)
from workers.fault_injection import INJECTED_ERROR

from mingpt.char_dataset import DataConfig, prepare_corpus
from mingpt.reporting.metrics import default_metrics_path, read_metrics


@pytest.fixture(scope="module")
def probe(probes):
    """Facts from each of 2 ranks after one DDP step, an eval pass and a snapshot."""
    return probes["ddp"]


def test_parameters_are_bitwise_equal_on_both_ranks_after_a_step(probe):
    first, second = probe
    assert first["world_size"] == 2
    assert first["digest_before"] == second["digest_before"]
    assert first["digest_after"] == second["digest_after"]
    assert first["digest_after"] != first["digest_before"], "the step changed nothing"


def test_ranks_see_different_samples_that_together_cover_the_epoch(probe):
    first, second = probe
    assert not set(first["first_batch"]) & set(second["first_batch"])
    covered = set(first["epoch_samples"]) | set(second["epoch_samples"])
    assert len(covered) == first["train_size"]


def test_eval_runs_in_eval_mode_and_averages_over_ranks(probe):
    first, second = probe
    assert first["eval_modes"] and not any(first["eval_modes"] + second["eval_modes"])
    assert first["training_after_eval"] and second["training_after_eval"]
    loss_sum = first["local_loss_sum"] + second["local_loss_sum"]
    mean = loss_sum / (first["local_count"] + second["local_count"])
    assert first["eval_loss"] == pytest.approx(mean, rel=1e-5)
    assert second["eval_loss"] == first["eval_loss"]
    local_means = [p["local_loss_sum"] / p["local_count"] for p in probe]
    assert local_means[0] != local_means[1]  # the average is not one rank's own loss


def test_only_global_rank_zero_writes_the_snapshot(probe):
    assert [p["wrote_snapshot"] for p in probe] == [True, False]


def test_torchrun_from_the_repo_root(ddp_two_epochs):
    """The suite's shared 2-rank run (conftest.ddp_two_epochs) is this command: two epochs."""
    result, folder = ddp_two_epochs, ddp_two_epochs.folder
    check_two_rank_run(result, folder)
    for once in ("Model: GPT", "World: 2 process(es) on 1 node(s), gloo on cpu", "Snapshots:"):
        assert result.stdout.count(once) == 1
    assert "tok/s | MFU" in result.stdout  # progress lines, from rank 0 only (checked above)
    lines = read_metrics(default_metrics_path(str(folder)), "train")
    steps, tokens = [line["step"] for line in lines], [line["tokens"] for line in lines]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == 2 * 85
    assert all(later > earlier for earlier, later in zip(tokens, tokens[1:]))
    assert tokens[0] == 2 * 32 * 16  # both ranks' first batches


def test_torchrun_from_inside_mingpt(fsdp_two_epochs):
    """The suite's shared FSDP run (conftest.fsdp_two_epochs) is this command."""
    check_two_rank_run(fsdp_two_epochs, fsdp_two_epochs.folder)


@pytest.mark.slow
def test_an_error_every_rank_meets_during_the_run_is_said_once(text_file, tmp_path):
    """A damaged snapshot: every rank fails to read it and one says so, the first to get there (they
    agree through the process group's store; none waits for another). The snapshot is left as it was."""
    snapshot = tmp_path / "snap.pt"
    snapshot.write_bytes(b"not a snapshot")
    result = run_main(tiny_overrides(text_file, snapshot), nproc=2)
    assert result.returncode == 1
    said = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and "cannot be loaded" in said[0], result.stderr
    assert snapshot.read_bytes() == b"not a snapshot"


@pytest.mark.slow
@pytest.mark.parametrize("override, said", [
    ("trainer_config.batch_size=0", "error: trainer_config.batch_size: must be positive"),
    # Refused before Hydra would (run_config.check_overrides): it was said by every rank.
    ("trainer_config.batch_sz=1", "error: trainer_config.batch_sz: is not a key of TrainerConfig (did you mean "
                                  "trainer_config.batch_size?)"),
    # Hydra's own refusal, before main() runs: its lines held back, said in one line by local rank 0.
    ("trainer_config.batch_size=abc", "error: Error merging override trainer_config.batch_size=abc; Value 'abc' "
                                      "of type 'str' could not be converted to Integer"),
], ids=["out-of-range", "misspelt", "hydra-wrong-type"])
def test_a_config_error_is_said_by_local_rank_zero_even_when_it_is_the_slowest(text_file, tmp_path, override,
                                                                             said):
    """Every rank meets a bad key before any process group exists; local rank 0 says it. Rank 1 gets
    there seconds first and must not exit before rank 0 has spoken: torchrun would stop rank 0 then."""
    env = dict(os.environ, FAULT="slow_config:3", FAULT_RANK="0", OMP_NUM_THREADS="1")
    result = run_main([*tiny_overrides(text_file, tmp_path / "snap.pt"), override],
                      nproc=2, env=env, script=WORKER_SCRIPTS / "fault_injection.py")
    assert result.returncode == 1
    assert result.stderr.count(said) == 1, result.stderr


@pytest.mark.slow
def test_an_error_on_one_rank_alone_is_reported_by_that_rank(text_file, tmp_path):
    """Local rank 1 stays quiet about errors every rank shares, but not about one of its own."""
    env = dict(os.environ, FAULT="error:3", FAULT_RANK="1", OMP_NUM_THREADS="1")
    result = run_main(tiny_overrides(text_file, tmp_path / "snap.pt"), nproc=2, env=env,
                      script=WORKER_SCRIPTS / "fault_injection.py")
    assert result.returncode == 1
    assert result.stderr.count(f"error: [rank 1] {INJECTED_ERROR}") == 1


@pytest.mark.slow
def test_a_text_behind_a_url_is_read_by_one_rank_while_the_other_waits(tmp_path):
    body = make_text(6000).encode()
    overrides = tiny_overrides("unused", tmp_path / "snap.pt", data_config__cache_dir=tmp_path / "cache",
                               trainer_config__max_steps=3)
    with serving(body) as (url, requests):
        prepare_corpus(DataConfig(path=url, cache_dir=str(tmp_path / "alone")))
        one_reader = len(requests)  # the requests fsspec makes to read it once
        result = run_main([o.replace("unused", url) for o in overrides], nproc=2)
    assert_ok(result)
    assert len(requests) == 2 * one_reader
    assert "Snapshot saved at step 3 (the last)" in result.stdout


@pytest.mark.slow
def test_muon_trains_under_ddp(text_file, tmp_path):
    """Two ranks, optimizer_config.name=muon: each rank's Muon orthogonalises the same all-reduced
    gradients; the run trains and its snapshot holds both optimizers' state."""
    result = run_main(tiny_overrides(text_file, tmp_path / "snap.pt", optimizer_config__name="muon"), nproc=2)
    check_two_rank_run(result, tmp_path / "snap.pt")
    assert ("Optimizer: Muon for the blocks' matrices (learning rate 0.02, momentum 0.95), AdamW, learning rate "
            "0.003, constant, cooling down to 0 over the last 50% of the steps, weight decay 0.1 for the rest "
            "(optimizer_config.name)") in result.stdout
