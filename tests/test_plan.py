"""plan.py: the run main.py would start, planned on a cluster; its recommendation as memory and
bandwidth change; bad input in one line."""
import sys

import pytest
from helpers import MINGPT, one_error_line, run

from mingpt import plan
from mingpt.plan import ClusterOptions, make_setting, plan_rows, recommend

XL = ["gpt_config.model_type=gpt2-xl", "gpt_config.n_layer=null", "gpt_config.n_head=null",
      "gpt_config.n_embd=null"]


def planned(overrides: list[str], **cluster) -> tuple[list, list[str]]:
    """The rows and the recommendation for a config (65 characters, as tiny-shakespeare's) on a cluster."""
    setting = make_setting(plan.load_run_config(overrides), ClusterOptions(**cluster), vocab_size=65)
    rows = plan_rows(setting)
    return rows, recommend(rows, setting)


def test_the_tutorials_four_gpus_of_16_gb_train_the_default_model_with_ddp(capsys):
    plan.main(["--gpus-per-node", "4", "--device", "V100", "--memory-gb", "16", "--vocab-size", "65"])
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("ddp ", "fsdp ", "hsdp "))]
    assert rows == ["ddp", "ddp", "fsdp", "fsdp"]  # no hsdp on one node; each with and without checkpointing
    assert "Recommended: trainer_config.distributed_method=ddp trainer_config.activation_checkpointing=none" \
        in out
    assert "<- configured" in out


def test_less_memory_moves_the_recommendation_from_ddp_to_checkpointing_and_sharding():
    batch = ["trainer_config.batch_size=16", *XL]
    advice = {}
    for memory_gb in (80, 40, 12):
        _, lines = planned(batch, nodes=1, gpus_per_node=8, device="H100", memory_gb=memory_gb)
        advice[memory_gb] = lines[0]
    assert "distributed_method=ddp trainer_config.activation_checkpointing=none" in advice[80]
    assert "distributed_method=ddp trainer_config.activation_checkpointing=full" in advice[40]
    assert "distributed_method=fsdp" in advice[12]
    _, lines = planned(batch, nodes=1, gpus_per_node=8, device="H100", memory_gb=3)
    assert lines[0].startswith("Nothing fits in 2.0 GB per device at batch_size=16")


def test_a_slower_network_asks_for_more_accumulation_or_another_method():
    """Across 8 nodes, DDP's all-reduce outlasts the backward pass on a slow network: more
    micro-batches per synchronisation (or a method that overlaps more) restore the efficiency."""
    efficiencies, advice = {}, {}
    for gbps in (3200, 25):
        rows, lines = planned(["trainer_config.batch_size=4", "trainer_config.activation_checkpointing=full"],
                              nodes=8, gpus_per_node=8, device="H100", inter_gbps=gbps)
        ddp = next(row for row in rows if row.method == "ddp" and row.checkpointing == "none")
        efficiencies[gbps], advice[gbps] = ddp.timing.efficiency, lines[0]
    assert efficiencies[25] < 0.5 < 0.9 < efficiencies[3200]
    assert "grad_accum_steps=1:" in advice[3200] and "grad_accum_steps=1:" not in advice[25]


@pytest.mark.parametrize("arguments, key", [
    (["--device", "H300"], "--device: unknown device 'H300'; choose one of "),
    (["--nodes", "0"], "--nodes: must be a positive number of nodes, got 0"),
    (["--gpus-per-node", "-2"], "--gpus-per-node: must be a positive number of gpus, got -2"),
    (["--inter-gbps", "0"], "--inter-gbps: must be positive, got 0.0"),
    (["trainer_config.distributed_method=hsdp"],
     "trainer_config.distributed_method: hsdp shards within a node"),
    (["gpt_config.n_layr=2"], "Could not override 'gpt_config.n_layr'"),
])
def test_bad_input_is_one_line_naming_the_key(arguments, key, capsys):
    with pytest.raises(SystemExit) as stop:
        plan.main([*arguments, "--vocab-size", "65"])
    assert stop.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {key}") and "\n" not in err


def test_runs_as_a_script_from_inside_mingpt():
    line = one_error_line(run([sys.executable, "plan.py", "--nodes", "0"], cwd=MINGPT))
    assert line == "error: --nodes: must be a positive number of nodes, got 0"
