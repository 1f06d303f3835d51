"""placement.py: a rank's training state checked against its plan, then placed: the model wrapped for its
method, the optimizer built for the wrapped parameters, the scaler and the autocast its precision needs.
The refusal as a user meets it, through main.py: test_memory.py; the wrappers themselves: test_parallel.py."""
import pytest
import torch
from helpers import tiny_gpt

from mingpt.common.errors import ConfigError
from mingpt.distributed.fault_tolerance import FaultToleranceConfig, Replicas
from mingpt.distributed.parallel import ParallelKeys
from mingpt.distributed.precision import resolve_precision
from mingpt.distributed.process_group import DistEnv
from mingpt.model import GPT, GPTConfig
from mingpt.optimizer import MuonWithAdamW, OptimizerConfig
from mingpt.planning import memory
from mingpt.planning.memory import Placement
from mingpt.planning.placement import place

CPU = torch.device("cpu")
ALONE = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU, backend="gloo")


def placed(model, optimizer="adamw", use_amp=False):
    precision = resolve_precision(use_amp, "float16", CPU)
    placement = Placement("ddp", compute_dtype=precision.amp_dtype, optimizer=optimizer)
    return place(model, placement, precision, ParallelKeys(), 4, OptimizerConfig(name=optimizer), ALONE,
                 Replicas(FaultToleranceConfig(), ALONE))


def test_a_rank_alone_trains_the_model_itself_with_its_planned_memory():
    model = tiny_gpt()
    result = placed(model)
    assert result.model is model  # a world of one: DDP would only add bucket copies
    optimized = {id(param) for group in result.optimizer.param_groups for param in group["params"]}
    assert optimized == {id(param) for param in model.parameters()}
    assert not result.scaler.is_enabled() and result.parallelism.method == "ddp"
    parameter_bytes = sum(param.numel() * param.element_size() for param in model.parameters())
    assert result.memory.fits and result.memory.estimate.peak > 2 * parameter_bytes  # weights, grads, moments


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    result = placed(tiny_gpt(), optimizer="muon")
    assert isinstance(result.optimizer, MuonWithAdamW)
    hidden = [param for param in result.optimizer.muon.param_groups[0]["params"]]
    assert hidden and all(param.dim() == 2 for param in hidden)


def test_mixed_precision_on_a_cpu_computes_the_forward_pass_in_bf16():
    result = placed(tiny_gpt(), use_amp=True)
    with result.autocast():
        logits, _ = result.model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.dtype == torch.bfloat16


def test_a_model_that_cannot_fit_is_refused_before_anything_is_allocated(monkeypatch):
    monkeypatch.setattr(memory, "host_memory_available", lambda: 2**20)  # a machine of 1 MiB
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=11, block_size=16))
    with pytest.raises(ConfigError, match="ddp needs about"):
        placed(model)
    assert {param.device.type for param in model.parameters()} == {"meta"}
