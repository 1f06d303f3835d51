"""The one model of memory (memory.py over step_trace.py): composed per method from the traced step,
each rank's share of the state as FSDP2 pads it, and refused before allocation at start-up. The trace
itself: test_step_trace.py. Measured peaks: tests/bench/test_bench_plan.py."""
from dataclasses import replace

import pytest
from helpers import one_error_line, run_main_in_process, tiny_overrides

from mingpt.common.errors import ConfigError
from mingpt.model import GPTConfig
from mingpt.planning import memory
from mingpt.planning.memory import (
    MemoryPlan,
    Placement,
    check_fits,
    estimate_memory,
    fits_in,
    largest_batch,
    model_sizes,
    rank_state,
)
from mingpt.run_config import from_command_line

SMALL = GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=30, block_size=16)
MACHINE = 24 * 2**30
GPT2 = ["gpt_config.model_type=gpt2", "gpt_config.n_layer=null", "gpt_config.n_head=null",
        "gpt_config.n_embd=null"]


def test_methods_divide_the_state_and_add_their_buffers():
    sizes = model_sizes(SMALL)
    one, two = (estimate_memory(SMALL, 8, "none", Placement("ddp", ranks, ranks)) for ranks in (1, 2))
    steps = 4 * sizes.tensors  # AdamW's step count of each parameter tensor
    assert (one.parameters, one.optimizer, one.buffers) == (4 * sizes.total, 8 * sizes.total + steps, 0)
    assert two.buffers == 4 * sizes.total  # DDP's gradient buckets
    fsdp = estimate_memory(SMALL, 8, "none", Placement("fsdp", 4, 4))
    assert fsdp.parameters == sizes.shard_bytes(4) >= 4 * sizes.total // 4
    assert fsdp.optimizer == 2 * fsdp.parameters + steps
    assert fsdp.activations == two.activations  # sharding does not divide activations
    hsdp = estimate_memory(SMALL, 8, "none", Placement("hsdp", 8, 4))
    assert hsdp.parameters == fsdp.parameters  # sharded within a node of 4
    full = estimate_memory(SMALL, 8, "full", Placement("ddp", 2, 2))
    assert full.activations < two.activations / 2


def test_muon_keeps_one_momentum_per_hidden_matrix_parameter():
    """Muon's state is its momentum buffer: a hidden matrix costs 4 bytes a parameter, the rest AdamW's 8
    and a step count a tensor (a block's 4 matrices are Muon's, its 8 vectors AdamW's)."""
    sizes = model_sizes(SMALL)
    assert sizes.hidden == SMALL.n_layer * 12 * SMALL.n_embd ** 2  # qkv 3C^2, proj C^2, fc and proj 4C^2 each
    assert sizes.hidden_tensors == SMALL.n_layer * 4
    muon = estimate_memory(SMALL, 8, "none", Placement("ddp", optimizer="muon"))
    assert muon.optimizer == 8 * (sizes.total - sizes.hidden) + 4 * sizes.hidden + 4 * (sizes.tensors - 4 * 4)


def gpt2_large_plan(method: str) -> MemoryPlan:
    """gpt2-large (708.7M parameters with 65 characters) on 2 ranks of a 24 GiB machine, batch 1."""
    config = GPTConfig(model_type="gpt2-large", n_layer=None, n_head=None, n_embd=None, vocab_size=65,
                       block_size=128)
    estimate = estimate_memory(config, 1, "full", Placement(method, 2, 2))
    plan = MemoryPlan(method, estimate, 1, sharers=2, memory="host memory", available=MACHINE)
    if plan.fits:
        return plan
    advice = memory.suggest(config, 1, "full", Placement(method, 2, 2), fits_in(MACHINE, 2))
    return replace(plan, advice=advice)


@pytest.mark.slow
def test_gpt2_large_under_ddp_on_two_ranks_is_refused_naming_what_it_needs_and_fsdp_fits():
    refused = gpt2_large_plan("ddp")
    assert refused.estimate.peak == pytest.approx(14.2e9, rel=0.01)  # 20 bytes per parameter, and more
    with pytest.raises(ConfigError) as error:
        check_fits([refused])
    message = str(error.value)
    assert message.startswith("trainer_config.distributed_method: ddp needs about 14.")
    assert "for the 2 ranks on this machine; 25.8 GB of host memory available" in message
    assert message.endswith("; use distributed_method=fsdp")  # even batch_size=1 does not fit under DDP
    fsdp = gpt2_large_plan("fsdp")
    assert fsdp.fits and fsdp.estimate.peak < 6.5e9
    check_fits([fsdp])


def test_the_largest_batch_that_fits_is_the_last_that_fits():
    placement = Placement("ddp", 2, 2)
    budget = fits_in(estimate_memory(SMALL, 50, "none", placement).peak)
    largest = largest_batch(SMALL, "none", placement, budget, below=1000)
    assert largest == 50
    assert largest_batch(SMALL, "none", placement, fits_in(1), below=1000) == 0


@pytest.mark.slow
def test_start_up_refuses_a_run_whose_activations_do_not_fit_before_allocating(
        text_file, tmp_path, capsys, monkeypatch):
    """The state alone fits, a step of 4096 samples does not (it would with checkpointing): refused
    in one line naming the fix, before the model is placed on the device."""
    vocab_size = len(set(text_file.read_text()))
    config = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=vocab_size, block_size=16)
    without, checkpointed = (estimate_memory(config, 4096, mode, Placement("ddp")).peak
                             for mode in ("none", "full"))
    available = (without + checkpointed) // 2
    monkeypatch.setattr(memory, "host_memory_available", lambda: available)

    def placed(*args, **kwargs):
        raise AssertionError("the model was placed on the device")

    monkeypatch.setattr("mingpt.planning.placement.parallel.parallelize", placed)
    overrides = tiny_overrides(text_file, tmp_path / "snap.pt", trainer_config__batch_size=4096,
                               gpt_config__n_embd=64, gpt_config__n_head=4)
    result = run_main_in_process(overrides, capsys)
    line = one_error_line(result)
    assert line.startswith("error: trainer_config.distributed_method: ddp needs about ")
    assert "activations" in line and "batch_size=4096" in line
    fix = line.split("; use ")[-1]
    assert fix.startswith("activation_checkpointing=full, or batch_size <= ")
    largest = int(fix.rsplit(" ", 1)[-1])
    fits = fits_in(available)
    assert fits(estimate_memory(config, largest, "none", Placement("ddp")))
    assert not fits(estimate_memory(config, largest + 1, "none", Placement("ddp")))


def test_the_planner_counts_fsdp2_s_padded_chunks_for_every_rank():
    """At 512 ranks a parameter of 768 rows costs every rank 2 rows (its chunk, padded), where an even
    share is 1.5: rank 0 holds 18% more than total / 512 for gpt2, the last rank's optimizer state less."""
    # sized by the default data: the 59 characters of tiny-shakespeare's first 5%, blocks of 128
    model = replace(from_command_line(GPT2, "plan.py").gpt_config, vocab_size=59, block_size=128)
    placement = Placement("fsdp", 512, 8)
    first, last = rank_state(model, placement, 0), rank_state(model, placement, 511)
    even = 4 * model_sizes(model).total / 512
    assert first.parameters == last.parameters > 1.15 * even
    assert last.optimizer < first.optimizer
