"""GPT.generate's sampling (model.py): top-k, temperature, greedy decoding, context cropping, seeding and
model mode, and the key/value cache that makes it fast."""
import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from mingpt.common.tensor_ops import keep_top_k, next_token
from mingpt.model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class FixedLogits(nn.Module):
    """Stands in for GPT: the same logits at every position; remembers each context it was given."""

    def __init__(self, logits: list[float], block_size: int = 4):
        super().__init__()
        self.config = SimpleNamespace(block_size=block_size)
        self.logits = torch.tensor(logits)
        self.contexts: list[torch.Tensor] = []

    generate = functools.partialmethod(GPT.generate, use_cache=False)  # GPT's sampling, over these logits

    def forward(self, idx: torch.Tensor):
        self.contexts.append(idx.clone())
        B, T = idx.shape
        return self.logits.expand(B, T, -1), None


def tiny_gpt(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=7, block_size=8,
                         embd_pdrop=dropout, resid_pdrop=dropout, attn_pdrop=dropout))


def draw_once(model: nn.Module, rows: int, seed: int = 0, **settings) -> torch.Tensor:
    """One new token for each of `rows` one-token prompts: `rows` independent draws."""
    prompt = torch.zeros(rows, 1, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    return model.generate(prompt, max_new_tokens=1, generator=generator, **settings)[:, -1]


def frequencies(tokens: torch.Tensor, vocab_size: int) -> list[float]:
    return (torch.bincount(tokens, minlength=vocab_size).float() / len(tokens)).tolist()


def test_top_k_draws_only_from_the_k_most_likely_tokens():
    model = FixedLogits([0.5, 3.0, 0.0, 2.5, 1.0])
    tokens = draw_once(model, rows=2000, top_k=2)
    assert set(tokens.tolist()) == {1, 3}  # both of the two most likely, nothing else


def test_top_k_keeps_exactly_k_even_when_logits_tie():
    kept = keep_top_k(torch.zeros(3, 6), k=2)
    assert (kept.isfinite().sum(dim=-1) == 2).all()


def test_top_k_at_least_the_vocabulary_keeps_every_token():
    logits = torch.tensor([[0.1, 0.2, 0.3]])
    assert torch.equal(keep_top_k(logits, k=10), logits)


def test_low_temperature_sharpens_and_high_temperature_flattens():
    model = FixedLogits([0.0, 1.0, 2.0])  # at temperature 1: 0.09, 0.24, 0.67
    cold = frequencies(draw_once(model, rows=4000, temperature=0.25), 3)
    hot = frequencies(draw_once(model, rows=4000, temperature=10.0), 3)
    assert cold[2] > 0.95  # exp(8) / (1 + exp(4) + exp(8)) = 0.98
    assert all(0.25 < f < 0.42 for f in hot)  # 0.30, 0.33, 0.37


def test_temperature_one_draws_from_the_softmax():
    model = FixedLogits([0.0, 1.0, 2.0])
    observed = frequencies(draw_once(model, rows=8000), 3)
    for seen, expected in zip(observed, torch.softmax(model.logits, dim=0).tolist()):
        assert seen == pytest.approx(expected, abs=0.025)


def test_temperature_zero_is_greedy_like_top_k_one_and_ignores_the_seed():
    model = tiny_gpt()
    prompt = torch.tensor([[1, 2, 3]])
    greedy = [model.generate(prompt, 12, temperature=0, generator=torch.Generator().manual_seed(s))
              for s in (1, 2)]
    top_1 = model.generate(prompt, 12, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(greedy[0], greedy[1]) and torch.equal(greedy[0], top_1)
    logits, _ = model(prompt)
    assert greedy[0][0, 3] == logits[0, -1].argmax()  # the first new token is the most likely one


def test_context_longer_than_block_size_is_cropped_to_the_last_block_size_tokens():
    model = FixedLogits([0.0, 1.0, 2.0], block_size=4)
    prompt = torch.tensor([[0, 1, 2, 0, 1, 2, 0, 1, 2, 0]])  # 10 tokens, block_size 4
    out = model.generate(prompt, max_new_tokens=3, temperature=0)
    assert [c.shape[1] for c in model.contexts] == [4, 4, 4]
    for step, context in enumerate(model.contexts):
        assert torch.equal(context, out[:, 10 + step - 4: 10 + step])  # the newest tokens, not the oldest


def test_real_gpt_continues_past_its_block_size():
    model = tiny_gpt()
    prompt = torch.randint(0, 7, (2, 20))  # block_size 8
    out = model.generate(prompt, max_new_tokens=10, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 30)
    assert torch.equal(out[:, :20], prompt)
    assert out.min() >= 0 and out.max() < 7


def test_same_seed_same_tokens_other_seed_other_tokens():
    model = tiny_gpt()
    prompt = torch.tensor([[1, 2, 3]])

    def run(seed: int) -> torch.Tensor:
        return model.generate(prompt, 40, temperature=1.5, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))


def record_forwards(model: nn.Module) -> list[tuple[bool, bool, bool]]:
    """At each forward: (grad mode on, logits require grad, model in training mode)."""
    seen = []
    model.register_forward_hook(lambda module, args, output: seen.append(
        (torch.is_grad_enabled(), output[0].requires_grad, module.training)))
    return seen


def test_runs_in_eval_mode_without_building_a_graph_and_restores_the_mode():
    model = tiny_gpt(dropout=0.5).train()
    seen = record_forwards(model)
    prompt = torch.tensor([[1, 2, 3]])
    first, second = (model.generate(prompt, 10, temperature=0) for _ in range(2))
    assert seen == [(False, False, False)] * 20
    assert torch.equal(first, second), "dropout was active while sampling"
    assert model.training
    model.eval()
    model.generate(prompt, 1)
    assert not model.training


def test_mode_and_grad_mode_are_restored_when_the_model_fails_mid_sampling():
    model = tiny_gpt().train()
    seen = record_forwards(model)

    def fail_on_third_call(module, args):
        if len(seen) == 2:
            raise RuntimeError("out of memory")

    model.register_forward_pre_hook(fail_on_third_call)
    with pytest.raises(RuntimeError, match="out of memory"):
        model.generate(torch.tensor([[1, 2, 3]]), 10)
    assert seen == [(False, False, False)] * 2
    assert model.training and torch.is_grad_enabled()


def test_zero_new_tokens_returns_the_prompt():
    prompt = torch.tensor([[1, 2]])
    assert torch.equal(tiny_gpt().generate(prompt, 0), prompt)


@pytest.mark.parametrize("settings, message", [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": 0}, "top_k"),
])
def test_meaningless_settings_are_refused(settings, message):
    arguments = {"max_new_tokens": 1, **settings}
    with pytest.raises(ValueError, match=message):
        tiny_gpt().generate(torch.tensor([[1]]), **arguments)


def test_an_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="T >= 1"):
        tiny_gpt().generate(torch.zeros(1, 0, dtype=torch.long), 1)


def logits_of_each_step(model: GPT, prompt: torch.Tensor, steps: int, use_cache: bool) -> list[torch.Tensor]:
    """The last position's logits at each step of a greedy generation, as GPT.generate computes them."""
    seen = []
    original = next_token

    def recorded(logits, *args):
        seen.append(logits.clone())
        return original(logits, *args)

    import mingpt.model

    mingpt.model.next_token = recorded
    try:
        tokens = model.generate(prompt, steps, temperature=0, use_cache=use_cache)
    finally:
        mingpt.model.next_token = original
    return tokens, seen


@pytest.mark.parametrize("activation, vocab_multiple", [("gelu", 64), ("gelu_tanh", 1)])
def test_the_cache_gives_the_uncached_tokens_and_logits_also_past_block_size(activation, vocab_multiple):
    """A prompt of 3, 14 new tokens with block_size 8: within the window each token is one cached
    position, past it the window slides and is computed afresh; greedy tokens identical, logits within
    1e-4 at every step (a GPT-2 folder's model, gelu_tanh without padding, and the default's)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=11, block_size=8, activation=activation,
                          vocab_multiple=vocab_multiple, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0))
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    cached, cached_logits = logits_of_each_step(model, prompt, 14, use_cache=True)
    uncached, uncached_logits = logits_of_each_step(model, prompt, 14, use_cache=False)
    assert torch.equal(cached, uncached) and cached.shape == (2, 17)
    for step, (ours, theirs) in enumerate(zip(cached_logits, uncached_logits)):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0, msg=f"step {step}")


def test_a_cached_generation_computes_each_new_token_as_one_position():
    """The prompt once, then one position per token (what makes it fast), until the window slides."""
    model = tiny_gpt()
    lengths = []
    model.register_forward_pre_hook(lambda module, args, kwargs: lengths.append(args[0].size(1)),
                                    with_kwargs=True)
    model.generate(torch.tensor([[1, 2, 3]]), 8, temperature=0)
    assert lengths == [3, 1, 1, 1, 1, 1, 8, 8]  # block_size 8: from the 9th token on, the window slides
