"""generate.py end to end on a freshly trained tiny snapshot: output, seeding, and refusing bad input.

Runs the command as users do (a new process, from the repo root and from mingpt/) where exit codes
and stderr matter; calls main() in-process elsewhere, which spares a torch import per case.
"""
import shutil
import sys

import pytest
import torch
from helpers import MINGPT, REPO, assert_ok, command_in_process, run

from mingpt import generate

PROMPT = "The king"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def snapshot(tiny_epoch):
    """A snapshot after one epoch of a tiny model on the generated text (read, never altered)."""
    return tiny_epoch.snapshot


def run_generate(*args, cwd=REPO, script=MINGPT / "generate.py"):
    return run([sys.executable, script, *args], cwd=cwd, timeout=120)


def generate_in_process(capsys, *args) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of generate.main(args)."""
    done = command_in_process(generate.main, capsys, *args)
    return done.returncode, done.stdout, done.stderr


def one_error_line(status: int, stderr: str, stdout: str = "") -> str:
    assert status == 1
    assert "Traceback" not in stderr + stdout
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


ARGS = ("--prompt", PROMPT, "--length", 200, "--temperature", 0.8, "--top-k", 10, "--seed", 1)


@pytest.fixture(scope="module")
def from_repo_root(snapshot):
    result = run_generate("--snapshot", snapshot, *ARGS)
    assert_ok(result)
    return result


@pytest.mark.slow
def test_prints_the_prompt_and_exactly_length_vocabulary_characters(from_repo_root, text_file):
    out = from_repo_root.stdout
    assert out.startswith(PROMPT) and out.endswith("\n")
    generated = out[len(PROMPT):-1]  # print() ends the text with one newline
    assert len(generated) == 200
    assert set(generated) <= set(text_file.read_text())
    assert from_repo_root.stderr == ""


@pytest.mark.slow
def test_runs_from_inside_mingpt_with_the_same_text_for_the_same_seed(snapshot, from_repo_root):
    result = run_generate("--snapshot", snapshot, *ARGS, cwd=MINGPT, script="generate.py")
    assert_ok(result)
    assert result.stdout == from_repo_root.stdout


def test_same_seed_same_text_other_seed_other_text(snapshot, capsys):
    texts = [generate_in_process(capsys, "--snapshot", snapshot, "--length", 100, "--seed", seed)[1]
             for seed in (1337, 1337, 1338)]
    assert texts[0] == texts[1] != texts[2]


def test_without_the_cache_the_same_text(snapshot, capsys):
    """--no-cache recomputes the whole context at every token (the model's block is 16: the window
    slides, too); a seeded sample draws the same text, through the same logits."""
    settings = ["--snapshot", snapshot, "--length", 40, "--seed", 7]
    assert generate_in_process(capsys, *settings)[1] == generate_in_process(capsys, *settings, "--no-cache")[1]


def test_defaults(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = generate.parse_args([])
    settings = (args.snapshot, args.prompt, args.length, args.temperature, args.top_k, args.seed, args.device,
                args.cache)
    assert settings == ("gpt_snapshot.pt", "\n", 500, 1.0, None, 1337, "cpu", True)


def test_the_default_prompt_is_a_newline(snapshot, capsys):
    status, out, _ = generate_in_process(capsys, "--snapshot", snapshot, "--length", 20)
    assert status == 0
    assert out.startswith("\n") and len(out) == 1 + 20 + 1


def test_temperature_zero_is_greedy_whatever_the_seed(snapshot, capsys):
    outputs = {generate_in_process(capsys, "--snapshot", snapshot, "--length", 30, "--temperature", 0,
                                   "--seed", seed)[1] for seed in (1, 2)}
    assert len(outputs) == 1


def test_a_snapshot_folder_gives_its_newest_snapshot(snapshot, tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(snapshot, folder / "snapshot_000000042.pt")
    (folder / "snapshot_000000007.pt").write_bytes(b"older and broken: must not be read")
    from_file = generate_in_process(capsys, "--snapshot", snapshot, "--length", 50)
    from_folder = generate_in_process(capsys, "--snapshot", folder, "--length", 50)
    assert from_folder == from_file and from_file[0] == 0


def test_unknown_prompt_characters_are_named_in_one_line(snapshot, capsys):
    status, out, err = generate_in_process(capsys, "--snapshot", snapshot, "--prompt", "ROMEO: Zounds!")
    line = one_error_line(status, err, out)
    # make_text has no 'R', 'E', ':', 'Z' or '!'; each is named once, in prompt order.
    assert line.startswith("error: --prompt: 'R', 'E', ':', 'Z', '!' not in the snapshot's vocabulary")
    assert "use only characters of the text it was trained on" in line
    assert out == ""


def test_a_missing_snapshot_says_how_to_get_one(tmp_path, capsys):
    status, out, err = generate_in_process(capsys, "--snapshot", tmp_path / "none.pt")
    line = one_error_line(status, err, out)
    assert f"no snapshot at {tmp_path / 'none.pt'}" in line and "train one first" in line


@pytest.mark.parametrize("damage", ["truncated", "not a snapshot"])
def test_an_unreadable_snapshot_is_one_line(snapshot, tmp_path, capsys, damage):
    broken = tmp_path / "broken.pt"
    if damage == "truncated":
        broken.write_bytes(snapshot.read_bytes()[:2000])
    else:
        torch.save({"weights": torch.zeros(2)}, broken)
    status, out, err = generate_in_process(capsys, "--snapshot", broken)
    line = one_error_line(status, err, out)
    assert line.startswith(f"error: snapshot {broken}")
    assert "--snapshot" in line and "trainer_config" not in line


def test_a_snapshot_of_a_model_that_does_not_rebuild_is_one_line(snapshot, tmp_path, capsys):
    state = torch.load(snapshot, weights_only=True)
    state["model_state"].pop("head.weight")
    torch.save(state, tmp_path / "damaged.pt")
    status, out, err = generate_in_process(capsys, "--snapshot", tmp_path / "damaged.pt")
    assert "does not rebuild a model" in one_error_line(status, err, out)


@pytest.mark.parametrize("option, value, message", [
    ("--length", "-1", "error: --length: must not be negative, got -1"),
    ("--length", "many", "error: argument --length: invalid int value: 'many'"),
    ("--temperature", "-0.5", "error: --temperature: must be 0 (greedy) or a positive number"),
    ("--temperature", "nan", "error: --temperature: must be 0 (greedy) or a positive number"),
    ("--temperature", "inf", "error: --temperature: must be 0 (greedy) or a positive number"),
    ("--top-k", "0", "error: --top-k: must be at least 1, got 0"),
    ("--top-k", "2.5", "error: argument --top-k: invalid int value: '2.5'"),
    ("--seed", str(2**70), "error: --seed: must fit in 64 bits"),
    ("--device", "tpu", "error: argument --device: invalid choice: 'tpu'"),
    ("--prompt", "", "error: --prompt: empty"),
])
def test_bad_options_are_one_line_naming_the_option(snapshot, capsys, option, value, message):
    status, out, err = generate_in_process(capsys, "--snapshot", snapshot, option, value)
    assert one_error_line(status, err, out).startswith(message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_a_gpu_says_to_use_the_cpu(snapshot, capsys):
    status, out, err = generate_in_process(capsys, "--snapshot", snapshot, "--device", "cuda")
    assert "use --device cpu" in one_error_line(status, err, out)
