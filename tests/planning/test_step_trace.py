"""planning/step_trace.py: the model's own training step traced on tensors without memory. Two traced
blocks at two batch sizes stand for any depth and batch (against whole traces); the CPU step keeps
its dropout masks and attention maps, a GPU's one-byte masks and no maps; settings that differ only in
what memory ignores share one trace; a damaged cached trace is traced again. What memory.py composes
from it: test_memory.py."""
from dataclasses import replace

import pytest
import torch

from mingpt.model import GPTConfig
from mingpt.planning.memory import FP32
from mingpt.planning.step_trace import TraceKey, _trace_once, trace_step

SMALL = GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=30, block_size=16)


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
