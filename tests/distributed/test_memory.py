"""The memory estimate against the issue's reference case: gpt2-large on 2 ranks of a 24 GiB machine."""
import pytest
import torch

from mingpt.distributed.memory import MemoryPlan, check_fits, state_bytes_per_rank
from mingpt.model import GPT, GPTConfig
from mingpt.reporting.errors import ConfigError

MACHINE = 24 * 2**30


def gpt2_large_bytes() -> int:
    """fp32 parameter bytes of gpt2-large with tiny-shakespeare's 65 characters (708.7M parameters)."""
    config = GPTConfig(model_type="gpt2-large", n_layer=None, n_head=None, n_embd=None,
                       vocab_size=65, block_size=128)
    with torch.device("meta"):
        return sum(p.numel() * p.element_size() for p in GPT(config).parameters())


def plan_on_one_machine(method: str, ranks: int) -> MemoryPlan:
    per_rank = state_bytes_per_rank(gpt2_large_bytes(), method, world_size=ranks, local_world_size=ranks)
    return MemoryPlan(method, per_rank, sharers=ranks, memory="host memory", available=MACHINE)


def test_estimate_counts_adamw_state_and_ddp_buckets_and_divides_by_the_shards():
    parameter_bytes = 1000
    assert state_bytes_per_rank(parameter_bytes, "ddp", 1, 1) == 4000  # no DDP wrapper on one rank
    assert state_bytes_per_rank(parameter_bytes, "ddp", 4, 2) == 5000
    assert state_bytes_per_rank(parameter_bytes, "fsdp", 4, 2) == 1000


def test_gpt2_large_under_ddp_on_two_ranks_is_refused_naming_what_it_needs():
    plan = plan_on_one_machine("ddp", 2)
    assert plan.per_rank == pytest.approx(14.17e9, rel=1e-3)  # 20 bytes per parameter
    with pytest.raises(ConfigError) as error:
        check_fits([plan])
    assert str(error.value) == (
        "trainer_config.distributed_method: ddp needs about 14.2 GB per rank for parameters, gradients "
        "and AdamW state, 28.3 GB for the 2 ranks on this machine (before activations); 25.8 GB of host "
        "memory available; use distributed_method=fsdp, more ranks, or a smaller model")


def test_gpt2_large_under_fsdp_on_two_ranks_fits():
    plan = plan_on_one_machine("fsdp", 2)
    assert plan.per_rank == pytest.approx(5.67e9, rel=1e-3)  # 16 bytes per parameter, halved
    check_fits([plan])


def test_fsdp_on_gpus_is_told_about_cpu_offload_and_unknown_memory_is_not_refused():
    on_gpu = MemoryPlan("fsdp", per_rank=10**10, sharers=1, memory="cuda:0 memory", available=10**9)
    with pytest.raises(ConfigError, match="use more ranks, cpu_offload=True, or a smaller model$"):
        check_fits([MemoryPlan("fsdp", 1, 1, "cuda:0 memory", 10**9), on_gpu])
    check_fits([MemoryPlan("ddp", 10**15, 1, "host memory", available=None)])

