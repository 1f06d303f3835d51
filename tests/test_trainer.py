"""Trainer options through main.py's run(), in the test's process:
accumulation, schedules, compile, step budgets, evaluation and snapshot cadences."""
import re

import pytest
import torch
from helpers import assert_ok, run_main_in_process, tiny_overrides

from mingpt.common.errors import ConfigError
from mingpt.reporting.metrics import default_metrics_path, read_metrics
from mingpt.trainer import TrainerConfig

NO_DROPOUT = {"gpt_config__embd_pdrop": 0.0, "gpt_config__resid_pdrop": 0.0, "gpt_config__attn_pdrop": 0.0}


@pytest.fixture
def train(text_file, capsys, one_torch_thread):
    """Train with these overrides in this process; the finished run (its stdout)."""
    def run(snapshot, **extra):
        result = run_main_in_process(tiny_overrides(text_file, snapshot, **extra), capsys)
        assert_ok(result)
        return result
    return run


def train_lines(train, snapshot, **extra):
    train(snapshot, **extra)
    return read_metrics(default_metrics_path(str(snapshot)), "train")


@pytest.mark.slow
def test_accumulating_micro_batches_matches_one_big_batch(train, tmp_path):
    whole = train_lines(train, tmp_path / "whole.pt", trainer_config__batch_size=32,
                        trainer_config__max_steps=30, **NO_DROPOUT)
    split = train_lines(train, tmp_path / "split.pt", trainer_config__batch_size=16,
                        trainer_config__grad_accum_steps=2, trainer_config__max_steps=30, **NO_DROPOUT)
    assert len(split) == len(whole)  # one optimizer step per 32 samples either way
    split_losses, whole_losses = ([line["loss"] for line in run] for run in (split, whole))
    assert split_losses == pytest.approx(whole_losses, rel=1e-5)
    assert split[-1]["tokens"] == whole[-1]["tokens"]


@pytest.mark.slow
def test_cosine_schedule_with_warmup_reaches_the_metrics(train, tmp_path):
    lines = train_lines(train, tmp_path / "snap.pt", optimizer_config__lr_schedule="cosine",
                        optimizer_config__warmup_steps=10, optimizer_config__learning_rate=1e-3)
    lrs = [line["lr"] for line in lines]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4, rel=0.05)
    assert all(later <= earlier for earlier, later in zip(lrs[9:], lrs[10:]))


@pytest.mark.slow
def test_compiled_model_trains_and_snapshots_plain_names(train, tmp_path, monkeypatch):
    """compile=True compiles the model in place (TorchDynamo traces the project's modules, dropout and
    attention included, forward and backward through AOTAutograd) and snapshots keep plain names.
    The backend is aot_eager: Inductor's C++ code generation is torch's own and costs a minute here."""
    compile_module = torch.nn.Module.compile
    compiled = []

    def traced_without_codegen(module, *args, **kwargs):
        compiled.append(type(module).__name__)
        compile_module(module, *args, **{**kwargs, "backend": "aot_eager"})

    monkeypatch.setattr(torch.nn.Module, "compile", traced_without_codegen)
    snapshot = tmp_path / "snap.pt"
    lines = train_lines(train, snapshot, trainer_config__compile=True, trainer_config__max_steps=40)
    assert compiled == ["GPT"]
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.5
    names = torch.load(snapshot, weights_only=True)["model_state"]
    assert "tok_emb.weight" in names and not any(name.startswith("_orig_mod") for name in names)


@pytest.mark.slow
@pytest.mark.parametrize("use_amp, peak", [(True, 8e9), (False, 2e9)])
def test_mfu_is_held_against_the_peak_of_the_precision_in_use(monkeypatch, tmp_path, world_of_one,
                                                              one_torch_thread, use_amp, peak):
    """bf16 work held against the fp32 matmul peak read as MFU over 100% on CPUs with fast bf16."""
    import torch
    from helpers import make_text

    from mingpt.char_dataset import CharDataset
    from mingpt.distributed import precision
    from mingpt.distributed.process_group import DistEnv
    from mingpt.model import GPT, GPTConfig
    from mingpt.optimizer import OptimizerConfig
    from mingpt.reporting import flops
    from mingpt.start_up import place_model
    from mingpt.trainer import Trainer, TrainerConfig

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setenv("MINGPT_CACHE_DIR", str(tmp_path))  # measured here, not read from this machine's cache
    monkeypatch.setattr(flops, "measure_cpu_peak",
                        lambda dtype: flops.CpuPeak(8e9 if dtype == "bf16" else 2e9, clean=True))
    flops.peak_flops.cache_clear()
    dataset = CharDataset(make_text(500), 8)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=dataset.vocab_size, block_size=8))
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                  backend="gloo")
    config = TrainerConfig(use_amp=use_amp, data_loader_workers=0, snapshot_path=str(tmp_path / "s.pt"))
    try:
        trainer = Trainer(config, place_model(config, OptimizerConfig(), model, env), dataset, None,
                          dataset.vocab, env)
        assert trainer.report.monitor.peak_flops == peak
    finally:
        flops.peak_flops.cache_clear()


@pytest.mark.slow
def test_a_step_budget_ends_mid_epoch_with_a_snapshot_and_sets_the_schedule(train, tmp_path):
    snapshot = tmp_path / "snap.pt"
    result = train(snapshot, trainer_config__max_epochs=5, trainer_config__max_steps=25,
                   optimizer_config__lr_schedule="cosine")
    lines = read_metrics(default_metrics_path(str(snapshot)), "train")
    assert [line["step"] for line in lines] == list(range(1, 26))  # 169 steps would make an epoch
    assert lines[-1]["lr"] == pytest.approx(3e-4, rel=0.05)  # the cosine floor, reached at step 25
    assert "Snapshot saved at step 25 (the last)" in result.stdout
    state = torch.load(snapshot, weights_only=True)
    assert (state["step"], state["finished_epoch"], state["epoch_samples"]) == (25, 0, 25 * 32)
    # The epoch never ended, and the run's last step is evaluated all the same; then the closing lines.
    assert [line["step"] for line in read_metrics(default_metrics_path(str(snapshot)), "eval")] == [25]
    assert re.search(r"\| Step 25 \| Eval Loss [\d.]+ \(mean over 599 samples on 1 ranks\)", result.stdout)
    assert re.search(r"Finished: epoch 1, step 25, 12,800 tokens \(25 steps in 0:00:\d\d in this run\); "
                     r"train loss [\d.]+, eval loss [\d.]+\nSample from its snapshot: python \S*generate.py "
                     f"--snapshot {snapshot}\n", result.stdout), result.stdout

    again = train(snapshot, trainer_config__max_epochs=5, trainer_config__max_steps=25)
    assert again.stdout.splitlines()[-1] == (
        "Nothing left to do: the snapshot holds the end of this run (trainer_config.max_steps=25); raise it "
        "to train on, or set another trainer_config.snapshot_path to start afresh")


@pytest.mark.slow
def test_evaluation_every_n_steps_on_a_fixed_subset(train, tmp_path):
    snapshot = tmp_path / "snap.pt"
    train(snapshot, trainer_config__max_steps=30, trainer_config__eval_every_steps=10,
          trainer_config__eval_batches=2)
    evals = read_metrics(default_metrics_path(str(snapshot)), "eval")
    assert [(line["step"], line["samples"]) for line in evals] == [(10, 64), (20, 64), (30, 64)]
    assert evals[-1]["loss"] < evals[0]["loss"]


@pytest.mark.slow
def test_snapshots_every_n_minutes_keep_their_cadence(train, tmp_path):
    """Several intervals long even where a step takes 4 ms (CI's machine ran 507 steps in 2 s: one
    timed save in a 1.5 s interval)."""
    folder = tmp_path / "snaps"
    interval_s = 0.5
    result = train(folder, trainer_config__max_epochs=5, trainer_config__keep_last=1000,
                   trainer_config__save_every=100, trainer_config__log_every=1000,
                   trainer_config__save_every_minutes=interval_s / 60)
    timed_line = rf"Snapshot saved at step (\d+) \({re.escape(f'{interval_s / 60:g}')} minutes since the last\)"
    timed = [int(step) for step in re.findall(timed_line, result.stdout)]
    by_step = {int(path.stem.split("_")[1]): path for path in folder.glob("snapshot_*.pt")}
    assert len(timed) >= 2 and set(by_step) == {*timed, 845}, result.stdout  # and the run's end, step 845
    saved = [by_step[step] for step in timed]
    gaps = [later.stat().st_mtime - earlier.stat().st_mtime for earlier, later in zip(saved, saved[1:])]
    assert all(gap > interval_s * 0.9 for gap in gaps), gaps
    # Due one interval after the last, a save comes about a step later (a stalled machine may delay one).
    assert min(gaps) < interval_s + 1.0, gaps


@pytest.mark.parametrize("key, value", [
    ("batch_size", 0), ("log_every", 0), ("keep_last", 0), ("loss_spike_ratio", 0.5), ("amp_dtype", "fp8"),
    ("hellaswag_items", -1)])  # TrainerConfig's own keys and each group's: run_report, checkpointer, guard,
def test_every_group_of_keys_is_checked_by_trainer_config(key, value):  # parallel, hellaswag_eval
    with pytest.raises(ConfigError, match=f"trainer_config.{key}"):
        TrainerConfig(**{key: value})


def test_keeping_gathered_parameters_is_refused_where_nothing_is_sharded():
    with pytest.raises(ConfigError) as refused:
        TrainerConfig(reshard_after_forward=False)
    assert str(refused.value).startswith("trainer_config.reshard_after_forward: applies to sharded methods")
    TrainerConfig(reshard_after_forward=False, distributed_method="fsdp")  # accepted


def test_evaluation_runs_without_gradients_and_without_dropout(tmp_path, world_of_one, one_torch_thread):
    """Every forward pass of an evaluation: no autograd graph (the README's promise; a graph would
    hold every activation of the pass) and dropout off; training mode comes back after it."""
    import torch
    from helpers import make_text

    from mingpt.char_dataset import CharDataset, DataConfig, split_dataset
    from mingpt.model import GPT, GPTConfig
    from mingpt.optimizer import OptimizerConfig
    from mingpt.start_up import place_model
    from mingpt.trainer import Trainer, TrainerConfig

    dataset = CharDataset(make_text(800), 8)
    train_set, test_set = split_dataset(dataset, DataConfig(block_size=8), seed=0)
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=dataset.vocab_size, block_size=8))
    config = TrainerConfig(use_amp=False, data_loader_workers=0, batch_size=16,
                           snapshot_path=str(tmp_path / "s.pt"))
    placed = place_model(config, OptimizerConfig(), model, world_of_one)
    trainer = Trainer(config, placed, train_set, test_set, dataset.vocab, world_of_one)
    seen = []
    trainer.model.register_forward_hook(lambda module, args, out: seen.append(
        (torch.is_grad_enabled(), module.training, out[0].requires_grad)))
    trainer.evaluate(epoch=1)
    assert seen and set(seen) == {(False, False, False)}
    assert trainer.model.training
