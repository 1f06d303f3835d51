"""Activation checkpointing in one process, through the Trainer: the same gradients as without it,
with dropout on and under bf16 autocast, and fewer bytes held for the backward pass.
(Under DDP and FSDP on 2 ranks: tests/distributed/test_parallel.py.)"""
import pytest
import torch
from helpers import make_text

from mingpt import start_up
from mingpt import trainer as trainer_module
from mingpt.char_dataset import CharDataset
from mingpt.common.errors import ConfigError
from mingpt.distributed.activation_checkpointing import saved_activations
from mingpt.distributed.precision import Precision
from mingpt.distributed.process_group import DistEnv
from mingpt.model import GPT, GPTConfig
from mingpt.optimizer import OptimizerConfig

CPU = torch.device("cpu")


def one_step(tmp_path, monkeypatch, mode: str, amp_dtype) -> tuple[dict, list[int]]:
    """One step of 2 micro-batches, dropout 0.1 everywhere; the gradients it leaves, and the
    activation bytes each micro-batch's forward pass saved for its backward pass."""
    monkeypatch.setattr(start_up, "resolve_precision",  # bf16 autocast even where it is emulated
                        lambda use_amp, dtype, device: Precision(device.type, amp_dtype))
    monkeypatch.setattr("mingpt.reporting.run_report.peak_flops", lambda device, dtype: None)  # no MFU needed
    dataset = CharDataset(make_text(500), 16)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=dataset.vocab_size, block_size=16))
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU, backend="gloo")
    config = trainer_module.TrainerConfig(batch_size=4, grad_accum_steps=2, data_loader_workers=0,
                                          activation_checkpointing=mode, snapshot_path=str(tmp_path / mode))
    placed = start_up.place_model(config, OptimizerConfig(), model, env)
    trainer = trainer_module.Trainer(config, placed, dataset, None, dataset.vocab, env)
    saved = []
    compute_loss = trainer.compute_loss

    def measured_loss(inputs, targets):
        with saved_activations() as activations:
            loss = compute_loss(inputs, targets)
        saved.append(activations.bytes)
        return loss

    trainer.compute_loss = measured_loss
    ids = torch.randint(dataset.vocab_size, (8, 17), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)  # the dropout masks
    trainer._run_batch(ids[:, :-1], ids[:, 1:])
    return {name: param.grad for name, param in trainer.model.named_parameters()}, saved


@pytest.mark.slow
@pytest.mark.parametrize("amp_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_full_checkpointing_gives_the_same_gradients_from_fewer_saved_bytes(
        tmp_path, monkeypatch, world_of_one, one_torch_thread, amp_dtype):
    """Bitwise: the recomputation repeats the forward pass's operations on the same inputs, with
    the RNG state (so the dropout masks) and the autocast state of the first time."""
    plain, plain_saved = one_step(tmp_path, monkeypatch, "none", amp_dtype)
    checkpointed, checkpointed_saved = one_step(tmp_path, monkeypatch, "full", amp_dtype)
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        assert grad.abs().max() > 0, f"{name}: no gradient"
        off_by = (checkpointed[name] - grad).abs().max()
        assert torch.equal(checkpointed[name], grad), f"{name}: off by {off_by}"
    # Held per block: its input alone, instead of attention's and the MLP's intermediates.
    assert all(0 < full < none / 3 for full, none in zip(checkpointed_saved, plain_saved)), \
        (checkpointed_saved, plain_saved)


def test_an_unknown_mode_names_the_key_and_the_modes():
    with pytest.raises(ConfigError) as refused:
        trainer_module.TrainerConfig(activation_checkpointing="attention")
    assert str(refused.value) == ("trainer_config.activation_checkpointing: must be one of none, full, "
                                  "got 'attention'")
