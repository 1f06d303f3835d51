"""plan.py: the run main.py would start, planned on a cluster (its tables and recommendation); bad input
in one line. How the recommendation moves as memory and bandwidth change: tests/planning/test_advice.py."""
import sys

import pytest
from helpers import MINGPT, one_error_line, run

from mingpt import plan

PRESET_ALONE = ["gpt_config.n_layer=null", "gpt_config.n_head=null", "gpt_config.n_embd=null"]
XL = ["gpt_config.model_type=gpt2-xl", *PRESET_ALONE]


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
