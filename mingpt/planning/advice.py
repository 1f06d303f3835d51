"""What plan.py prints: for each method that applies, with and without activation checkpointing
(and CPU offload where a sharded method does not fit on a GPU without it), one row of memory per
device (memory.py), communication and step time (step_time.py), then the recommendation and why.

The recommendation is the fastest setting that fits, with the fewest micro-batches per step that
bring scaling efficiency to the target; within a few percent of the fastest, the one that changes
the training recipe least, then the simplest.
"""
from dataclasses import dataclass, replace
from typing import Optional

from mingpt.distributed.activation_checkpointing import CHECKPOINTING_MODES
from mingpt.distributed.precision import dtype_name
from mingpt.model import GPTConfig, meta_model
from mingpt.planning.memory import (
    MemoryEstimate,
    Placement,
    estimate_memory,
    fits_in,
    gb,
    largest_batch,
    model_sizes,
)
from mingpt.planning.step_time import (
    Cluster,
    StepTime,
    StepWork,
    accumulation_for,
    muon_step,
    recompute_flops_per_token,
    step_time,
)


@dataclass(frozen=True)
class Row:
    """One setting of the run on the cluster: its memory and its step."""

    method: str
    checkpointing: str
    cpu_offload: bool
    memory: MemoryEstimate
    fits: bool
    timing: StepTime
    tokens_per_s: float


@dataclass(frozen=True)
class Setting:
    """The run as main.py would start it (its placement: start_up.placement_of, as the start-up checks it),
    and the cluster it would run on."""

    model: GPTConfig
    batch_size: int
    configured: Placement
    configured_checkpointing: str
    cluster: Cluster
    efficiency: float

    @property
    def grad_accum_steps(self) -> int:
        return self.configured.grad_accum_steps

    def placement(self, method: str, cpu_offload: bool, grad_accum_steps: int = 0) -> Placement:
        """The configured placement with another method, offload or accumulation (ddp always
        keeps its whole parameters: reshard_after_forward has no meaning there)."""
        return replace(self.configured, method=method, cpu_offload=cpu_offload,
                       reshard_after_forward=self.configured.reshard_after_forward or method == "ddp",
                       grad_accum_steps=grad_accum_steps or self.grad_accum_steps)

    def work(self, checkpointing: str, grad_accum_steps: int = 0) -> StepWork:
        flops = meta_model(self.model).flops_per_token()
        head = self.model.padded_vocab_size * self.model.n_embd
        recompute = recompute_flops_per_token(flops, head) if checkpointing == "full" else 0
        dtype = self.configured.compute_dtype
        return StepWork(model_sizes(self.model), flops, recompute, self.batch_size * self.model.block_size,
                        dtype.itemsize if dtype else 4, grad_accum_steps or self.grad_accum_steps,
                        self.configured.optimizer)

    def tokens_per_step(self, grad_accum_steps: int = 0) -> int:
        steps = grad_accum_steps or self.grad_accum_steps
        return self.cluster.world_size * self.batch_size * steps * self.model.block_size


def methods_for(cluster: Cluster) -> list[str]:
    return ["ddp"] + (["fsdp"] if cluster.world_size > 1 else []) + (["hsdp"] if cluster.nodes > 1 else [])


def plan_rows(setting: Setting) -> list[Row]:
    """Every method that applies, without and with activation checkpointing; CPU offload too for
    a sharded method on GPUs when it does not fit without."""
    rows = []
    for method in methods_for(setting.cluster):
        for checkpointing in CHECKPOINTING_MODES:
            row = plan_row(setting, method, checkpointing, cpu_offload=False)
            rows.append(row)
            if method != "ddp" and setting.cluster.device_type == "cuda" and not row.fits:
                rows.append(plan_row(setting, method, checkpointing, cpu_offload=True))
    return rows


def plan_row(setting: Setting, method: str, checkpointing: str, cpu_offload: bool,
             grad_accum_steps: int = 0) -> Row:
    placement = setting.placement(method, cpu_offload, grad_accum_steps)
    memory = estimate_memory(setting.model, setting.batch_size, checkpointing, placement)
    timing = step_time(method, setting.work(checkpointing, grad_accum_steps), setting.cluster,
                       placement.reshard_after_forward, cpu_offload)
    return Row(method, checkpointing, cpu_offload, memory, memory.peak <= setting.cluster.memory, timing,
               setting.tokens_per_step(grad_accum_steps) / timing.seconds)


def table(rows: list[Row], setting: Setting) -> str:
    """Two tables of the rows, each under 110 characters: memory per device, then communication and
    time."""
    def key(row: Row) -> str:
        return f"{row.method:<6} {row.checkpointing:<4} {'yes' if row.cpu_offload else 'no':<7}"

    def configured(row: Row) -> str:
        return " <- configured" if (row.method, row.checkpointing, row.cpu_offload) == (
            setting.configured.method, setting.configured_checkpointing, False) else ""

    muon = setting.configured.optimizer == "muon"  # a column for its Newton-Schulz
    memory = (f"{'method':<6} {'ckpt':<4} {'offload':<7} | {'params':>7} {'grads':>7} "
              f"{'Muon' if muon else 'AdamW':>7} {'activ':>7} {'buffers':>7} | {'peak':>7} {'fits':<4}")
    ns_header = f"{'NS s':>7} " if muon else ""
    timing = (f"{'method':<6} {'ckpt':<4} {'offload':<7} | {'intra':>7} {'inter':>7} {'comm s':>7} | "
              f"{'compute':>7} {'exposed':>7} {ns_header}{'step s':>7} | {'tokens/s':>10} {'eff':>5}")
    lines = [memory, "-" * len(memory)]
    for row in rows:
        m = row.memory
        lines.append(f"{key(row)} | {_gb(m.parameters)} {_gb(m.gradients)} {_gb(m.optimizer)} "
                     f"{_gb(m.activations)} {_gb(m.buffers)} | {_gb(m.peak)} {'yes' if row.fits else 'NO':<4}"
                     f"{configured(row)}")
    lines += ["", timing, "-" * len(timing)]
    for row in rows:
        t = row.timing
        newton_schulz = f"{t.newton_schulz:>7.3f} " if muon else ""
        lines.append(f"{key(row)} | {_gb(t.traffic.intra_bytes)} {_gb(t.traffic.inter_bytes)} "
                     f"{t.traffic.seconds:>7.3f} | {t.compute:>7.3f} {t.exposed:>7.3f} {newton_schulz}"
                     f"{t.seconds:>7.3f} | "
                     f"{row.tokens_per_s:>10,.0f} {100 * t.efficiency:>4.0f}%{configured(row)}")
    return "\n".join(line.rstrip() for line in lines)


def _gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:>7.2f}"


@dataclass(frozen=True)
class Choice:
    """A setting that fits, at the gradient accumulation recommended for it."""

    row: Row
    """At the run's own grad_accum_steps."""
    steps: int
    reached: Row
    """At `steps` micro-batches per optimizer step."""

    def reaches(self, setting: Setting) -> bool:
        return self.reached.timing.efficiency >= setting.efficiency


def recommend(rows: list[Row], setting: Setting) -> list[str]:
    """Of the settings that fit and reach the target efficiency (each with the fewest micro-batches
    that do), the fastest; within a few percent of it, the one that changes the training recipe
    least (fewest micro-batches), then the simplest. Then why."""
    fitting = [row for row in rows if row.fits]
    if not fitting:
        return _nothing_fits(rows, setting)
    choices = [_accumulation(row, setting) for row in fitting]
    pool = [choice for choice in choices if choice.reaches(setting)] or choices
    fastest = max(choice.reached.tokens_per_s for choice in pool)
    close = [choice for choice in pool if choice.reached.tokens_per_s >= (1 - CLOSE_ENOUGH) * fastest]
    best = min(close, key=lambda choice: (choice.steps, _complexity(choice.row)))
    return [_headline(best, setting), *_reasons(best, choices, rows, setting)]


CLOSE_ENOUGH = 0.03
"""Settings this close to the fastest are as good: the simplest of them is recommended."""


def _complexity(row: Row) -> tuple:
    """ddp, then fsdp, then hsdp (a 2-D mesh); no checkpointing; no offload."""
    return (row.cpu_offload, row.checkpointing != "none", ("ddp", "fsdp", "hsdp").index(row.method))


def _accumulation(row: Row, setting: Setting) -> Choice:
    """The fewest micro-batches per step that reach the target efficiency and still fit (the row's
    own when none does)."""
    placement = setting.placement(row.method, row.cpu_offload)
    options = dict(reshard_after_forward=placement.reshard_after_forward, cpu_offload=row.cpu_offload)
    steps = accumulation_for(setting.efficiency, row.method, setting.work(row.checkpointing), setting.cluster,
                             **options)
    if steps in (0, setting.grad_accum_steps):
        return Choice(row, setting.grad_accum_steps, row)
    candidate = plan_row(setting, row.method, row.checkpointing, row.cpu_offload, steps)
    return Choice(row, steps, candidate) if candidate.fits else Choice(row, setting.grad_accum_steps, row)


def _in_words(row: Row, steps: int) -> str:
    words = [f"distributed_method={row.method}", f"activation_checkpointing={row.checkpointing}"]
    if row.cpu_offload:
        words.append("cpu_offload=True")
    words.append(f"grad_accum_steps={steps}")
    return " ".join(f"trainer_config.{word}" for word in words)


def _headline(best: Choice, setting: Setting) -> str:
    reached, memory = best.reached, setting.cluster.memory
    return (f"Recommended: {_in_words(best.row, best.steps)}: {gb(reached.memory.peak)} of {gb(memory)} "
            f"per device, {reached.tokens_per_s:,.0f} tokens/s, "
            f"scaling efficiency {100 * reached.timing.efficiency:.0f}% "
            f"(target {100 * setting.efficiency:.0f}%), {setting.tokens_per_step(best.steps):,} tokens per "
            f"step.")


def _reasons(best: Choice, choices: list[Choice], rows: list[Row], setting: Setting) -> list[str]:
    reasons = []
    for method in methods_for(setting.cluster):
        if method != best.row.method:
            same = next(row for row in rows
                        if row.method == method and row.checkpointing == best.row.checkpointing)
            choice = next((choice for choice in choices if choice.row == same), None)
            reasons.append(_why_not(same, choice, best, setting))
    kind = (best.row.method, best.row.cpu_offload)
    other = next((row for row in rows if (row.method, row.cpu_offload) == kind
                  and row.checkpointing != best.row.checkpointing), None)
    if other is not None:
        other_choice = next((choice for choice in choices if choice.row == other), None)
        reasons.append(_checkpointing_reason(best.row, other, other_choice))
    reasons.append(_communication_reason(best.row, setting))
    reasons.append(_accumulation_reason(best, setting))
    return [f"- {reason}" for reason in reasons]


def _why_not(row: Row, choice: Optional[Choice], best: Choice, setting: Setting) -> str:
    if choice is None:
        what = {"ddp": "keeps a whole copy of the parameters, gradients, AdamW state and gradient buckets "
                       "on every device",
                "fsdp": "shards the state over every device, but not the activations",
                "hsdp": "shards the state over a node's devices only"}[row.method]
        return (f"{row.method} does not fit: it {what}: {gb(row.memory.peak)} per device "
                f"(activations {gb(row.memory.activations)}) > {gb(setting.cluster.memory)}.")
    reached = choice.reached
    speed = (f"{reached.tokens_per_s:,.0f} tokens/s and {100 * reached.timing.efficiency:.0f}% efficiency "
             f"with grad_accum_steps={choice.steps}")
    if best.reaches(setting) and not choice.reaches(setting):
        verdict = f"does not reach {100 * setting.efficiency:.0f}%"
    elif reached.tokens_per_s < (1 - CLOSE_ENOUGH) * best.reached.tokens_per_s:
        verdict = "is slower"
    elif choice.steps > best.steps:
        verdict = "needs more micro-batches per step for as much"
    else:
        return (f"{row.method} fits ({gb(row.memory.peak)}) and is about as fast ({speed}); "
                f"{best.row.method} is simpler.")
    return f"{row.method} fits ({gb(row.memory.peak)}) but {verdict}: {speed}."


def _checkpointing_reason(best: Row, other: Row, other_choice: Optional[Choice]) -> str:
    if best.checkpointing == "full" and not other.fits:
        return (f"activation checkpointing is needed: without it {best.method} holds "
                f"{gb(other.memory.activations)} of activations, {gb(other.memory.peak)} in all; with it "
                f"{gb(best.memory.activations)}, for a third more block compute.")
    if best.checkpointing == "full":
        reached = other_choice.reached
        return (f"activation checkpointing is not needed to fit ({gb(other.memory.peak)} without it), but "
                f"the communication hides behind its recomputation: without it {reached.tokens_per_s:,.0f} "
                f"tokens/s and {100 * reached.timing.efficiency:.0f}% efficiency with "
                f"grad_accum_steps={other_choice.steps}.")
    return (f"activation checkpointing is not needed: it would cut activations from "
            f"{gb(best.memory.activations)} to {gb(other.memory.activations)} at the cost of a third more "
            f"block compute ({other.tokens_per_s:,.0f} tokens/s).")


def _communication_reason(best: Row, setting: Setting) -> str:
    traffic, timing = best.timing.traffic, best.timing
    across = f" and {gb(traffic.inter_bytes)} across nodes" if setting.cluster.nodes > 1 else ""
    muon = ""
    if setting.configured.optimizer == "muon":
        exchange = muon_step(best.method, model_sizes(setting.model), setting.cluster).exchange
        muon = (f" Muon adds {timing.newton_schulz * 1e3:,.1f} ms of Newton-Schulz on the busiest device"
                + (f" and {exchange.seconds * 1e3:,.1f} ms of exchange, all exposed: both run in the "
                   f"optimizer's step" if exchange.seconds else "") + ".")
    return (f"each step moves {gb(traffic.intra_bytes)} per device within its node{across} "
            f"({traffic.seconds * 1e3:,.0f} ms), of which {timing.exposed * 1e3:,.0f} ms is not hidden "
            f"behind {timing.compute * 1e3:,.0f} ms of compute.{muon}")


def _accumulation_reason(best: Choice, setting: Setting) -> str:
    target, row, reached = f"{100 * setting.efficiency:.0f}%", best.row, best.reached
    if best.reaches(setting) and best.steps == setting.grad_accum_steps:
        return f"scaling efficiency {100 * row.timing.efficiency:.0f}% already reaches {target}."
    if best.reaches(setting):
        return (f"{best.steps} micro-batches per step (one synchronisation) bring scaling efficiency from "
                f"{100 * row.timing.efficiency:.0f}% to {100 * reached.timing.efficiency:.0f}%, at or above "
                f"{target}.")
    gathers = " (sharding gathers the parameters for every micro-batch)" if row.method != "ddp" else ""
    return (f"no gradient accumulation up to 64 micro-batches that fits reaches {target}{gathers}: "
            f"faster links, a larger batch or fewer devices would.")


def _nothing_fits(rows: list[Row], setting: Setting) -> list[str]:
    smallest = min(rows, key=lambda row: row.memory.peak)
    placement = setting.placement(smallest.method, smallest.cpu_offload)
    largest = largest_batch(setting.model, smallest.checkpointing, placement, fits_in(setting.cluster.memory),
                            below=setting.batch_size)
    fix = (f"trainer_config.batch_size={largest} fits with {_in_words(smallest, setting.grad_accum_steps)}"
           if largest else "no batch size fits: use more devices, devices with more memory, or a smaller "
           "model")
    return [f"Nothing fits in {gb(setting.cluster.memory)} per device at batch_size={setting.batch_size}: "
            f"the smallest is {smallest.method} with activation_checkpointing={smallest.checkpointing}"
            f"{' and cpu_offload' if smallest.cpu_offload else ''}, {gb(smallest.memory.peak)}. {fix}."]


def describe(setting: Setting) -> str:
    cluster, model = setting.cluster, setting.model
    precision = dtype_name(setting.configured.compute_dtype)
    params = model_sizes(model).total
    return (f"Plan: GPT {params / 1e6:.1f}M parameters ({model.n_layer} layers, {model.n_embd} wide, block "
            f"{model.block_size}, vocabulary {model.vocab_size}), {precision}, "
            f"batch_size={setting.batch_size} x "
            f"{setting.grad_accum_steps} per device; {cluster.nodes} node(s) x {cluster.ranks_per_node} "
            f"{'CPU rank' if cluster.device_type == 'cpu' else 'GPU'}(s), {gb(cluster.memory)} usable each, "
            f"{cluster.peak_flops / 1e12:.1f} TFLOP/s peak at {100 * cluster.utilization:.0f}% utilisation, "
            f"{cluster.intra_bandwidth * 8 / 1e9:,.0f} Gb/s within and "
            f"{cluster.inter_bandwidth * 8 / 1e9:,.0f} "
            f"Gb/s across nodes. Memory in GB per device; intra/inter: GB moved per step and device.")
