"""Which precision a device trains in, and end-to-end runs in the precisions users actually get: bf16
autocast (use_amp, the default, on this project's CPUs) and fp16 autocast with a GradScaler (every
CUDA run's default, forced on the CPU by tests/workers/amp_probe.py)."""
import shutil
import sys

import pytest
import torch
from helpers import MAIN, WORKER_SCRIPTS, assert_ok, run_main, run_main_in_process, tiny_overrides
from state_equality import assert_same_state

from mingpt.common.logger import configure_logging
from mingpt.distributed import precision
from mingpt.distributed.parallel import unwrap
from mingpt.distributed.precision import Precision, resolve_precision
from mingpt.reporting.metrics import default_metrics_path, read_metrics

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only described, never used: nothing here touches a GPU


def test_amp_off_is_fp32():
    chosen = resolve_precision(False, "float16", CPU)
    assert chosen.amp_dtype is None and not chosen.needs_grad_scaler and str(chosen) == "fp32"
    assert chosen.matmul_dtype == "fp32"


def test_cpu_with_native_bf16_uses_bf16_autocast(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    chosen = resolve_precision(True, "float16", CPU)
    assert chosen.amp_dtype == torch.bfloat16 and not chosen.needs_grad_scaler
    assert chosen.matmul_dtype == "bf16"
    with chosen.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_cpu_without_native_bf16_ignores_amp_with_one_warning(monkeypatch, capsys):
    configure_logging(rank=0)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    chosen = resolve_precision(True, "bfloat16", CPU)
    assert chosen.amp_dtype is None
    out = capsys.readouterr().out
    assert out.count("warning: trainer_config.use_amp ignored") == 1


def test_the_warning_is_rank_zeros_alone(monkeypatch, capsys):
    configure_logging(rank=1)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    resolve_precision(True, "float16", CPU)
    assert capsys.readouterr().out == ""
    configure_logging(rank=0)


def test_cuda_fp16_uses_a_grad_scaler():
    chosen = resolve_precision(True, "float16", CUDA)
    assert chosen.amp_dtype == torch.float16 and chosen.needs_grad_scaler
    assert str(chosen) == "fp16 mixed precision + GradScaler" and chosen.matmul_dtype == "fp16"


def test_bf16_on_a_gpu_that_only_emulates_it_falls_back_to_fp16(monkeypatch):
    # A V100 or T4: torch counts bf16 as supported unless asked about native support.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    chosen = resolve_precision(True, "bfloat16", CUDA)
    assert chosen.amp_dtype == torch.float16 and chosen.needs_grad_scaler


def test_bf16_on_a_gpu_with_native_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    chosen = resolve_precision(True, "bfloat16", CUDA)
    assert chosen.amp_dtype == torch.bfloat16 and str(chosen) == "bf16 mixed precision"


def test_fp32_on_cuda_allows_tf32_and_says_so():
    chosen = resolve_precision(False, "float16", CUDA)
    assert chosen.matmul_dtype == "tf32" and str(chosen) == "fp32 (TF32 matmuls)"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        chosen.configure_matmuls()
        assert torch.get_float32_matmul_precision() == "high"
        torch.set_float32_matmul_precision("highest")
        Precision("cpu", None).configure_matmuls()  # the CPU's fp32 stays fp32
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


# End to end, through main.py: 1 process, and 2 under torchrun (DDP).

AMP_PROBE = WORKER_SCRIPTS / "amp_probe.py"
INITIAL_SCALE = 2.0**16  # GradScaler's

needs_native_bf16 = pytest.mark.skipif(
    not precision.cpu_has_native_bf16(),
    reason="this CPU has no native bf16 (AVX512-BF16 or AMX): use_amp trains in fp32 here, no bf16 to test")


def amp_overrides(text_file, folder, **extra) -> list[str]:
    """A short use_amp=True run (a quarter of the text: about 40 steps per epoch on 1 rank, 20 on 2),
    snapshotting into folder every 10 steps and at every epoch, keeping them all."""
    return tiny_overrides(text_file, folder, data_config__truncate=0.25, trainer_config__use_amp=True,
                          trainer_config__save_every_steps=10, trainer_config__keep_last=20, **extra)


def amp_run(text_file, folder, nproc, script=MAIN, env=None, **extra):
    result = run_main(amp_overrides(text_file, folder, **extra), nproc=nproc if nproc > 1 else None,
                      script=script, env=env)
    assert_ok(result)
    return result


@pytest.fixture
def fp16_run(text_file, monkeypatch, capsys, one_torch_thread):
    """fp16 runs with a GradScaler whose loss scale doubles every 3 clean steps: on 1 rank in this
    process (tests/workers/amp_probe.py's forcing, applied here), on 2 through that script."""
    from workers import amp_probe

    from mingpt import start_up
    from mingpt.distributed import parallel

    monkeypatch.setenv("SCALER_GROWTH_INTERVAL", "3")
    monkeypatch.setattr(start_up, "resolve_precision", amp_probe.fp16_with_a_scaler)
    monkeypatch.setattr(torch.amp, "GradScaler", amp_probe.FastGrowingScaler)
    monkeypatch.setattr(parallel, "FusedShardedGradScaler", amp_probe.FastGrowingShardedScaler)

    def run(folder, nproc, **extra):
        if nproc == 1:
            result = run_main_in_process(amp_overrides(text_file, folder, **extra), capsys)
            assert_ok(result)
            return result
        return amp_run(text_file, folder, nproc, script=AMP_PROBE, env={"SCALER_GROWTH_INTERVAL": "3"},
                       **extra)
    return run


def world_line(result) -> str:
    return next(line for line in result.stdout.splitlines() if line.startswith("World:"))


def step_losses(folder) -> list[float]:
    return [line["loss"] for line in read_metrics(default_metrics_path(str(folder)), "train")]


def snapshots(folder) -> dict[str, dict]:
    """The folder's snapshots by file name, oldest first."""
    return {path.name: torch.load(path, weights_only=True) for path in sorted(folder.glob("snapshot_*.pt"))}


def first_snapshot(taken: dict[str, dict], at: str) -> str:
    """Name of the first snapshot taken at an epoch's end ("epoch") or part-way through one ("step")."""
    return next(name for name, snapshot in taken.items() if (snapshot["epoch_step"] == 0) == (at == "epoch"))


@pytest.mark.slow
@needs_native_bf16
@pytest.mark.parametrize("nproc", [1, 2])
def test_bf16_autocast_trains_end_to_end(text_file, tmp_path, nproc):
    result = amp_run(text_file, tmp_path / "run", nproc)
    assert "; bf16 mixed precision;" in world_line(result)
    losses = step_losses(tmp_path / "run")
    assert losses[-1] < losses[0] - 0.5, "bf16 did not train"
    final = list(snapshots(tmp_path / "run").values())[-1]
    assert final["finished_epoch"] == 1 and final["scaler_state"] == {}  # bf16 needs no loss scaling


SCALERS = {"ddp": "GradScaler", "fsdp": "FusedShardedGradScaler"}


@pytest.mark.slow
@pytest.mark.parametrize("method, nproc, resume_at", [("ddp", 1, "epoch"), ("fsdp", 2, "step")])
def test_fp16_with_a_grad_scaler_trains_and_resumes_bitwise(fp16_run, tmp_path, method, nproc, resume_at):
    """Two epochs unbroken, and again from one of its snapshots: every snapshot the resumed run
    writes equals the unbroken run's, weights, AdamW state and scaler state alike. The loss scale
    grows every 3 clean steps here, so it has grown and backed off after overflows (skipped steps)
    by the snapshot: a resumed run that started from a fresh scaler would skip other steps. Under
    FSDP the scaler is the sharded one (each rank sees a shard of the gradients, so the overflow
    flag is all-reduced), and a DDP run in one process then resumes its last snapshot."""
    unbroken = tmp_path / "unbroken"
    result = fp16_run(unbroken, nproc, trainer_config__max_epochs=2,
                      trainer_config__distributed_method=method)
    assert "; fp16 mixed precision + GradScaler;" in world_line(result)
    assert f"Scaler: {SCALERS[method]}\n" in result.stdout
    losses = step_losses(unbroken)
    assert losses[-1] < losses[0] - 0.5, "fp16 did not train"
    expected = snapshots(unbroken)
    resume_from = first_snapshot(expected, resume_at)
    saved = expected[resume_from]
    assert saved["scaler_state"]["scale"] != INITIAL_SCALE, "the test needs a scale that moved"

    (tmp_path / "resumed").mkdir()
    shutil.copy(unbroken / resume_from, tmp_path / "resumed" / resume_from)
    result = fp16_run(tmp_path / "resumed", nproc, trainer_config__max_epochs=2,
                      trainer_config__distributed_method=method)
    where = ("" if resume_at == "epoch"
             else f" (step {saved['step']}, sample {saved['epoch_samples']} of epoch 1)")
    assert f"Resuming training from snapshot at Epoch {saved['finished_epoch']}{where}\n" in result.stdout
    written = snapshots(tmp_path / "resumed")
    assert len(written) > 2 and written.keys() <= expected.keys()
    for name, snapshot in written.items():
        for key in ("step", "scaler_state", "model_state", "optimizer_state"):
            assert_same_state(snapshot[key], expected[name][key], f"{name} {key}")
    if method == "fsdp":
        assert_ddp_continues(fp16_run, unbroken, tmp_path / "by_ddp", losses[0])


def assert_ddp_continues(fp16_run, unbroken, folder, first_loss):
    """DDP in one process resumes an FSDP fp16 run's last snapshot (its sharded scaler's state, its
    fused AdamW's) for a few steps, from the trained weights."""
    last_name, last = list(snapshots(unbroken).items())[-1]
    folder.mkdir()
    shutil.copy(unbroken / last_name, folder / last_name)
    result = fp16_run(folder, 1, trainer_config__max_epochs=3, trainer_config__max_steps=last["step"] + 3)
    assert "Scaler: GradScaler\n" in result.stdout
    resumed = step_losses(folder)
    assert len(resumed) == 3 and max(resumed) < first_loss - 0.5, "DDP did not continue from FSDP's weights"


def small_trainer(tmp_path, monkeypatch, force_fp16=False, method="ddp"):
    """A Trainer of a tiny model without dropout in a world of one, and a batch of 8 for it."""
    from helpers import make_text

    from mingpt import start_up
    from mingpt import trainer as trainer_module
    from mingpt.char_dataset import CharDataset
    from mingpt.distributed.process_group import DistEnv
    from mingpt.model import GPT, GPTConfig
    from mingpt.optimizer import OptimizerConfig

    if force_fp16:
        monkeypatch.setattr(start_up, "resolve_precision",
                            lambda use_amp, amp_dtype, device: Precision(device.type, torch.float16))
    monkeypatch.setattr("mingpt.reporting.run_report.peak_flops", lambda device, dtype: None)  # no MFU needed
    dataset = CharDataset(make_text(500), 16)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=dataset.vocab_size, block_size=16,
                          embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(dataset.vocab_size, (8, 17), generator=torch.Generator().manual_seed(0))
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU, backend="gloo")
    config = trainer_module.TrainerConfig(batch_size=8, data_loader_workers=0, use_amp=True,
                                          snapshot_path=str(tmp_path / "s.pt"), distributed_method=method)
    placed = start_up.place_model(config, OptimizerConfig(), model, env)
    trainer = trainer_module.Trainer(config, placed, dataset, None, dataset.vocab, env)
    return trainer, ids[:, :-1], ids[:, 1:]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ddp", "fsdp"])
def test_an_fp16_step_never_reads_a_value_back_to_the_host(tmp_path, monkeypatch, world_of_one,
                                                            one_torch_thread, method):
    """.item() is a host sync on a GPU: GradScaler reads its overflow flag so unless the optimizer's
    fused kernel takes the flag itself, which FSDP's ShardedGradScaler's flag did not fit."""
    trainer, inputs, targets = small_trainer(tmp_path, monkeypatch, force_fp16=True, method=method)
    readers = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda tensor: readers.append(sys._getframe(1).f_code.co_name)
                        or item(tensor))
    for _ in range(3):
        trainer._run_batch(inputs, targets)
    monkeypatch.undo()  # before anything else reads a value back
    # ShardedGradScaler updates a scale that lives on the CPU in Python; on a GPU, with a kernel.
    assert [reader for reader in readers if reader != "_amp_update_scale_cpu_"] == []
    assert trainer.scaler.get_scale() == INITIAL_SCALE  # no overflow, no skipped step, scale unchanged


@pytest.mark.slow
@needs_native_bf16
def test_use_amp_computes_in_bf16_on_this_cpu(tmp_path, monkeypatch, world_of_one, one_torch_thread):
    trainer, inputs, targets = small_trainer(tmp_path, monkeypatch)
    dtypes = []
    unwrap(trainer.model).head.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    trainer._run_batch(inputs, targets)
    assert dtypes == [torch.bfloat16]


def test_clipping_sees_the_unscaled_gradient_norm(tmp_path, monkeypatch, world_of_one, one_torch_thread):
    """Under fp16 the GradScaler multiplies the loss, and so the gradients, by 65,536: the norm
    clip_grad_norm_ measures must be the true one, the fp32 norm of the same batch's gradients."""
    import copy

    trainer, inputs, targets = small_trainer(tmp_path, monkeypatch, force_fp16=True)
    reference = copy.deepcopy(trainer.model)
    reference(inputs, targets)[1].backward()
    true_norm = torch.stack([p.grad.norm() for p in reference.parameters()]).norm().item()
    seen = []
    clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(*args, **kwargs):
        norm = clip(*args, **kwargs)
        seen.append(norm.item())
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    assert trainer.scaler.is_enabled() and trainer.scaler.get_scale() == INITIAL_SCALE
    trainer._run_batch(inputs, targets)
    assert seen == [pytest.approx(true_norm, rel=0.02)]
    assert true_norm > trainer.config.grad_norm_clip  # the clip acts on this step
