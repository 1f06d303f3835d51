"""The optimizer (mingpt/optimizer.py): AdamW as the original builds it, Muon for the hidden matrices with
AdamW for the rest, the learning-rate schedule, and the pieces distributed/muon.py shares with it."""
import pytest
import torch
import torch.nn as nn
from helpers import tiny_gpt

from mingpt.common.errors import ConfigError
from mingpt.optimizer import (
    MUON_GROUP,
    OptimizerConfig,
    create_optimizer,
    learning_rate_at,
    parameter_groups,
    set_learning_rate,
)


def test_weight_decay_applies_to_linear_weights_only():
    model = tiny_gpt()
    decay, no_decay = parameter_groups(model, 0.1)
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    assert {id(p) for p in decay["params"]} == linear_weights
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    for name in ("tok_emb.weight", "pos_emb.weight", "ln_f.weight", "blocks.0.attn.qkv.bias"):
        param = model.get_parameter(name)
        assert any(param is p for p in no_decay["params"]), name


def test_optimizer_is_adamw_with_gpt2_betas():
    optimizer = create_optimizer(tiny_gpt(), OptimizerConfig(learning_rate=1e-3, weight_decay=0.2))
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.95) and group["lr"] == 1e-3 and group["weight_decay"] == 0.2
    assert group["fused"] is True


def test_muon_trains_the_hidden_matrices_and_adamw_the_rest():
    """The blocks' weight matrices under torch.optim.Muon (one momentum each), the embeddings, the
    output layer, biases and LayerNorms under AdamW (two moments); one optimizer to the Trainer,
    whose schedule moves both peaks alike and whose state round-trips."""
    model = tiny_gpt()
    optimizer = create_optimizer(model, OptimizerConfig(name="muon", learning_rate=1e-3, muon_learning_rate=0.02))
    hidden = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)} - {"head"}
    muon = {id(p) for group in optimizer.param_groups if group.get(MUON_GROUP) for p in group["params"]}
    assert muon == {id(model.get_submodule(name).weight) for name in hidden}
    assert len(optimizer.muon.param_groups) == 1 and len(optimizer.adamw.param_groups) == 2
    ids = torch.randint(50, (4, 8))
    for _ in range(2):
        optimizer.zero_grad()
        model(ids, ids)[1].backward()
        optimizer.step()
    kinds = {name: sorted(optimizer.state[p]) for name, p in model.named_parameters()}
    assert kinds["blocks.0.attn.qkv.weight"] == ["momentum_buffer"]
    assert kinds["tok_emb.weight"] == kinds["head.weight"] == ["exp_avg", "exp_avg_sq", "step"]
    set_learning_rate(optimizer, 0, 10, OptimizerConfig(name="muon", learning_rate=1e-3, warmup_steps=4))
    assert sorted(group["lr"] for group in optimizer.param_groups) == [2.5e-4, 2.5e-4, 0.005]
    again = create_optimizer(model, OptimizerConfig(name="muon"))
    again.load_state_dict(optimizer.state_dict())
    assert again.muon.state is again.state and torch.equal(
        again.state[model.blocks[0].attn.qkv.weight]["momentum_buffer"],
        optimizer.state[model.blocks[0].attn.qkv.weight]["momentum_buffer"])


def test_bad_optimizer_config_names_the_key():
    with pytest.raises(ConfigError, match="optimizer_config.learning_rate"):
        OptimizerConfig(learning_rate=0)
    with pytest.raises(ConfigError, match="optimizer_config.name: must be one of adamw, muon"):
        OptimizerConfig(name="lion")


def test_learning_rate_warms_up_then_follows_the_schedule():
    cosine = OptimizerConfig(learning_rate=1.0, lr_schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert learning_rate_at(0, 110, cosine) == pytest.approx(0.1)
    assert learning_rate_at(9, 110, cosine) == pytest.approx(1.0)
    assert learning_rate_at(60, 110, cosine) == pytest.approx(0.55)  # half way down the cosine
    assert learning_rate_at(110, 110, cosine) == pytest.approx(0.1)
    assert learning_rate_at(500, 110, cosine) == pytest.approx(0.1)
    constant = OptimizerConfig(learning_rate=0.5)
    assert {learning_rate_at(step, 100, constant) for step in (0, 50, 99)} == {0.5}


def test_the_cooldown_brings_every_rate_down_in_a_line_over_the_last_share_of_the_steps():
    """A warmup-stable-decay schedule: constant to the last half here, then down towards 0 (the last
    step still moves), on top of cosine as well; Muon's peak comes down with AdamW's."""
    constant = OptimizerConfig(learning_rate=1.0, cooldown=0.5)
    assert [learning_rate_at(step, 100, constant) for step in (0, 49, 50, 75, 99)] == pytest.approx(
        [1.0, 1.0, 1.0, 0.5, 0.02])
    cosine = OptimizerConfig(learning_rate=1.0, lr_schedule="cosine", min_lr_ratio=0.1, cooldown=0.2)
    no_cooldown = OptimizerConfig(learning_rate=1.0, lr_schedule="cosine", min_lr_ratio=0.1, cooldown=0.0)
    assert learning_rate_at(70, 100, cosine) == learning_rate_at(70, 100, no_cooldown)
    assert learning_rate_at(90, 100, cosine) == pytest.approx(0.5 * learning_rate_at(90, 100, no_cooldown))
    optimizer = create_optimizer(tiny_gpt(), OptimizerConfig(name="muon"))
    set_learning_rate(optimizer, 90, 100, OptimizerConfig(name="muon", learning_rate=1e-3, cooldown=0.2))
    assert sorted(group["lr"] for group in optimizer.param_groups) == pytest.approx([5e-4, 5e-4, 0.01])
    with pytest.raises(ConfigError, match="optimizer_config.cooldown: must be in"):
        OptimizerConfig(cooldown=1.5)
    # Unset, each optimizer's own: AdamW's constant rate to the end (the original's), Muon's cooldown.
    assert learning_rate_at(99, 100, OptimizerConfig(learning_rate=1.0)) == 1.0
    assert learning_rate_at(99, 100, OptimizerConfig(name="muon", learning_rate=1.0)) == pytest.approx(0.02)
    assert learning_rate_at(99, 100, OptimizerConfig(name="muon", learning_rate=1.0, cooldown=0)) == 1.0
    assert OptimizerConfig(cooldown=0.5).describe() == (
        "AdamW, learning rate 0.0003, constant, cooling down to 0 over the last 50% of the steps, weight decay 0.1 "
        "(optimizer_config.name)")


def test_bad_schedule_names_the_key():
    with pytest.raises(ConfigError, match="optimizer_config.lr_schedule"):
        OptimizerConfig(lr_schedule="linear")


def test_the_optimizer_is_named_as_the_run_starts():
    assert OptimizerConfig().describe() == ("AdamW, learning rate 0.0003, constant, weight decay 0.1 "
                                            "(optimizer_config.name)")
    muon = OptimizerConfig(name="muon", warmup_steps=100, lr_schedule="cosine")
    assert muon.describe() == ("Muon for the blocks' matrices (learning rate 0.02, momentum 0.95), AdamW, learning "
                               "rate 0.0003, cosine after 100 warmup steps, cooling down to 0 over the last 50% of "
                               "the steps, weight decay 0.1 for the rest (optimizer_config.name)")

