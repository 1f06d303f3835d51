"""hellaswag.py on a tiny trained snapshot and a tiny GPT-2 folder, its one-line refusals, and the
evaluation during training: on 2 ranks (FSDP) it scores the run's last snapshot as the command scores
it in one process, each time after that step's snapshot. How items are scored:
tests/reporting/test_hellaswag_eval.py."""
import re
import subprocess
import sys

import pytest
from helpers import (
    MINGPT,
    TORCHRUN,
    assert_ok,
    command_in_process,
    hellaswag_items,
    make_gpt2_folder,
    make_text,
    one_error_line,
    run,
    tiny_overrides,
    write_hellaswag,
)

from mingpt import hellaswag
from mingpt.common.errors import ConfigError
from mingpt.reporting.metrics import read_metrics
from mingpt.trainer import TrainerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ITEMS = hellaswag_items(13)
UNREADABLE = {"ctx": "[title] the tea", "endings": ["1", "2", "3", "4"], "label": 2}
"""An item a character model of make_text's text cannot read."""
RESULT = re.compile(r"^HellaSwag accuracy (\d\.\d{4}) \((\d+) of (\d+) items right; acc_norm, "
                    r"completion-normalised\) for (.+)$", re.M)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_hellaswag(tmp_path_factory.mktemp("hellaswag") / "hellaswag_val.jsonl", [*ITEMS, UNREADABLE])


def in_process(capsys, *args) -> subprocess.CompletedProcess:
    """hellaswag.main(args) in this process: its exit status and what it said."""
    return command_in_process(hellaswag.main, capsys, *args)


def result_of(output: str) -> tuple[float, int, int, str]:
    """(accuracy, right, items, model) of the command's result line."""
    accuracy, right, items, model = RESULT.search(output).groups()
    return float(accuracy), int(right), int(items), model


def test_scores_a_snapshot_and_says_what_it_skipped(tiny_epoch, data, capsys):
    result = in_process(capsys, "--snapshot", tiny_epoch.snapshot, "--data", data)
    assert_ok(result)
    assert result.stdout.splitlines()[0] == (
        f"HellaSwag: 13 items of {data}; 1 skipped for characters the model never saw ('[', ']', '1', '2', "
        "'3', '4'); 5 longer than block_size 16, scored on their last 16 tokens")
    accuracy, right, items, model = result_of(result.stdout)
    assert items == 13 and accuracy == round(right / 13, 4) and model == str(tiny_epoch.snapshot)
    assert right >= 7  # the 7 items whose wrong endings are spelt backwards, at least
    limited = in_process(capsys, "--snapshot", tiny_epoch.snapshot, "--data", data, "--limit", 4)
    assert result_of(limited.stdout)[2] == 4


def test_scores_a_gpt2_folder(tmp_path, data, capsys):
    folder = make_gpt2_folder(tmp_path / "gpt2", make_text(20000))
    result = in_process(capsys, "--model-folder", folder, "--data", data)
    assert_ok(result)
    assert result.stdout.startswith(f"HellaSwag: 14 items of {data}\n")  # a BPE reads any text, whole
    accuracy, right, items, model = result_of(result.stdout)
    assert items == 14 and accuracy == round(right / 14, 4) and model == str(folder)


@pytest.mark.parametrize("args, said", [
    (["--snapshot", "a.pt", "--model-folder", "gpt2"],
     "error: argument --model-folder: not allowed with argument --snapshot (see --help)"),
    (["--limit", "-1"], "error: --limit: must not be negative (0: all), got -1"),
    (["--model-folder", "{tmp}/gpt2"],
     "error: --model-folder: {tmp}/gpt2 does not exist; give a Hugging Face GPT-2 model folder (config.json, "
     "model.safetensors, tokenizer.json"),
    (["--snapshot", "{tmp}/none.pt"], "error: no snapshot at {tmp}/none.pt"),
])
def test_refuses_in_one_line(tmp_path, capsys, args, said):
    result = in_process(capsys, *(arg.format(tmp=tmp_path) for arg in args))
    assert one_error_line(result).startswith(said.format(tmp=tmp_path))


def test_a_missing_file_says_where_to_download_it(tiny_epoch, tmp_path, capsys):
    result = in_process(capsys, "--snapshot", tiny_epoch.snapshot, "--data", tmp_path / "hellaswag_val.jsonl")
    assert one_error_line(result) == (f"error: --data: no such file {tmp_path / 'hellaswag_val.jsonl'}; "
                                      "download HellaSwag's validation file from https://github.com/rowanz/"
                                      "hellaswag (data/hellaswag_val.jsonl) and give its path")


@pytest.mark.parametrize("keys, said", [
    ({"hellaswag_path": ""}, "trainer_config.hellaswag_path: must not be empty"),
    ({"hellaswag_every_steps": -1}, "trainer_config.hellaswag_every_steps: must not be negative"),
    ({"hellaswag_items": -1}, "trainer_config.hellaswag_items: must not be negative"),
])
def test_the_training_keys_refuse_what_means_nothing(keys, said):
    with pytest.raises(ConfigError, match=f"^{re.escape(said)}"):
        TrainerConfig(**keys)


@pytest.mark.slow
def test_runs_from_inside_mingpt(tiny_epoch, data, capsys):
    args = ["--snapshot", tiny_epoch.snapshot, "--data", data]
    result = run([sys.executable, "hellaswag.py", *args], cwd=MINGPT)
    assert_ok(result)
    assert result.stdout == in_process(capsys, *args).stdout


TRAINING_LINE = re.compile(r"^\[RANK0\] Epoch 1 \| Step (\d+) \| HellaSwag (\d\.\d{4}) \((\d+) of (\d+) "
                           r"items right, acc_norm, on 2 ranks\)$", re.M)


@pytest.mark.slow
def test_training_on_two_ranks_scores_its_snapshots_as_the_command_does_on_one(shared_text, data, tmp_path,
                                                                            capsys):
    """FSDP on 2 ranks (every rank must run as many forward passes: 13 items, 7 and 6), HellaSwag every
    40 steps and at the last, each after that step's snapshot: the last figure is the command's on the
    run's last snapshot, in one process."""
    snapshots = tmp_path / "run"
    overrides = tiny_overrides(shared_text, snapshots, trainer_config__distributed_method="fsdp",
                               trainer_config__save_every_steps=40, trainer_config__keep_last=5,
                               trainer_config__hellaswag_path=data, trainer_config__hellaswag_every_steps=40)
    result = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", MINGPT / "main.py", *overrides])
    assert_ok(result)
    scored = [(int(step), float(accuracy), int(right), int(items))
              for step, accuracy, right, items in TRAINING_LINE.findall(result.stdout)]
    last_step = int(re.findall(r"Finished: epoch 1, step (\d+)", result.stdout)[0])
    assert [step for step, *_ in scored] == [40, 80, last_step] and {items for *_, items in scored} == {13}
    for step in (40, 80):  # the snapshot first
        saved, scored_at = (result.stdout.index(line) for line in (f"Snapshot saved at step {step}",
                                                                   f"Step {step} | HellaSwag"))
        assert saved < scored_at
    lines = read_metrics(str(snapshots / "metrics.jsonl"), "hellaswag")
    assert [(line["step"], line["accuracy"], line["correct"], line["items"]) for line in lines] == [
        (step, right / items, right, items) for step, _, right, items in scored]
    alone = in_process(capsys, "--snapshot", snapshots, "--data", data)
    assert_ok(alone)
    accuracy, right, items, model = result_of(alone.stdout)
    assert (right, items) == scored[-1][2:] and model.endswith(f"snapshot_{last_step:09d}.pt")
