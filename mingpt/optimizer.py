"""The optimizer, as the original's model.py built it (OptimizerConfig and create_optimizer moved
here from there), and its learning-rate schedule: AdamW with GPT-2's betas, decaying Linear weights
only, or Muon for the blocks' weight matrices with AdamW for the rest. Nothing here knows the model
beyond its modules, nor parallelism.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from mingpt.common.errors import check, check_choice, check_not_negative, check_positive

LR_SCHEDULES = ("constant", "cosine")


@dataclass
class OptimizerConfig:
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to Linear weights only."""
    learning_rate: float = 3e-4
    """The peak learning rate (after warmup): AdamW's (with name=muon, for what Muon does not train)."""
    name: str = "adamw"
    """adamw (the original's), or muon: torch.optim.Muon (orthogonalised momentum) for the blocks'
    weight matrices, AdamW for the embeddings, the output layer, biases and LayerNorms, as
    modded-nanogpt and nanochat train them. Under fsdp and hsdp each matrix is orthogonalised whole
    by one of the ranks that shard it, the work spread evenly (distributed/muon.py)."""
    muon_learning_rate: float = 0.02
    """name=muon: Muon's peak learning rate (Keller Jordan's 0.02), scheduled as learning_rate is."""
    muon_momentum: float = 0.95
    """name=muon: Muon's momentum (Nesterov)."""
    lr_schedule: str = "constant"
    """constant (the original's) or cosine: decay to min_lr_ratio x learning_rate by the last step."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 (either schedule)."""
    min_lr_ratio: float = 0.1
    """Where the cosine schedule ends, as a share of learning_rate."""
    cooldown: Optional[float] = None
    """The last share of the run's steps over which every learning rate (Muon's too) falls in a line
    towards 0, on top of lr_schedule: with constant, a warmup-stable-decay schedule. null: 0 for adamw
    (the original's rate to the end), COOLDOWN_MUON (0.5) for muon, whose constant rate leaves it
    above AdamW at the end of a run (docs/performance.md#muon-at-the-end-of-a-run-and-what-it-costs-per-method)."""

    def __post_init__(self) -> None:
        check_positive(self, "optimizer_config", "learning_rate", "muon_learning_rate")
        check_not_negative(self, "optimizer_config", "weight_decay", "warmup_steps")
        check_choice(self, "optimizer_config", "lr_schedule", LR_SCHEDULES)
        check_choice(self, "optimizer_config", "name", OPTIMIZERS)
        check(0 <= self.muon_momentum < 1, "optimizer_config.muon_momentum",
              f"must be in [0, 1), got {self.muon_momentum}")
        check(0 <= self.min_lr_ratio <= 1, "optimizer_config.min_lr_ratio",
              f"must be in [0, 1], got {self.min_lr_ratio}")
        check(self.cooldown is None or 0 <= self.cooldown <= 1, "optimizer_config.cooldown",
              f"must be in [0, 1] (a share of the run's steps), or null (the optimizer's own), got {self.cooldown}")

    @property
    def cooldown_share(self) -> float:
        """The cooldown in force: the key's, or this optimizer's default."""
        if self.cooldown is not None:
            return self.cooldown
        return COOLDOWN_MUON if self.name == "muon" else 0.0

    def describe(self) -> str:
        """The start-up's line: "AdamW, learning rate 0.0003, constant, weight decay 0.1"."""
        schedule = self.lr_schedule + (f" after {self.warmup_steps:,} warmup steps" if self.warmup_steps else "")
        if self.cooldown_share:
            schedule += f", cooling down to 0 over the last {self.cooldown_share:.0%} of the steps"
        adamw = f"AdamW, learning rate {self.learning_rate:g}, {schedule}, weight decay {self.weight_decay:g}"
        if self.name == "muon":
            return (f"Muon for the blocks' matrices (learning rate {self.muon_learning_rate:g}, momentum "
                    f"{self.muon_momentum:g}), {adamw} for the rest (optimizer_config.name)")
        return f"{adamw} (optimizer_config.name)"


def learning_rate_at(step: int, total_steps: int, config: OptimizerConfig) -> float:
    """The learning rate for optimizer step `step` (0-based): a pure function of the step, so a
    resumed run needs no scheduler state."""
    return _scheduled(step, total_steps, config) * _cooling(step, total_steps, config.cooldown_share)


def _scheduled(step: int, total_steps: int, config: OptimizerConfig) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return config.learning_rate
    decay_steps = max(total_steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / decay_steps, 1.0)
    floor = config.min_lr_ratio * config.learning_rate
    return floor + 0.5 * (1 + math.cos(math.pi * progress)) * (config.learning_rate - floor)


def _cooling(step: int, total_steps: int, share: float) -> float:
    """The cooldown's factor: 1 until the last share of the steps, then down in a line that would
    reach 0 one step after the last (the last step still moves, by 1 / its steps of the rate)."""
    steps = share * total_steps
    if steps <= 0:
        return 1.0
    return max(0.0, min(1.0, (total_steps - step) / steps))


def set_learning_rate(optimizer: torch.optim.Optimizer, step: int, total_steps: int,
                      config: OptimizerConfig) -> None:
    """Every group at its peak rate times the schedule's share at step (Muon's groups at theirs)."""
    share = learning_rate_at(step, total_steps, config) / config.learning_rate
    for group in optimizer.param_groups:
        peak = config.muon_learning_rate if group.get(MUON_GROUP) else config.learning_rate
        group["lr"] = peak * share


OPTIMIZERS = ("adamw", "muon")
COOLDOWN_MUON = 0.5
"""Muon's cooldown when optimizer_config.cooldown is null: on nanoGPT's small character recipe (3,000
steps) Muon ends at 1.586 with it against 1.735 at its constant rate, and below AdamW with the same
cooldown (1.660; bench/results/muon_end_small.json)."""
MUON_GROUP = "muon"
"""Marks Muon's parameter groups (a flag in the group, kept in snapshots' param_groups)."""


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay Linear weights only: biases, LayerNorms and both embeddings are left alone."""
    decay, no_decay = [], []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            is_linear_weight = isinstance(module, nn.Linear) and name == "weight"
            (decay if is_linear_weight else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """What Muon trains: the weight matrices inside the blocks (attention's and the MLP's), not the
    embeddings or the output layer, whose rows are tokens."""
    return [module.weight for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and ".blocks." in f".{name}."]


def create_optimizer(model: nn.Module, config: OptimizerConfig,
                     muon: type[torch.optim.Optimizer] = torch.optim.Muon) -> torch.optim.Optimizer:
    """The original's create_optimizer: AdamW with GPT-2's betas, decaying Linear weights only; the
    fused kernel where every parameter lives on CUDA or every one on the CPU (a fused step also takes
    fp16's overflow flag without a host sync). With name=muon, Muon for the hidden matrices besides:
    torch.optim.Muon, or a class of its arguments and state that orthogonalises matrices sharded over
    ranks (distributed/muon.py's, which distributed.muon.optimizer_for picks for a sharded model)."""
    device_types = {p.device.type for p in model.parameters()}
    fused = device_types <= {"cuda"} or device_types <= {"cpu"}
    if config.name == "muon":
        return MuonWithAdamW(model, config, fused, muon)
    return torch.optim.AdamW(parameter_groups(model, config.weight_decay), lr=config.learning_rate,
                             betas=(0.9, 0.95), fused=fused)


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic Newton-Schulz coefficients, torch.optim.Muon's defaults."""


def orthogonalise(update: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = 1e-7) -> torch.Tensor:
    """Muon's orthogonalisation of one whole matrix (about U V^T of its SVD), in bf16, step for step as
    torch.optim.Muon computes it (tests/test_optimizer.py holds the two equal, bit for bit), so that a
    matrix orthogonalised on a rank of a sharded run is the one a single process would have made.
    A bf16 update is worked on in place."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:  # the Gram matrix of the shorter side: (short x short) products
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # the spectral norm at most 1, where the iteration converges
    for _ in range(steps):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    return x.T if tall else x


def muon_scale(shape: torch.Size, adjust_lr_fn: Optional[str]) -> float:
    """What torch.optim.Muon multiplies its learning rate by for a matrix of this (whole) shape, so
    that every matrix's update has about the same RMS: Keller Jordan's sqrt(max(1, rows / columns))
    (None, "original"), or Moonshot's 0.2 sqrt(max(rows, columns)) ("match_rms_adamw")."""
    rows, columns = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / columns))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, columns))
    return 1.0


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon for the hidden matrices and torch.optim.AdamW for the rest, as one optimizer:
    the one the Trainer steps, the GradScaler unscales and the snapshots save (its param_groups and
    state are the two optimizers' own, shared, so state_dict and load_state_dict, and the
    distributed state dicts, see one optimizer of both kinds of groups)."""

    def __init__(self, model: nn.Module, config: OptimizerConfig, fused: bool,
                 muon: type[torch.optim.Optimizer] = torch.optim.Muon):
        hidden = {id(p) for p in hidden_matrices(model)}
        muon_group = {"params": [p for p in model.parameters() if id(p) in hidden], MUON_GROUP: True}
        adamw_groups = [{**group, "params": [p for p in group["params"] if id(p) not in hidden]}
                        for group in parameter_groups(model, config.weight_decay)]
        self.muon = muon([muon_group], lr=config.muon_learning_rate, momentum=config.muon_momentum,
                         weight_decay=config.weight_decay)
        self.adamw = torch.optim.AdamW(adamw_groups, lr=config.learning_rate, betas=(0.9, 0.95), fused=fused)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]  # the same dicts
        self.muon.state = self.adamw.state = self.state  # one state, of parameters of either kind

    @torch.no_grad()
    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        muon = sum(1 for group in self.param_groups if group.get(MUON_GROUP))
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:muon], self.param_groups[muon:]
        self.muon.state = self.adamw.state = self.state
