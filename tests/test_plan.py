"""plan.py: the run main.py would start, planned on a cluster; its recommendation as memory and
bandwidth change; bad input in one line."""
import sys

import pytest
from helpers import MINGPT, one_error_line, run

from mingpt import plan
from mingpt.plan import ClusterOptions, make_setting, plan_rows, recommend
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
def test_the_tutorials_four_gpus_of_16_gb_train_the_default_model_with_ddp(capsys):
    plan.main(["--gpus-per-node", "4", "--device", "V100", "--memory-gb", "16", "--vocab-size", "65"])
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("ddp ", "fsdp ", "hsdp "))]
    assert rows == ["ddp", "ddp", "fsdp", "fsdp"] * 2  # no hsdp on one node; each with and without
    # checkpointing; in the memory table, then in the time table
    assert "Recommended: trainer_config.distributed_method=ddp trainer_config.activation_checkpointing=none" \
        in out
    assert "<- configured" in out


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


@pytest.mark.parametrize("arguments, key", [
    (["--device", "H300"], "--device: unknown device 'H300'; choose one of "),
    (["--nodes", "0"], "--nodes: must be a positive number of nodes, got 0"),
    (["--gpus-per-node", "-2"], "--gpus-per-node: must be a positive number of gpus, got -2"),
    (["--inter-gbps", "0"], "--inter-gbps: must be positive, got 0.0"),
    (["--mfu", "2"], "--mfu: is a share of the peak, in (0, 1]; got 2.0"),
    (["--efficiency", "0"], "--efficiency: is a share, in (0, 1]; got 0.0"),
    (["--device", "H300", "--memory-gb", "80"], "--device: unknown device 'H300'"),  # no peak given
    (["trainer_config.distributed_method=hsdp"],
     "trainer_config.distributed_method: hsdp shards within a node"),
    (["gpt_config.n_layr=2"], "gpt_config.n_layr: is not a key of GPTConfig (did you mean gpt_config.n_layer?)"),
    (["laptop"], "laptop: is neither an option of plan.py nor a key=value override"),
])
def test_bad_input_is_one_line_naming_the_key(arguments, key, capsys):
    with pytest.raises(SystemExit) as stop:
        plan.main([*arguments, "--vocab-size", "65"])
    assert stop.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {key}") and "\n" not in err


@pytest.mark.slow
def test_runs_as_a_script_from_inside_mingpt():
    line = one_error_line(run([sys.executable, "plan.py", "--nodes", "0"], cwd=MINGPT))
    assert line == "error: --nodes: must be a positive number of nodes, got 0"


def test_the_plan_s_lines_are_at_most_110_characters(capsys):
    """Issue 54: the table and its advice ran to 303 characters a line."""
    plan.main([*XL, "--nodes", "8", "--gpus-per-node", "8", "--device", "H100", "--vocab-size", "65"])
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 110
    assert "Recommended: " in out and "peak fits" in out and "tokens/s   eff" in out


def test_a_config_of_your_own_is_planned(capsys):
    """`--config-name laptop`, as main.py takes it (it was refused as "neither an option")."""
    plan.main(["--config-name", "laptop", "--device", "cpu", "--vocab-size", "65"])
    assert "GPT 0.8M parameters (4 layers, 128 wide, block 64" in capsys.readouterr().out
