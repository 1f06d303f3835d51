"""planning/advice.py: plan.py's recommendation as memory and bandwidth change: less memory moves it to
sharding, then activation checkpointing, then CPU offload; a slower network asks for more gradient
accumulation. The command around it: tests/test_plan.py."""
import pytest

from mingpt.plan import ClusterOptions, make_setting
from mingpt.planning.advice import plan_rows, recommend, table
from mingpt.run_config import from_command_line

PRESET_ALONE = ["gpt_config.n_layer=null", "gpt_config.n_head=null", "gpt_config.n_embd=null"]
XL = ["gpt_config.model_type=gpt2-xl", *PRESET_ALONE]
GPT2 = ["gpt_config.model_type=gpt2", *PRESET_ALONE]


def planned(overrides: list[str], **cluster) -> tuple[list, list[str]]:
    """The rows and the recommendation for a config (65 characters, as tiny-shakespeare's) on a cluster."""
    setting = make_setting(from_command_line(overrides, "plan.py"), ClusterOptions(**cluster), vocab_size=65)
    rows = plan_rows(setting)
    return rows, recommend(rows, setting)


@pytest.mark.slow
def test_less_memory_moves_the_recommendation_to_sharding_then_checkpointing_then_offload():
    """gpt2-xl, batch 16 on one node of 8 H100s: DDP fits 80 GB; in 20 GB only FSDP; in 4.5 GB only
    FSDP with activation checkpointing; in 3 GB only with CPU offload as well."""
    advice = {}
    for memory_gb in (80, 20, 4.5, 3):
        _, lines = planned(["trainer_config.batch_size=16", *XL], gpus_per_node=8, device="H100",
                           memory_gb=memory_gb)
        advice[memory_gb] = "\n".join(lines)
    assert "ddp does not fit" not in advice[80]
    assert "- ddp does not fit" in advice[20] and "distributed_method=fsdp" in advice[20]
    assert "distributed_method=fsdp trainer_config.activation_checkpointing=full " \
           "trainer_config.grad_accum_steps" in advice[4.5]
    assert "activation_checkpointing=full trainer_config.cpu_offload=True" in advice[3]


@pytest.mark.slow
def test_a_slower_network_asks_for_more_gradient_accumulation():
    """gpt2 across 8 nodes: DDP's all-reduce outlasts its backward pass more as the network slows,
    and more micro-batches per synchronisation bring the efficiency back to the target."""
    efficiency, steps = {}, {}
    for gbps in (3200, 400):
        rows, lines = planned(["trainer_config.batch_size=32", *GPT2], nodes=8, gpus_per_node=8,
                              device="H100", inter_gbps=gbps)
        ddp = next(row for row in rows if row.method == "ddp" and row.checkpointing == "none")
        efficiency[gbps] = ddp.timing.efficiency
        assert "Recommended: trainer_config.distributed_method=ddp" in lines[0]
        steps[gbps] = int(lines[0].split("grad_accum_steps=")[1].split(":")[0])
    assert efficiency[400] < efficiency[3200] < 0.9
    assert 1 < steps[3200] < steps[400]


def test_a_muon_run_s_plan_shows_newton_schulz_in_every_row_and_its_exchange_among_the_reasons():
    """The default model on 2 nodes of 8 H100s: each row's step is AdamW's plus Newton-Schulz (a column
    of its own) and, sharded, the exchange (in the traffic and what is exposed); an AdamW run's plan
    has no such column."""
    plans = {}
    for name in ("adamw", "muon"):
        config = from_command_line([f"optimizer_config.name={name}"], "plan.py")
        setting = make_setting(config, ClusterOptions(nodes=2, gpus_per_node=8, device="H100"), vocab_size=65)
        rows = plan_rows(setting)
        plans[name] = (rows, table(rows, setting), recommend(rows, setting))
    (adamw_rows, adamw_table, _), (rows, muon_table, reasons) = plans["adamw"], plans["muon"]
    assert "NS s" in muon_table and "NS s" not in adamw_table
    for adamw, muon in zip(adamw_rows, rows):
        newton_schulz = muon.timing.newton_schulz
        assert adamw.timing.newton_schulz == 0 < newton_schulz and f"{newton_schulz:>7.3f}" in muon_table
        exchange = muon.timing.traffic.intra_bytes - adamw.timing.traffic.intra_bytes
        assert (exchange > 0) == (muon.method != "ddp")
        assert muon.timing.seconds >= adamw.timing.seconds + newton_schulz
    assert any("Muon adds" in line and "Newton-Schulz" in line for line in reasons)
