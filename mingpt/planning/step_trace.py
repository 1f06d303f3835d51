"""What one training step of the project's model holds in memory, traced without allocating it.

Activations are not taken from a formula: the real GPT (model.py) runs the Trainer's forward pass
(in its precision), the loss and the backward pass on tensors that have shapes but no memory, while a
dispatch mode records every storage the step allocates and when it is freed. So the trace holds what
the model really keeps on that device: on a CPU its own dropout masks (one element of the
activation's dtype each) and its attention path (scores, weights and the dropout mask, B x nh x T x T
each); on a GPU F.dropout's one-byte masks and SDPA's flash or memory-efficient kernel (no T x T
maps); the batch, the logits and the fp32 loss; with activation checkpointing each block's input,
and in the backward pass one block recomputed at a time.

- CPU: torch's FakeTensorMode on the CPU device, so that the model takes its CPU paths.
- GPU: the meta device, on which the model takes its GPU paths (F.dropout, SDPA); meta tensors have
  neither autocast nor SDPA's kernel choice, so the trace adds both (GpuEmulation). A CPU-only torch
  cannot run autograd on fake CUDA tensors.

Two blocks are traced, at batches of 2 and 3 samples (a batch of 1 takes other paths in places): a
further block repeats the second block's pattern, shifted by what one block keeps for the backward
pass, and every activation is linear in the batch, so one trace answers any depth and any batch
size (the tests hold both against whole traces). Parameters and the optimizer's state exist before
the trace starts and are not in it; gradients are, and are told apart from activations once the
step has made them.
"""
import contextlib
import functools
import hashlib
import json
import os
import sys
import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import astuple, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import mingpt.model as model_module
from mingpt.common import files
from mingpt.common.errors import MinGPTError
from mingpt.distributed import activation_checkpointing
from mingpt.distributed.activation_checkpointing import checkpoint_blocks
from mingpt.model import GPT, GPTConfig

TRACED_LAYERS = 2
"""Blocks traced: the first block's pattern differs (its input is the embedding's), the second's repeats."""
TRACED_BATCH = 2
"""Samples of the first traced batch; the second has one more."""


@dataclass(frozen=True)
class TraceKey:
    """Everything the memory of a step depends on besides the batch size."""

    model: GPTConfig
    """With vocab_size and block_size set (the data's)."""
    device_type: str
    """cpu or cuda: the model's code paths differ (dropout masks, attention)."""
    compute_dtype: Optional[torch.dtype]
    """The low precision the step computes in; None: fp32."""
    casts_parameters: bool
    """True: the parameters themselves are in compute_dtype (FSDP's mixed-precision policy, with no
    autocast); False: fp32 parameters under autocast (DDP), which caches low-precision copies."""
    checkpointing: str
    """none or full (activation_checkpointing.py)."""

    def __hash__(self) -> int:  # GPTConfig, a mutable dataclass, is not hashable itself
        return hash(repr(self))


@dataclass(frozen=True)
class Moment:
    """Bytes live right after one operation of the traced step."""

    activations: int
    """Everything the step made that is neither a gradient nor a cast of a parameter, at
    TRACED_BATCH samples."""
    per_sample: int
    """How much activations grows with each further sample of the batch."""
    casts: int = 0
    """Autocast's low-precision copies of parameters (held until the backward pass uses them)."""
    block_gradients: int = 0
    """Gradients made so far of the block whose backward pass runs."""
    other_gradients: int = 0
    """Gradients made so far of the parameters outside the blocks (embeddings, final LayerNorm, head)."""

    def at(self, batch_size: int) -> int:
        return self.activations + (batch_size - TRACED_BATCH) * self.per_sample

    def shifted(self, by: "Moment", times: int) -> "Moment":
        """This moment with `times` more blocks' worth of what a block keeps (activations and casts)."""
        return replace(self, activations=self.activations + times * by.activations,
                       per_sample=self.per_sample + times * by.per_sample,
                       casts=self.casts + times * by.casts)


@dataclass(frozen=True)
class Point:
    """A moment of the whole model's step: where it is, and what is live there."""

    phase: str
    """forward or backward."""
    block: Optional[int]
    """The block computing (None: the embeddings, final LayerNorm, head or loss)."""
    blocks_done: int
    """Blocks whose backward pass is over (their gradients are complete)."""
    moment: Moment


@dataclass(frozen=True)
class StepTrace:
    """The traced step, by segment: (phase, where) with where "pre" (embeddings), a block index of
    the traced model, or "post" (final LayerNorm, head, loss)."""

    traced_layers: int
    segments: dict[tuple[str, object], tuple[Moment, ...]]
    block_gradient_bytes: int
    """Gradients of one whole block, in the traced parameters' dtype."""

    @property
    def kept_per_block(self) -> Moment:
        """What one block keeps from its forward to its backward pass: the difference between the
        starts of the two traced blocks' forward passes."""
        first, second = self.segments[("forward", 0)][0], self.segments[("forward", 1)][0]
        return Moment(second.activations - first.activations, second.per_sample - first.per_sample,
                      second.casts - first.casts)

    def saved_activations(self, n_layer: int) -> Moment:
        """Activations held at the end of the forward pass (what the backward pass will use)."""
        return self.points(n_layer)[_last_forward_index(self.points(n_layer))].moment

    def points(self, n_layer: int) -> list[Point]:
        """The moments of an n_layer model's step that can be its peak. Activations grow block by
        block in the forward pass, so its last block is the worst; in the backward pass held
        activations shrink and gradients grow linearly from block to block, so the first and last
        blocks of the repeating pattern bound the others."""
        if self.traced_layers != min(n_layer, TRACED_LAYERS):
            raise ValueError(f"a trace of {self.traced_layers} blocks cannot stand for {n_layer}")
        if n_layer < TRACED_LAYERS:
            return [*self._points("forward", "pre", None, 0), *self._points("forward", 0, 0, 0),
                    *self._points("forward", "post", None, 0), *self._points("backward", "post", None, 0),
                    *self._points("backward", 0, 0, 0), *self._points("backward", "pre", None, n_layer)]
        step, last = self.kept_per_block, n_layer - 1
        extra = n_layer - TRACED_LAYERS  # blocks beyond the traced two
        backward_blocks = sorted({0, last - 1})
        return [
            *self._points("forward", "pre", None, 0),
            *self._points("forward", 0, 0, 0),
            *self._points("forward", 1, last, 0, step, extra),
            *self._points("forward", "post", None, 0, step, extra),
            *self._points("backward", "post", None, 0, step, extra),
            *self._points("backward", 1, last, 0, step, extra),
            *(point for block in backward_blocks
              for point in self._points("backward", 0, block, last - block, step, block)),
            *self._points("backward", "pre", None, n_layer),
        ]

    def _points(self, phase: str, where: object, block: Optional[int], done: int,
                step: Optional[Moment] = None, times: int = 0) -> list[Point]:
        return [Point(phase, block, done, moment.shifted(step, times) if step else moment)
                for moment in self.segments[(phase, where)]]


def _last_forward_index(points: list[Point]) -> int:
    return max(index for index, point in enumerate(points) if point.phase == "forward")


def trace_step(key: TraceKey) -> StepTrace:
    """The step's trace, for the key's canonical form (canonical): settings that differ only in
    what the step's memory does not depend on share one."""
    return _trace_step(canonical(key))


def canonical(key: TraceKey) -> TraceKey:
    """The key with only what the trace depends on: the traced depth (TRACED_LAYERS blocks at most,
    whatever the model's), whether each dropout is on (a mask is kept, whatever its rate), and the
    shape a preset or a model folder has already filled in."""
    def on(rate: float) -> float:
        return 0.1 if rate > 0 else 0.0

    model = key.model
    return replace(key, model=replace(with_layers(model, min(model.n_layer, TRACED_LAYERS)), init_from=None,
                                      embd_pdrop=on(model.embd_pdrop), resid_pdrop=on(model.resid_pdrop),
                                      attn_pdrop=on(model.attn_pdrop)))


@lru_cache(maxsize=32)
def _trace_step(key: TraceKey) -> StepTrace:
    """Kept in memory and in the cache folder (storage.files.cache_folder), so that a machine traces
    each setting once (a trace takes a second or two: every operation goes through FakeTensorMode
    and the recorder), under a lock: ranks of one machine starting together trace it once, the
    others read it. The file's name is a digest of the setting, the torch version and the source of
    the code traced, so a change to any of them traces again. Without a usable cache folder it
    traces every time, nothing worse."""
    path = _cached_at(key)
    if path is None:
        return _trace(key)
    try:
        with files.locked(path):
            return _read_or_trace(key, path)
    except OSError:  # the lock's file cannot be made there
        return _read_or_trace(key, path)


def _read_or_trace(key: TraceKey, path: Path) -> StepTrace:
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
        return _from_json(json.loads(path.read_text()))
    trace = _trace(key)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(_to_json(trace)))
        temporary.replace(path)
    return trace


def _cached_at(key: TraceKey) -> Optional[Path]:
    try:
        folder = files.cache_folder(None) / TRACES_FOLDER
        folder.mkdir(exist_ok=True)
    except (MinGPTError, OSError):  # the cache folder cannot be made: no cache
        return None
    return folder / f"{_digest(key)}.json"


TRACES_FOLDER = "step_traces"


def _digest(key: TraceKey) -> str:
    sources = [Path(module.__file__).read_bytes() for module in (model_module, activation_checkpointing,
                                                                 sys.modules[__name__])]
    text = repr(key).encode() + torch.__version__.encode() + b"".join(sources)
    return hashlib.sha256(text).hexdigest()[:32]


def _to_json(trace: StepTrace) -> dict:
    return {"traced_layers": trace.traced_layers, "block_gradient_bytes": trace.block_gradient_bytes,
            "segments": [[phase, where, [astuple(moment) for moment in moments]]
                         for (phase, where), moments in trace.segments.items()]}


def _from_json(saved: dict) -> StepTrace:
    segments = {(phase, where): tuple(Moment(*fields) for fields in moments)
                for phase, where, moments in saved["segments"]}
    return StepTrace(saved["traced_layers"], segments, saved["block_gradient_bytes"])


def _trace(key: TraceKey) -> StepTrace:
    layers = min(key.model.n_layer, TRACED_LAYERS)
    one, two = (_trace_once(key, layers, batch) for batch in (TRACED_BATCH, TRACED_BATCH + 1))
    if [len(moments) for moments in one.values()] != [len(moments) for moments in two.values()]:
        raise RuntimeError("the step ran different operations at two batch sizes")
    segments = {where: tuple(_linear(a, b) for a, b in zip(one[where], two[where])) for where in one}
    return StepTrace(layers, segments, block_parameters(key.model) * parameter_dtype(key).itemsize)


def block_parameters(config: GPTConfig) -> int:
    """Parameters of one transformer block."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(with_layers(config, 1)).blocks[0].parameters())


def with_layers(config: GPTConfig, n_layer: int) -> GPTConfig:
    """The config with another depth (a preset's name dropped: its sizes are already filled in)."""
    return replace(config, model_type=None, n_layer=n_layer)


def parameter_dtype(key: TraceKey) -> torch.dtype:
    """The dtype the traced step's parameters (and so its gradients) are in."""
    return key.compute_dtype if key.casts_parameters and key.compute_dtype else torch.float32


def _linear(one: Moment, two: Moment) -> Moment:
    return replace(one, per_sample=two.activations - one.activations)


def _trace_once(key: TraceKey, layers: int, batch_size: int) -> dict[tuple[str, object], list[Moment]]:
    """Run one step of a `layers`-block model with batch_size samples and record it by segment."""
    with ExitStack() as stack:
        device = _enter_device(stack, key.device_type)
        model = _model(key, layers, device)
        recorder = stack.enter_context(_Recorder(model))
        batch = torch.randint(key.model.vocab_size, (batch_size, key.model.block_size + 1), device=device)
        inputs, targets = batch[:, :-1], batch[:, 1:]  # as char_dataset.inputs_and_targets
        with _forward_pass(key):
            _, loss = model(inputs, targets)
        recorder.enter(("backward", "post"))
        loss.backward()
        del batch, inputs, targets, loss
        return recorder.segments()


def _enter_device(stack: ExitStack, device_type: str) -> torch.device:
    """Fake CPU tensors, or meta tensors for a GPU (emulated in the forward pass: _forward_pass)."""
    if device_type == "cpu":
        from torch._subclasses.fake_tensor import FakeTensorMode
        stack.enter_context(FakeTensorMode())
        return torch.device("cpu")
    return torch.device("meta")


def _model(key: TraceKey, layers: int, device: torch.device) -> GPT:
    """The GPT with `layers` blocks on device (fake or meta), in the step's parameter dtype."""
    with torch.device("meta"):
        model = GPT(with_layers(key.model, layers))
    dtype = parameter_dtype(key)  # FSDP's policy casts the parameters themselves
    for module in model.modules():  # fake tensors of the device's type, made under the fake mode
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=dtype, device=device)))
    checkpoint_blocks(model, key.checkpointing)
    if key.device_type != "cpu" and key.checkpointing != "none":
        _emulate_in_recomputation(model, key)
    return model.train()


def _emulate_in_recomputation(model: GPT, key: TraceKey) -> None:
    """The GPU emulation inside each checkpointed block's recomputation too: the backward pass
    runs without the modes the forward pass ran under (torch's checkpoint restores a real autocast
    itself, and this one through the checkpoint's context_fn)."""
    def contexts():
        return contextlib.nullcontext(), _forward_pass(key)
    for block in model.blocks:
        checkpointed = block.forward  # functools.partial(checkpoint, forward, ...): checkpoint_blocks'
        block.forward = functools.partial(checkpointed.func, *checkpointed.args, **checkpointed.keywords,
                                          context_fn=contexts)


@contextmanager
def _forward_pass(key: TraceKey) -> Iterator[None]:
    """What the forward pass runs under: the Trainer's autocast (DDP with AMP; FSDP casts the
    parameters instead), and on a GPU the emulation of its kernels."""
    with ExitStack() as forward:
        if key.device_type != "cpu":
            forward.enter_context(GpuEmulation())
        if key.compute_dtype is not None and not key.casts_parameters:
            forward.enter_context(torch.autocast("cpu", dtype=key.compute_dtype) if key.device_type == "cpu"
                                  else GpuAutocast(key.compute_dtype))
        yield


class _Recorder(TorchDispatchMode):
    """Every storage the step allocates, with when it is freed, and where in the step each
    operation ran (set by hooks on the blocks and the final LayerNorm)."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model
        self.where: tuple[str, object] = ("forward", "pre")
        self.events: list[tuple] = []  # ("new", serial, bytes, is_cast) | ("free", serial) | ("op", where)
        self._serials: dict[int, Optional[int]] = {  # id(storage) -> serial of the live allocation
            id(param.untyped_storage()): None for param in model.parameters()}  # not the step's: not counted
        self._refs: dict[int, weakref.ref] = {}
        self._hooks = [block.register_forward_pre_hook(self._entering(index))
                       for index, block in enumerate(model.blocks)]
        self._hooks += [block.register_forward_hook(self._leaving(index))
                        for index, block in enumerate(model.blocks)]
        self._hooks.append(model.ln_f.register_forward_pre_hook(
            lambda module, args: self.enter(("forward", "post"))))

    def enter(self, where: tuple[str, object]) -> None:
        self.where = where

    def _entering(self, index: int):
        def hook(module, args):
            self.enter(("forward", index))
            if index == 0 and args[0].requires_grad:  # the end of block 0's backward pass
                args[0].register_hook(lambda grad: self.enter(("backward", "pre")))
        return hook

    def _leaving(self, index: int):
        def hook(module, args, output):  # the gradient reaching the output starts the backward pass
            output.register_hook(lambda grad: self.enter(("backward", index)))
        return hook

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        is_cast = func is torch.ops.aten._to_copy.default and isinstance(args[0], nn.Parameter)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._allocated(tensor.untyped_storage(), is_cast)
        self.events.append(("op", self.where))
        return out

    def _allocated(self, storage: torch.UntypedStorage, is_cast: bool) -> None:
        key = id(storage)
        if key in self._serials:
            return
        serial = len(self.events)
        self._serials[key] = serial
        self._refs[key] = weakref.ref(storage, lambda _, key=key, serial=serial: self._freed(key, serial))
        self.events.append(("new", serial, storage.nbytes(), is_cast))

    def _freed(self, key: int, serial: int) -> None:
        if self._serials.get(key) == serial:
            del self._serials[key], self._refs[key]
        self.events.append(("free", serial))

    def segments(self) -> dict[tuple[str, object], list[Moment]]:
        """Replay the events with the gradients (known only now) told apart."""
        return _replay(self.events, self._gradient_serials())

    def _gradient_serials(self) -> dict[int, object]:
        """serial -> the block index (or "other") of the storages that became parameters' gradients."""
        kinds: dict[int, object] = {}
        for index, block in enumerate(self.model.blocks):
            kinds.update({self._serials[id(p.grad.untyped_storage())]: index
                          for p in block.parameters() if p.grad is not None})
        block_params = {id(p) for p in self.model.blocks.parameters()}
        kinds.update({self._serials[id(p.grad.untyped_storage())]: "other" for p in self.model.parameters()
                      if p.grad is not None and id(p) not in block_params})
        return kinds


def _replay(events: list[tuple], gradients: dict[int, object]) -> dict[tuple[str, object], list[Moment]]:
    """The moments after each operation, from the allocation events and what became a gradient."""
    live: dict[int, tuple[object, int]] = {}
    totals: dict[object, int] = {"activations": 0, "casts": 0, "other": 0}
    segments: dict[tuple[str, object], list[Moment]] = {}
    for event in events:
        if event[0] == "new":
            _, serial, nbytes, is_cast = event
            kind = gradients.get(serial, "casts" if is_cast else "activations")
            live[serial] = (kind, nbytes)
            totals[kind] = totals.get(kind, 0) + nbytes
        elif event[0] == "free":
            kind, nbytes = live.pop(event[1])
            totals[kind] -= nbytes
        else:
            phase, where = event[1]
            in_block = totals.get(where, 0) if phase == "backward" and isinstance(where, int) else 0
            segments.setdefault(event[1], []).append(
                Moment(totals["activations"], 0, totals["casts"], in_block, totals["other"]))
    return segments


LOW_PRECISION_OPS = (F.linear, torch.matmul, torch.mm, torch.bmm, torch.baddbmm, torch.addmm,
                     F.scaled_dot_product_attention)
FP32_OPS = (F.layer_norm, F.softmax, F.log_softmax, F.cross_entropy)


class GpuAutocast(TorchFunctionMode):
    """CUDA autocast's policy for the operations the model uses, on meta tensors (which autocast
    skips): matmuls and attention in the low precision, with one cached copy of each parameter per
    forward pass as autocast keeps; layer_norm, softmax and the loss in fp32; the rest in the
    dtype of their inputs."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self._casts: dict[int, torch.Tensor] = {}
        """Each parameter's cast, made once while the mode is on (autocast's cache)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in LOW_PRECISION_OPS:
            args, kwargs = self._cast_all(args, self.dtype), self._cast_all(kwargs, self.dtype)
        elif func in FP32_OPS:
            args, kwargs = self._cast_all(args, torch.float32), self._cast_all(kwargs, torch.float32)
        return func(*args, **kwargs)

    def _cast_all(self, values, dtype: torch.dtype):
        if isinstance(values, dict):
            return {name: self._cast(value, dtype) for name, value in values.items()}
        return tuple(self._cast(value, dtype) for value in values)

    def _cast(self, value, dtype: torch.dtype):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == dtype:
            return value
        if not isinstance(value, nn.Parameter):
            return value.to(dtype)
        if id(value) not in self._casts:
            self._casts[id(value)] = value.to(dtype)
        return self._casts[id(value)]

    def __exit__(self, *exc):
        self._casts.clear()  # as autocast on leaving its region: the backward pass keeps what it saved
        return super().__exit__(*exc)


class GpuEmulation(TorchFunctionMode):
    """What a GPU runs where meta tensors would take CPU-like paths: SDPA's fused kernels (flash
    for fp16 and bf16, memory-efficient for fp32: neither keeps the T x T attention maps) and
    dropout's fused kernel, which keeps a one-byte mask."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _fused_attention(*args, **kwargs)
        if func is F.dropout and kwargs.get("training", args[2] if len(args) > 2 else True):
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            return torch.ops.aten.native_dropout(args[0], p, True)[0]
        return func(*args, **kwargs)


def _fused_attention(q, k, v, dropout_p: float = 0.0, is_causal: bool = False, **_) -> torch.Tensor:
    if q.dtype in (torch.float16, torch.bfloat16):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal)[0]
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention
    return efficient(q, k, v, None, True, dropout_p, is_causal)[0]
