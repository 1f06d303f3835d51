"""The one model of memory (memory.py over step_trace.py): traced from the model's own step, composed
per method, and refused before allocation at start-up. Measured peaks: tests/bench/test_bench_plan.py."""
from dataclasses import replace

import pytest
import torch
from helpers import one_error_line, run_main_in_process, tiny_overrides

from mingpt.common.errors import ConfigError
from mingpt.model import GPTConfig
from mingpt.planning import memory
from mingpt.planning.memory import (
    FP32,
    MemoryPlan,
    Placement,
    check_fits,
    estimate_memory,
    fits_in,
    largest_batch,
    model_sizes,
)
from mingpt.planning.step_trace import TraceKey, _trace_once, trace_step

SMALL = GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=30, block_size=16)
MACHINE = 24 * 2**30


def whole_step_peaks(key: TraceKey, n_layer: int, batch_size: int) -> dict[tuple[str, bool], int]:
    """The largest totals of a step traced whole (every block), gradients of finished blocks
    included: in each phase, inside the blocks and outside them."""
    block_gradients = trace_step(key).block_gradient_bytes
    peaks: dict[tuple[str, bool], int] = {}
    for (phase, where), moments in _trace_once(key, n_layer, batch_size).items():
        if phase == "forward" or where == "post":
            done = 0
        else:
            done = n_layer if where == "pre" else n_layer - 1 - where
        for moment in moments:
            live = moment.activations + moment.casts + moment.block_gradients + moment.other_gradients
            group = (phase, isinstance(where, int))
            peaks[group] = max(peaks.get(group, 0), live + done * block_gradients)
    return peaks


@pytest.mark.slow
@pytest.mark.parametrize("device_type, dtype, casts, checkpointing", [
    ("cpu", None, False, "none"), ("cpu", None, False, "full"), ("cpu", torch.bfloat16, True, "none"),
    ("cuda", torch.bfloat16, False, "full")])
def test_two_traced_blocks_at_two_batch_sizes_stand_for_any_depth_and_batch(device_type, dtype, casts,
                                                                              checkpointing):
    """Extrapolated from two blocks at 2 and 3 samples, the peak is the whole 4-block step's at 5
    (fp32; FSDP's bf16 parameters; a GPU's autocast with checkpointing)."""
    key = TraceKey(SMALL, device_type, dtype, casts, checkpointing)
    trace = trace_step(key)
    extrapolated: dict[tuple[str, bool], int] = {}
    for point in trace.points(SMALL.n_layer):
        moment, group = point.moment, (point.phase, point.block is not None)
        live = moment.at(5) + moment.casts + moment.block_gradients + moment.other_gradients
        live += point.blocks_done * trace.block_gradient_bytes
        extrapolated[group] = max(extrapolated.get(group, 0), live)
    whole = whole_step_peaks(key, SMALL.n_layer, 5)
    assert extrapolated.keys() == whole.keys()
    for group, peak in whole.items():
        assert extrapolated[group] == pytest.approx(peak, rel=1e-3), group


def test_the_cpu_step_keeps_its_dropout_masks_and_attention_maps():
    """The model's own CPU dropout keeps a mask in the activations' dtype, and with attention dropout
    its attention keeps B x nh x T x T maps: at least the masks and one map per block are held at the
    end of the forward pass beyond what a step without dropout holds."""
    batch, config = 4, SMALL
    without = replace(config, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
    traces = {c.attn_pdrop: trace_step(TraceKey(c, "cpu", None, False, "none")) for c in (config, without)}
    held = {dropout: trace.saved_activations(config.n_layer).at(batch) for dropout, trace in traces.items()}
    activation = batch * config.block_size * config.n_embd * FP32
    attention_map = batch * config.n_head * config.block_size ** 2 * FP32
    masks = activation * (1 + 2 * config.n_layer)  # the embeddings', and two per block
    assert held[0.1] - held[0.0] >= masks + config.n_layer * attention_map


@pytest.mark.slow
def test_a_gpu_step_keeps_one_byte_masks_and_no_attention_maps():
    """On a GPU, F.dropout keeps a one-byte mask and SDPA's fused kernel no B x nh x T x T maps (only
    a B x nh x T log-sum-exp and its random seed): the CPU step holds the maps and three bytes per
    mask element more."""
    batch, config = 4, replace(SMALL, block_size=64)
    held = {device: trace_step(TraceKey(config, device, None, False, "none")).saved_activations(
        config.n_layer).at(batch) for device in ("cpu", "cuda")}
    elements = batch * config.block_size * config.n_embd
    attention_maps = 3 * batch * config.n_head * config.block_size ** 2 * FP32  # scores, weights, mask
    masks = 3 * elements * (1 + 2 * config.n_layer)
    flash = batch * config.n_head * config.block_size * FP32 + 64  # log-sum-exp, seed and offset
    assert held["cpu"] - held["cuda"] >= config.n_layer * (attention_maps - flash) + masks


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
    """Muon's state is its momentum buffer: a hidden matrix costs 4 bytes a parameter, the rest AdamW's 8."""
    sizes = model_sizes(SMALL)
    assert sizes.hidden == SMALL.n_layer * 12 * SMALL.n_embd ** 2  # qkv 3C^2, proj C^2, fc and proj 4C^2 each
    muon = estimate_memory(SMALL, 8, "none", Placement("ddp", optimizer="muon"))
    assert muon.optimizer == 8 * (sizes.total - sizes.hidden) + 4 * sizes.hidden


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

    monkeypatch.setattr("mingpt.trainer.parallel.parallelize", placed)
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


def test_settings_that_differ_only_in_what_memory_ignores_share_one_trace():
    """Depth past the two traced blocks, a dropout's rate (not whether it is on) and the model folder
    named: one trace (a machine traces each canonical key once); dropout off is another trace."""
    from dataclasses import replace

    from mingpt.planning.step_trace import canonical

    base = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=11, block_size=8)
    alike = [replace(base, n_layer=6), replace(base, attn_pdrop=0.3, embd_pdrop=0.05),
             replace(base, init_from="x")]
    keys = {canonical(TraceKey(config, "cpu", None, False, "none")) for config in (base, *alike)}
    assert len(keys) == 1
    for differs in (replace(base, resid_pdrop=0.0), replace(base, n_layer=1), replace(base, block_size=9)):
        assert canonical(TraceKey(differs, "cpu", None, False, "none")) not in keys


@pytest.mark.slow
@pytest.mark.parametrize("damage", [lambda text: text[: len(text) // 2], lambda text: "", lambda text: "[]"],
                         ids=["cut", "emptied", "another-shape"])
def test_a_damaged_cached_trace_is_traced_again_and_rewritten(monkeypatch, tmp_path, damage):
    """A step trace cut short, emptied or garbled in the cache folder (a killed process, a full disk)
    never stops a start: it is traced again, to the same figures, and rewritten whole."""
    from mingpt.planning import step_trace

    monkeypatch.setenv("MINGPT_CACHE_DIR", str(tmp_path))
    key = TraceKey(SMALL, "cpu", None, False, "none")
    step_trace._trace_step.cache_clear()
    first = trace_step(key)
    [cached] = (tmp_path / step_trace.TRACES_FOLDER).glob("*.json")
    whole = cached.read_text()
    cached.write_text(damage(whole))
    step_trace._trace_step.cache_clear()  # a new process: the trace comes from the cache folder
    try:
        assert trace_step(key) == first
    finally:
        step_trace._trace_step.cache_clear()
    assert cached.read_text() == whole
