import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import tiny_gpt

from mingpt.common.errors import ConfigError
from mingpt.model import GPT, PRESETS, GPTConfig, parameter_seed


def test_attention_is_causal():
    """Changing the token at position t changes no output before t, and does change t's."""
    model = tiny_gpt().eval()
    idx = torch.randint(0, 11, (2, 16))
    for t in (0, 5, 15):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 11
        with torch.no_grad():
            before, _ = model(idx)
            after, _ = model(changed)
        assert torch.equal(before[:, :t], after[:, :t])
        assert not torch.allclose(before[:, t], after[:, t])


def test_attention_is_causal_in_training_too():
    """With dropout on (the CPU's own attention path), under the same random numbers."""
    model = tiny_gpt(attn_pdrop=0.5, resid_pdrop=0.5, embd_pdrop=0.5).train()
    idx = torch.randint(0, 11, (2, 16))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 11
    outputs = []
    for tokens in (idx, changed):
        torch.manual_seed(3)
        outputs.append(model(tokens)[0])
    assert torch.equal(outputs[0][:, :9], outputs[1][:, :9])
    assert not torch.allclose(outputs[0][:, 9], outputs[1][:, 9])


def test_forward_shapes_and_loss_of_an_untrained_model():
    model = tiny_gpt()
    idx = torch.randint(0, 11, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 11)
    assert loss.item() == pytest.approx(math.log(11), rel=0.1)  # near-uniform predictions at init
    assert model(idx)[1] is None


def test_a_padded_vocabulary_computes_what_the_unpadded_one_does():
    """11 tokens in 64 rows: the real rows are the unpadded model's, the padding's zero, the logits and
    the loss the same, and the padding's rows get no gradient, so that they stay zero."""
    padded, unpadded = tiny_gpt(), tiny_gpt(vocab_multiple=1)
    assert padded.head.weight.shape[0] == padded.tok_emb.weight.shape[0] == 64
    assert unpadded.head.weight.shape[0] == 11
    for name in ("tok_emb.weight", "head.weight"):
        weight = padded.get_parameter(name)
        assert torch.equal(weight[:11], unpadded.get_parameter(name)) and not weight[11:].any()
    idx = torch.randint(0, 11, (3, 16), generator=torch.Generator().manual_seed(0))
    padded.eval(), unpadded.eval()
    (logits, loss), (expected_logits, expected_loss) = padded(idx, idx), unpadded(idx, idx)
    assert logits.shape == expected_logits.shape == (3, 16, 11)
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(loss, expected_loss)
    loss.backward(), expected_loss.backward()
    assert not padded.head.weight.grad[11:].any() and not padded.tok_emb.weight.grad[11:].any()
    torch.testing.assert_close(padded.head.weight.grad[:11], unpadded.head.weight.grad)
    torch.testing.assert_close(padded.blocks[0].mlp.fc.weight.grad, unpadded.blocks[0].mlp.fc.weight.grad)


def test_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        tiny_gpt()(torch.zeros(1, 17, dtype=torch.long))


def test_init_follows_gpt2():
    model = tiny_gpt(n_layer=4, n_embd=256, n_head=4)
    residual_std = 0.02 / math.sqrt(2 * 4)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.tok_emb.weight[:11].std().item() == pytest.approx(0.02, rel=0.1)  # the padding's are 0
    assert torch.count_nonzero(model.blocks[0].attn.qkv.bias) == 0
    assert model.head.bias is None


def test_initial_weights_come_from_the_seed_and_each_name_alone():
    """Not from torch's global generator, nor the order of drawing: each parameter its own stream."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=11, block_size=16)
    torch.manual_seed(0)
    first = GPT(config, seed=5).state_dict()
    torch.manual_seed(1)
    again = GPT(config, seed=5)
    assert all(torch.equal(first[name], value) for name, value in again.state_dict().items())
    assert torch.equal(again.initial_value("blocks.1.mlp.fc.weight"), first["blocks.1.mlp.fc.weight"])
    other_seed = GPT(config, seed=6).state_dict()
    assert not torch.equal(other_seed["tok_emb.weight"], first["tok_emb.weight"])
    assert not torch.equal(first["blocks.0.attn.qkv.weight"], first["blocks.1.attn.qkv.weight"])
    # A digest of the name, the same in every process (Python's hash() of a str is not).
    assert parameter_seed(1337, "tok_emb.weight") == 6542469318479812424


def test_presets_fill_the_sizes():
    config = GPTConfig(model_type="gpt-mini", n_layer=None, n_head=None, n_embd=None)
    assert (config.n_layer, config.n_head, config.n_embd) == PRESETS["gpt-mini"] == (6, 6, 192)


@pytest.mark.parametrize("settings, key", [
    (dict(model_type="gpt-mini"), "gpt_config.model_type"),  # preset with the default sizes
    (dict(model_type="gpt-99"), "gpt_config.model_type"),
    (dict(n_embd=100, n_head=8), "gpt_config.n_embd"),
    (dict(n_layer=0), "gpt_config.n_layer"),
    (dict(n_layer=None), "gpt_config.n_layer"),
    (dict(attn_pdrop=1.0), "gpt_config.attn_pdrop"),
    (dict(activation="relu"), "gpt_config.activation"),
    (dict(init_from=""), "gpt_config.init_from"),
])
def test_bad_model_configs_name_the_key(settings, key):
    with pytest.raises(ConfigError) as error:
        GPTConfig(**settings)
    assert error.value.key == key


def test_the_activation_is_the_exact_gelu_or_gpt2s_tanh_approximation():
    x = torch.linspace(-4, 4, 101)
    for activation, approximate in (("gelu", "none"), ("gelu_tanh", "tanh")):
        mlp = tiny_gpt(activation=activation).blocks[0].mlp
        torch.testing.assert_close(mlp.gelu(x), F.gelu(x, approximate=approximate), rtol=0, atol=0)
    assert (F.gelu(x) - F.gelu(x, approximate="tanh")).abs().max() > 1e-4  # the choice matters


def test_an_initial_value_may_be_asked_for_a_few_rows():
    """What a rank holding a shard asks for: those rows of the value the whole model would have."""
    model = tiny_gpt()
    for name in ("tok_emb.weight", "blocks.1.mlp.fc.bias", "ln_f.weight"):
        assert torch.equal(model.initial_value(name, slice(3, 7)), model.initial_value(name)[3:7])


def test_flops_per_token_counts_matmul_weights():
    model = tiny_gpt()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert model.flops_per_token() == 6 * linear + 6 * 2 * 16 * 32
