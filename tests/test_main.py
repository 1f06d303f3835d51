"""main.py in one process (no torchrun): training, resuming, and refusing bad input; the command as
users start it for the README's cases, main.run() in the test's process for the rest."""
import contextlib
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    RunsCode,
    Writes,
    assert_ok,
    final_state,
    losses,
    one_error_line,
    run,
    run_main,
    run_main_in_process,
    sha256,
    tiny_overrides,
    write_llmc_shard,
)
from state_equality import assert_same_state

from mingpt import generate
from mingpt.storage.snapshot import read_snapshot


def eval_summaries(output: str) -> int:
    """The eval passes' closing lines (a mean over every rank's samples), not the per-batch ones."""
    return output.count("| Eval Loss") - len(losses(output, "Eval"))


@pytest.mark.slow
def test_trains_snapshots_and_resumes_after_the_finished_epoch(text_file, tmp_path, capsys, one_torch_thread):
    """Then, resumed: one eval per epoch, and a snapshot every save_every=2 epochs and at the end (the runs
    of main.run() in this process; the command's own runs are the tests that start main.py)."""
    snapshot = tmp_path / "snap.pt"
    first = run_main_in_process(tiny_overrides(text_file, snapshot, trainer_config__log_every=10), capsys)
    assert_ok(first)
    train = losses(first.stdout)
    assert train[0][1] == 1 and {epoch for _, epoch, _, _ in train} == {1}
    assert train[-1][3] < train[0][3] - 0.5, "the loss did not fall"
    assert "Snapshot not found. Training model from scratch" in first.stdout
    assert "Snapshot saved at epoch 1" in first.stdout
    assert torch.load(snapshot, weights_only=True)["finished_epoch"] == 1
    assert eval_summaries(first.stdout) == 1

    second = run_main_in_process(tiny_overrides(text_file, snapshot, trainer_config__max_epochs=3,
                                                trainer_config__save_every=2), capsys)
    assert_ok(second)
    assert "Resuming training from snapshot at Epoch 1" in second.stdout
    assert {epoch for _, epoch, _, _ in losses(second.stdout)} == {2, 3}
    assert losses(second.stdout)[0][3] < train[0][3] - 0.5, "resumed from scratch weights"
    assert eval_summaries(second.stdout) == 2
    # At epoch 2 by the cadence, and at epoch 3 though it is not a multiple of 2: the run's end is
    # always saved (the original's 10 epochs every 3 left epoch 10 unsaved).
    assert re.findall(r"Snapshot saved at (.*)", second.stdout) == ["epoch 2", "epoch 3 (the last)"]
    assert torch.load(snapshot, weights_only=True)["finished_epoch"] == 3


@pytest.mark.slow
def test_runs_from_inside_mingpt(tiny_epoch):
    assert "Snapshot saved at epoch 1" in tiny_epoch.stdout and tiny_epoch.snapshot.exists()


@pytest.mark.slow
def test_cfg_job_prints_the_config_without_training():
    result = run_main(["--cfg", "job"])
    assert_ok(result)
    for line in ("batch_size: 216", "n_layer: 8", "learning_rate: 0.0003", "truncate: 0.05",
                 "distributed_method: ddp", "path: ${repo_path:data/input.txt}"):
        assert line in result.stdout
    assert "Epoch" not in result.stdout


@pytest.mark.slow
def test_multirun_sweeps(text_file, tmp_path):
    """`-m` runs one job per value, each training its own model; Hydra's sweep folder goes to the
    current directory (here tmp_path, never the repository)."""
    snapshot = tmp_path / "snap_${gpt_config.n_embd}.pt"
    in_repo = lambda: set((REPO / "multirun").rglob("*"))  # noqa: E731
    before = in_repo()
    overrides = tiny_overrides(text_file, snapshot, gpt_config__n_embd="16,32", trainer_config__max_steps=3)
    result = run_main(["-m", *overrides], cwd=tmp_path)
    assert_ok(result)
    widths = [read_snapshot(str(tmp_path / f"snap_{n}.pt")).model_config["n_embd"] for n in (16, 32)]
    assert widths == [16, 32]
    assert (tmp_path / "multirun").is_dir() and in_repo() == before


@pytest.mark.parametrize("override, message", [
    ("trainer_config.batch_size=0", "error: trainer_config.batch_size: must be positive"),
    ("trainer_config.max_epochs=-1", "error: trainer_config.max_epochs: must be positive"),
    ("trainer_config.distributed_method=horovod", "error: trainer_config.distributed_method"),
    ("trainer_config.distributed_method=hsdp",
     "error: trainer_config.distributed_method: hsdp shards within a node and replicates across nodes, "
     "and this run has one node; on one node use fsdp"),
    ("gpt_config.n_embd=33", "error: gpt_config.n_embd: 33 is not divisible by gpt_config.n_head=2"),
    ("gpt_config.model_type=gpt-nano", "error: gpt_config.model_type: preset 'gpt-nano' given together"),
    ("gpt_config.vocab_size=65", "error: gpt_config.vocab_size: comes from the data"),
    ("data_config.train_split=1.5", "error: data_config.train_split: must be between 0 and 1"),
    ("data_config.block_size=6000", "error: data_config.block_size=6000 is not smaller than the text"),
    ("data_config.path=/nonexistent/input.txt", "error: data_config.path: no such file"),
    # Keys that must be positive, at 0 (0 means "off" only for the keys that say so).
    ("trainer_config.keep_last=0", "error: trainer_config.keep_last: must be positive, got 0"),
    ("trainer_config.grad_accum_steps=0", "error: trainer_config.grad_accum_steps: must be positive, got 0"),
    ("trainer_config.save_every=0", "error: trainer_config.save_every: must be positive, got 0"),
    ("trainer_config.log_every=0", "error: trainer_config.log_every: must be positive, got 0"),
    ("optimizer_config.learning_rate=0", "error: optimizer_config.learning_rate: must be positive, got 0"),
    ("gpt_config.vocab_multiple=0", "error: gpt_config.vocab_multiple: must be positive, got 0"),
    # Hydra's advice for a misspelt key adds it, and to_object would drop it without a word.
    ("+trainer_config.batch_sz=16", "error: trainer_config.batch_sz: is not a key of TrainerConfig"),
    ("+anything=1", "error: anything: is not a key of TrainConfig"),
    # 5,385 training samples: a larger step would be the whole split, shorter than it claims.
    ("trainer_config.batch_size=6000", "error: trainer_config.batch_size: a step of 6,000 samples "
     "(6000 x 1 accumulation x 1 process(es)) is more than the 5,385 training samples; use at most 5385"),
])
def test_bad_input_is_one_line_naming_the_key(text_file, tmp_path, capsys, override, message):
    result = run_main_in_process([*tiny_overrides(text_file, tmp_path / "snap.pt"), override], capsys)
    assert one_error_line(result).startswith(message)
    assert not (tmp_path / "snap.pt").exists()


@pytest.mark.slow
def test_bad_input_on_the_command_line_exits_1_with_one_line(tmp_path):
    """The tests around this one refuse in process; here the real command does, from its shell."""
    result = run_main(tiny_overrides(tmp_path / "missing.txt", tmp_path / "snap.pt"))
    assert one_error_line(result).startswith("error: data_config.path: no such file")
    assert not (tmp_path / "snap.pt").exists()


@pytest.mark.slow
def test_a_model_too_large_for_memory_is_refused_before_it_is_built(text_file, tmp_path, capsys):
    """64 layers 8192 wide: 51.5G parameters, 824 GB with gradients and AdamW under DDP, more
    than any machine here has. The model is on the meta device when it is refused, so this takes
    seconds and allocates nothing of that size."""
    result = run_main_in_process(tiny_overrides(text_file, tmp_path / "snap.pt", gpt_config__n_layer=64,
                                                gpt_config__n_head=64, gpt_config__n_embd=8192), capsys)
    line = one_error_line(result)
    assert line.startswith("error: trainer_config.distributed_method: ddp needs about 824")
    assert line.endswith(" GB of host memory available; "  # one rank: sharding has nothing to divide
                         "use more ranks (on more machines), or a smaller model")
    assert result.returncode == 1 and not (tmp_path / "snap.pt").exists()


@pytest.mark.slow
def test_a_misspelt_key_is_one_line_with_the_key_it_may_mean(text_file, tmp_path):
    """Refused before Hydra would (eight lines of its own), in one line with the nearest key."""
    result = run_main([*tiny_overrides(text_file, tmp_path / "snap.pt"), "trainer_config.batch_sise=3"])
    assert one_error_line(result) == (
        "error: trainer_config.batch_sise: is not a key of TrainerConfig (did you mean "
        "trainer_config.batch_size?); `python main.py --help` lists every key")
    assert not (tmp_path / "snap.pt").exists()


@pytest.mark.slow
def test_preset_alone_is_accepted(text_file, tmp_path, capsys, one_torch_thread):
    overrides = tiny_overrides(text_file, tmp_path / "snap.pt", trainer_config__max_steps=2)
    result = run_main_in_process([*overrides, "gpt_config.model_type=gpt-nano", "gpt_config.n_layer=null",
                                  "gpt_config.n_head=null", "gpt_config.n_embd=null"], capsys)
    assert_ok(result)
    assert "0.09M parameters" in result.stdout  # gpt-nano: 3 layers, 3 heads, 48 wide


@pytest.fixture
def trained_snapshot(trained_once, tmp_path):
    """A copy of the module's trained snapshot, for a test to alter."""
    snapshot = tmp_path / "snap.pt"
    shutil.copy(trained_once, snapshot)
    return snapshot


def test_snapshot_of_another_model_is_refused_and_untouched(text_file, trained_snapshot, capsys):
    before = sha256(trained_snapshot)
    result = run_main_in_process(tiny_overrides(text_file, trained_snapshot, gpt_config__n_layer=3), capsys)
    assert one_error_line(result).startswith("error: snapshot")
    assert "another model: n_layer=2 (config: 3)" in result.stderr
    assert sha256(trained_snapshot) == before
    # The refused start-up gave the path back: no lease left, nor a thread refreshing it.
    assert not trained_snapshot.with_suffix(".lease.json").exists()
    assert "mingpt-lease" not in [thread.name for thread in threading.enumerate()]


def test_snapshot_of_another_vocabulary_is_refused(text_file, tmp_path, trained_snapshot, capsys):
    other_text = tmp_path / "other.txt"
    other_text.write_text(text_file.read_text().replace("k", "@"))  # as many characters, one differs
    result = run_main_in_process(tiny_overrides(other_text, trained_snapshot), capsys)
    assert "another vocabulary" in one_error_line(result)


def test_corrupt_snapshot_is_refused_and_untouched(text_file, trained_snapshot, capsys):
    """(A damaged snapshot met by two processes under torchrun: tests/end_to_end/test_distributed.py.)"""
    content = trained_snapshot.read_bytes()[: 2000]
    trained_snapshot.write_bytes(content)
    result = run_main_in_process(tiny_overrides(text_file, trained_snapshot, trainer_config__max_epochs=2),
                                 capsys)
    line = one_error_line(result)
    # torch's reason, whole sentences only: it used to stop in the middle of a word
    reason = ("(RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central "
              "directory. This is an internal miniz error.); ")
    assert reason in line, line
    assert trained_snapshot.read_bytes() == content


def test_snapshot_whose_pickle_calls_a_function_runs_nothing(text_file, trained_snapshot, tmp_path, capsys):
    marker = tmp_path / "executed"
    state = torch.load(trained_snapshot, weights_only=True)
    state["vocab"] = RunsCode(marker)
    torch.save(state, trained_snapshot, pickle_module=pickle)
    before = sha256(trained_snapshot)
    result = run_main_in_process(tiny_overrides(text_file, trained_snapshot, trainer_config__max_epochs=2),
                                 capsys)
    assert "cannot be loaded" in one_error_line(result)
    assert not marker.exists() and sha256(trained_snapshot) == before


@pytest.mark.parametrize("async_snapshots", [False, True])
def test_unwritable_snapshot_folder_fails_cleanly(text_file, tmp_path, capsys, async_snapshots):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    result = run_main_in_process(tiny_overrides(text_file, blocker / "snap.pt",
                                                trainer_config__async_snapshots=async_snapshots), capsys)
    assert "trainer_config.snapshot_path: cannot write to" in one_error_line(result)
    assert "Epoch 1 |" not in result.stdout  # refused before training


def test_unwritable_metrics_folder_of_its_own_fails_cleanly(text_file, tmp_path, capsys):
    """A metrics file outside the snapshot's folder is probed too (beside it, the snapshot's probe
    covers it)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    overrides = tiny_overrides(text_file, tmp_path / "snap.pt",
                               trainer_config__metrics_path=blocker / "metrics.jsonl")
    result = run_main_in_process(overrides, capsys)
    assert "trainer_config.metrics_path: cannot write to" in one_error_line(result)
    assert "Epoch 1 |" not in result.stdout


GLOO_TIMEOUT = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for "
                "recv operation to complete")
NCCL_TIMEOUT = ("[PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught collective operation timeout: "
                "WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=60000) ran for "
                "60008 milliseconds before timing out.")
TIMED_OUT = ("error: [rank 0] a collective timed out: another process stopped answering for 60 s "
             "(trainer_config.process_group_timeout_s=60): it hung, was stopped or fell far behind; see ")
LOST = "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:29500"


@pytest.mark.parametrize("raised, status, said", [
    (RuntimeError(GLOO_TIMEOUT), 1, TIMED_OUT),
    (torch.distributed.DistBackendError(NCCL_TIMEOUT), 1, TIMED_OUT),
    (RuntimeError(LOST), 1, f"error: [rank 0] lost contact with another process (RuntimeError: {LOST})"),
    (KeyboardInterrupt(), 130, "Interrupted: quit at once; the last complete snapshot is as it was"),
], ids=["gloo-timeout", "nccl-timeout", "lost-peer", "ctrl-c"])
def test_a_failed_collective_and_ctrl_c_are_one_line_in_one_write(monkeypatch, raised, status, said):
    """What run() says when training ends on a collective that timed out (gloo's and NCCL's wording),
    one that lost its peer, or Ctrl-C: one line, written whole; a lost peer whose rank said its own
    error (said_elsewhere) is silent; any other error keeps its traceback."""
    from mingpt import main
    from mingpt.run_config import compose_config

    def train(config, env):
        raise raised

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(main, "ddp_setup", lambda config: contextlib.nullcontext())
    monkeypatch.setattr(main, "train", train)
    cfg = compose_config(["trainer_config.process_group_timeout_s=60"])
    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    assert main.run(cfg) == status
    [line] = stderr.writes
    assert line.startswith(said) and line.endswith("\n") and line.count("\n") == 1, line
    if status == 1:
        raised.said_elsewhere = True  # distributed_session's mark: another rank said the run's line
        assert main.run(cfg) == 1 and len(stderr.writes) == 1
    raised = RuntimeError("a bug of this rank's own")
    with pytest.raises(RuntimeError, match="a bug"):
        main.run(cfg)


SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def fresh_clone(tmp_path) -> Path:
    """What a fresh clone holds: the files git tracks here, as they are now. Its commands must import
    its own package (PYTHONPATH=root), not the one installed from this checkout."""
    root = tmp_path / "clone"
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    return root


def offline() -> list[str]:
    """A command prefix that runs a command with no network but loopback (a network namespace)."""
    up_loopback = ["sh", "-c", 'ip link set lo up && exec "$@"', "offline"]
    for unshare in (["unshare", "--net"], ["unshare", "--user", "--map-root-user", "--net"]):
        works = subprocess.run([*unshare, *up_loopback, "true"], capture_output=True).returncode == 0
        if shutil.which("ip") and works:
            return [*unshare, *up_loopback]
    pytest.skip("no network namespace here (unshare --net and ip): cannot run a command offline")


def quick_start_commands() -> list[list[str]]:
    """The README's quick start, its commands after the install, as argument lists."""
    section = (REPO / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    lines = [line.split("&& ")[-1] for block in blocks for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith(".venv/bin/python mingpt/")]


@pytest.mark.slow
def test_the_quick_start_works_in_order_in_a_fresh_clone_with_no_network(tmp_path, monkeypatch):
    """The README's quick start as written, in a clone with no network, made short: the laptop config,
    20 steps; generate.py (in this process) on what that left; then the original's default run with
    batch 4 (its 216 take half a minute a step here), which says before its first step how long it
    would take, stopped by SIGTERM to its whole process group (its data worker too) once it trains,
    although the laptop run's snapshot of another model is there."""
    laptop, sample, default = quick_start_commands()
    assert default == [".venv/bin/python", "mingpt/main.py"] and laptop[-2:] == ["--config-name", "laptop"]
    root = fresh_clone(tmp_path)
    assert sha256(root / "data" / "input.txt") == SHAKESPEARE_SHA256  # tracked, and tiny-shakespeare
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(root))
    python = [*offline(), sys.executable]
    short = ["trainer_config.max_steps=20", "trainer_config.eval_every_steps=10"]
    trained = run([*python, *laptop[1:], *short], cwd=root, env=env)
    assert_ok(trained)
    sample_line = "Sample from its snapshot: python mingpt/generate.py --snapshot laptop_snapshot.pt"
    assert sample_line in trained.stdout
    assert sample[:2] == [".venv/bin/python", "mingpt/generate.py"]  # run here, in this process
    monkeypatch.chdir(root)
    text = generate.generate(generate.parse_args([*sample[2:], "--length", "50"]))
    assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 50

    process = subprocess.Popen([*python, *default[1:], "trainer_config.batch_size=4"], cwd=root, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    seen = []
    for line in process.stdout:
        seen.append(line)
        if "Epoch 1 | Iter 0 |" in line:
            os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=120)
    output = "".join(seen)
    workers = int(re.search(r"(\d+) data worker\(s\) per process", output).group(1))
    assert workers >= 1 or len(os.sched_getaffinity(0)) < 2, output  # the default's worker is alive
    assert process.returncode == 75 and "Stopping on SIGTERM: snapshot saved at step" in output, output
    assert (root / "gpt_snapshot.pt").exists()
    # The original's start-up line and the split of its 5%, as the README shows them.
    assert "Data has 55769 characters, 59 unique.\n" in output
    assert "50,076 train and 5,565 test samples (random split)" in output
    assert re.search(r"^Batch: 4 per process x 1 accumulation, 512 tokens per step, 12,519 steps per epoch, "
                     r"10 epochs", output, re.M), output
    # A GPU-sized run on this CPU says so before its first step, naming the laptop config.
    forecast = re.search(r"^This run will take about .* estimated before the first\); for a run of minutes on "
                         r"a CPU: python mingpt/main.py --config-name laptop$", output, re.M)
    assert forecast and forecast.start() < output.index("Epoch 1 | Iter 0 |"), output


@pytest.fixture(scope="module")
def trained_once(tiny_epoch):
    """One trained snapshot for the tests below, which each alter a copy of it."""
    return tiny_epoch.snapshot


def shrink_head(state: dict) -> None:
    weights = state["model_state"]
    weights["head.weight"] = weights["head.weight"][:, :-1].clone()


def drop_final_norm(state: dict) -> None:
    del state["model_state"]["ln_f.weight"]


def shrink_head_momentum(state: dict) -> None:
    head = state["optimizer_state"]["state"]["head.weight"]
    head["exp_avg"] = head["exp_avg"][:, :-1].clone()


@pytest.mark.parametrize("alter, message", [
    (None, "was trained on another vocabulary"),
    (shrink_head, "(ValueError: the snapshot's head.weight is (64, 31), the model's (64, 32))"),  # 37 padded
    (drop_final_norm, "(ValueError: the snapshot lacks ln_f.weight)"),
    (shrink_head_momentum, "the snapshot's head.weight (exp_avg) is (64, 31), the model's (64, 32)"),
], ids=["other-vocabulary", "weight-of-another-shape", "missing-weight", "optimizer-state-of-another-shape"])
def test_snapshot_that_does_not_fit_is_refused_in_one_line_and_untouched(text_file, tmp_path, capsys,
                                                                         trained_once, alter, message):
    """The config matches, the vocabulary or the tensors do not."""
    snapshot, data = tmp_path / "snap.pt", text_file
    if alter is None:
        shutil.copy(trained_once, snapshot)
        data = tmp_path / "other.txt"
        data.write_text(text_file.read_text().replace("k", "@"))  # as many characters, one differs
    else:
        state = torch.load(trained_once, weights_only=True)
        alter(state)
        torch.save(state, snapshot)
    before = sha256(snapshot)
    result = run_main_in_process(tiny_overrides(data, snapshot, trainer_config__max_epochs=2), capsys)
    line = one_error_line(result)
    assert result.returncode == 1
    assert line.startswith(f"error: snapshot {snapshot} ") and message in line
    assert "Epoch 2 |" not in result.stdout
    assert sha256(snapshot) == before


@pytest.mark.slow
def test_a_bpe_run_resumes_bit_for_bit_and_its_snapshot_speaks(text_file, tmp_path, capsys, one_torch_thread):
    """One process (2 ranks: tests/end_to_end/test_tokens_and_gpt2.py): 6 steps unbroken, and from
    the step-3 snapshot alone, end alike; generate.py decodes the BPE model's tokens; the same
    snapshot with the characters' vocabulary is refused, untouched."""
    bpe = dict(data_config__tokenizer="bpe", data_config__bpe_vocab_size=300, trainer_config__max_steps=6,
               trainer_config__save_every_steps=3)
    unbroken = run_main_in_process(tiny_overrides(text_file, tmp_path / "a", **bpe), capsys)
    assert_ok(unbroken)
    assert "tokens, of a BPE vocabulary of 300." in unbroken.stdout
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "snapshot_000000003.pt", tmp_path / "b")
    resumed = run_main_in_process(tiny_overrides(text_file, tmp_path / "b", **bpe), capsys)
    assert_ok(resumed)
    assert "Resuming training from snapshot at Epoch 0 (step 3" in resumed.stdout
    last = [folder / "snapshot_000000006.pt" for folder in (tmp_path / "a", tmp_path / "b")]
    assert_same_state(final_state(last[1]), final_state(last[0]))

    generate.main(["--snapshot", str(last[0]), "--prompt", "The king", "--length", "20", "--device", "cpu"])
    written = capsys.readouterr().out
    assert written.startswith("The king") and len(written) > len("The king") + 10

    before = sha256(last[1])
    characters = tiny_overrides(text_file, tmp_path / "b", trainer_config__max_steps=9)
    as_characters = run_main_in_process(characters, capsys)
    assert "is of another model: vocab_size=300 (config: 37)" in one_error_line(as_characters)
    assert sha256(last[1]) == before


@pytest.mark.slow
def test_a_muon_run_resumes_bit_for_bit(text_file, tmp_path, capsys, one_torch_thread):
    """optimizer_config.name=muon: 6 steps unbroken, and from the step-3 snapshot alone, end alike (Muon's
    momentum buffers and AdamW's moments in the snapshot). Under fsdp and hsdp: tests/end_to_end/test_muon_runs.py."""
    muon = dict(optimizer_config__name="muon", trainer_config__max_steps=6, trainer_config__save_every_steps=3)
    assert_ok(run_main_in_process(tiny_overrides(text_file, tmp_path / "a", **muon), capsys))
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "snapshot_000000003.pt", tmp_path / "b")
    resumed = run_main_in_process(tiny_overrides(text_file, tmp_path / "b", **muon), capsys)
    assert_ok(resumed)
    assert "Resuming training from snapshot at Epoch 0 (step 3" in resumed.stdout
    last = [folder / "snapshot_000000006.pt" for folder in (tmp_path / "a", tmp_path / "b")]
    state = final_state(last[0])
    assert "momentum_buffer" in state["optimizer"]["blocks.0.attn.qkv.weight"]
    assert "exp_avg" in state["optimizer"]["tok_emb.weight"]
    assert_same_state(final_state(last[1]), state)


@pytest.mark.slow
def test_a_run_on_llmc_shards_with_their_own_validation_resumes_bit_for_bit(text_file, tmp_path, capsys,
                                                                            one_torch_thread):
    """Three llm.c shards of a 300-token BPE to train on (windows straddle them) and one to evaluate
    on, as FineWeb ships them: 6 steps unbroken, and from the step-3 snapshot alone, end alike; start-up
    names the shards. The same shards with the characters' tokenizer are refused in one line."""
    from mingpt.tokens.tokenizer import train_bpe

    tokenizer = train_bpe(iter([text_file.read_text()]), vocab_size=300)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    ids = tokenizer.encode(text_file.read_text()).ids
    shards = tmp_path / "fineweb10B"
    shards.mkdir()
    for i, first in enumerate(range(0, 1200, 400)):
        write_llmc_shard(shards / f"fineweb_train_{i:06d}.bin", ids[first:first + 400])
    write_llmc_shard(shards / "fineweb_val_000000.bin", ids[1200:])
    settings = dict(data_config__val_path=shards / "fineweb_val_*.bin", data_config__tokenizer=tmp_path /
                    "tokenizer.json", trainer_config__max_steps=6, trainer_config__save_every_steps=3,
                    trainer_config__eval_every_steps=3, trainer_config__eval_batches=2)
    unbroken = run_main_in_process(tiny_overrides(shards / "fineweb_train_*.bin", tmp_path / "a", **settings),
                                   capsys)
    assert_ok(unbroken)
    assert "Data: 3 llm.c shards, 1,200 tokens of a vocabulary of 300\n" in unbroken.stdout
    assert (f"Data: {shards}/fineweb_train_*.bin, 1,200 tokens in 3 llm.c shards, vocabulary of 300; "
            f"validation {shards}/fineweb_val_*.bin, {len(ids) - 1200:,} tokens in 1 llm.c shard; "
            f"1,184 train and {len(ids) - 1216:,} test samples (data_config.val_path)") in unbroken.stdout
    assert "| Eval Loss" in unbroken.stdout
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "snapshot_000000003.pt", tmp_path / "b")
    resumed = run_main_in_process(tiny_overrides(shards / "fineweb_train_*.bin", tmp_path / "b", **settings),
                                  capsys)
    assert_ok(resumed)
    assert "Resuming training from snapshot at Epoch 0 (step 3" in resumed.stdout
    last = [folder / "snapshot_000000006.pt" for folder in (tmp_path / "a", tmp_path / "b")]
    assert_same_state(final_state(last[1]), final_state(last[0]))

    characters = tiny_overrides(shards / "fineweb_train_*.bin", tmp_path / "c")
    refused = one_error_line(run_main_in_process(characters, capsys))
    assert "set data_config.tokenizer to the tokenizer.json that made the shards" in refused
    assert not (tmp_path / "c").exists()


def test_truncating_a_users_own_text_is_said(text_file, tmp_path, capsys, one_torch_thread):
    """The original's truncate=0.05 was made for tiny-shakespeare; on another text it is said, with
    how much of the text trains, in a warning and in the Data line."""
    result = run_main_in_process(tiny_overrides(text_file, tmp_path / "snap.pt", data_config__truncate=0.5,
                                                trainer_config__max_steps=1), capsys)
    assert_ok(result)
    assert ("warning: data_config.truncate=0.5 keeps the first 3,000 of the text's 6,000 characters"
            in result.stdout)
    assert "3,000 characters (the first 50% of its 6,000: data_config.truncate)" in result.stdout


@pytest.mark.parametrize("settings, evaluation", [
    ({}, "on all 19 batches per process\n"),  # 599 test samples of 32: within the default's 100
    ({"trainer_config__eval_batches": 2}, "on 2 of 19 batches per process, a fixed seeded subset "
                                         "(trainer_config.eval_batches; 0: all)\n"),
    ({"trainer_config__eval_batches": 2, "data_config__split": "contiguous"},
     "on 2 of 19 batches per process, windows spread evenly without overlap (trainer_config.eval_batches; "
     "0: all)\n"),
], ids=["whole", "subset", "spread"])
def test_start_up_says_how_many_batches_an_evaluation_takes(text_file, tmp_path, capsys, one_torch_thread,
                                                           settings, evaluation):
    result = run_main_in_process(tiny_overrides(text_file, tmp_path / "snap.pt", trainer_config__max_steps=1,
                                                **settings), capsys)
    assert_ok(result)
    assert re.search(r"^Data: .* test samples \(\w+ split\); evaluation every epoch " + re.escape(evaluation),
                     result.stdout, re.M), result.stdout


DIVERGING = {"trainer_config__max_epochs": 2, "optimizer_config__learning_rate": 1e6,
             "trainer_config__grad_norm_clip": 1e9, "trainer_config__log_every": 1}


def test_a_diverging_run_stops_within_two_steps_and_keeps_its_snapshot(text_file, trained_snapshot, capsys,
                                                                        one_torch_thread):
    """fp32 has no GradScaler to skip a step: the first NaN loss is divergence, agreed on and acted
    on two steps later (read a step late, so that no step waits for the device, then all-reduced)."""
    before = sha256(trained_snapshot)
    result = run_main_in_process(tiny_overrides(text_file, trained_snapshot, **DIVERGING), capsys)
    line = one_error_line(result)
    match = re.fullmatch(r"error: training diverged: the loss is not finite from step (\d+) \(learning rate "
                         r"1e\+06; last finite loss [\d.e+]+ at step (\d+)\); stopped, resume from .*snap\.pt "
                         r"\(step 169, the newest snapshot healthy steps followed\), with a lower "
                         r"optimizer_config.learning_rate \(or a warmup: optimizer_config.warmup_steps\)",
                         line)
    assert match, line
    first_bad, last_finite = map(int, match.groups())
    assert 169 < last_finite < first_bad
    assert result.stdout.count("Train Loss nan") <= 3, "trained on long after the loss was NaN"
    assert "Snapshot saved" not in result.stdout and sha256(trained_snapshot) == before


@pytest.mark.slow
@pytest.mark.parametrize("learning_rate, cause", [
    (1e6, r"the weights are not finite at step \d+ \(training diverged\): not saved"),
    (3.0, r"training diverged: the loss spiked from step 171 \(to [\d.]+, [\d.]+x its recent mean [\d.]+\) and did "
          r"not settle in 20 steps \(its gradient norm [\d.]+, [\d.]+x its mean [\d.]+ before the spike; learning "
          r"rate 3\); stopped"),
], ids=["non-finite", "spike"])
def test_a_diverged_run_goes_back_to_its_last_healthy_snapshot(text_file, trained_snapshot, capsys,
                                                              one_torch_thread, learning_rate, cause):
    """A snapshot at every step while the run diverges (to NaN weights, or a loss spike of finite
    values): those written inside the divergence, finite but ruined, are set aside, and the snapshot
    a resume picks is the last one healthy steps followed, with which the run trains on."""
    before = sha256(trained_snapshot)
    diverging = {**DIVERGING, "optimizer_config__learning_rate": learning_rate}
    result = run_main_in_process(tiny_overrides(text_file, trained_snapshot, **diverging,
                                                trainer_config__save_every_steps=1), capsys)
    line = one_error_line(result)
    assert "Snapshot saved at step 171" in result.stdout  # written before the divergence was seen
    assert re.fullmatch(rf"error: {cause}[;,] resume from .*snap\.pt \(step 169, the newest snapshot healthy "
                        r"steps followed\), with a lower optimizer_config.learning_rate .*; set aside so that "
                        r"no run resumes from them: .*snap\.diverged\.pt", line), line
    assert sha256(trained_snapshot) == before
    assert torch.load(trained_snapshot.with_suffix(".diverged.pt"), weights_only=True)["step"] > 169
    resumed = run_main_in_process(tiny_overrides(text_file, trained_snapshot, trainer_config__max_epochs=2),
                                  capsys)
    assert_ok(resumed)
    assert "Resuming training from snapshot at Epoch 1" in resumed.stdout
    assert all(loss < 3 for *_, loss in losses(resumed.stdout)), resumed.stdout


def test_help_lists_every_key_with_its_default_and_what_it_does():
    """`main.py --help` (from inside mingpt/) and docs/configuration.md say the same, from one source:
    the config dataclasses' docstrings; every key has one."""
    import dataclasses

    from mingpt.common.field_docs import field_docs
    from mingpt.run_config import TrainConfig, config_reference

    for group in dataclasses.fields(TrainConfig):
        undocumented = set(f.name for f in dataclasses.fields(group.type)) - set(field_docs(group.type))
        assert not undocumented, f"{group.name}: no docstring for {sorted(undocumented)}"
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == config_reference(markdown=True) + "\n", \
        "docs/configuration.md is out of date: python mingpt/main.py --help=md > docs/configuration.md"
    result = run_main(["--help"], cwd=REPO / "mingpt", script="main.py")
    assert_ok(result)
    for line in ("torchrun --standalone --nproc_per_node=4 main.py", "trainer_config.batch_size=216",
                 "data_config.truncate=0.05", "trainer_config.stop_signals=[SIGTERM,SIGUSR1]"):
        assert line in result.stdout
