"""Helpers for the tests: a small generated text, tiny-model overrides, runners for real processes."""
import contextlib
import hashlib
import http.server
import json
import os
import random
import re
import struct
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import psutil
import torch

REPO = Path(__file__).resolve().parent.parent
MINGPT = REPO / "mingpt"
MAIN = MINGPT / "main.py"
WORKER_SCRIPTS = REPO / "tests" / "workers"  # torchrun entry points that look inside a rank
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the `torchrun` console script's module

LOSS_LINE = re.compile(r"\[RANK(\d+)\] Epoch (\d+) \| Iter (\d+) \| (Train|Eval) Loss ([\d.]+)")

WORDS = "the king queen shall speak of love and war to thee my lord good night sweet prince".split()


def make_text(n_chars: int, seed: int = 0) -> str:
    """Word salad with line breaks: structured enough for a tiny model to learn quickly."""
    rng = random.Random(seed)
    lines = []
    while sum(len(line) + 1 for line in lines) < n_chars:
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))).capitalize() + ".")
    return "\n".join(lines)[:n_chars]



def make_gpt2_folder(folder: Path, text: str, tied: bool = True, **config) -> Path:
    """A tiny random GPT-2 model folder as save_pretrained writes it (transformers builds the model
    from a config: nothing is downloaded), with a byte-level BPE of 300 tokens trained on text. Its
    biases and LayerNorms are random too, so that a dropped one changes the logits."""
    import transformers

    from mingpt.tokens.tokenizer import train_bpe

    settings = dict(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=None,
                    eos_token_id=None, activation_function="gelu_new", tie_word_embeddings=tied)
    settings.update(config)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    model.save_pretrained(folder)
    train_bpe(iter([text]), vocab_size=settings["vocab_size"]).save(str(folder / "tokenizer.json"))
    return folder


def gpt2_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """What transformers' GPT2LMHeadModel of the folder gives for ids (eval mode, fp32)."""
    import transformers

    model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(ids).logits


LLMC_MAGIC = 20240520
"""llm.c's GPT-2 shards (dev/data/data_common.py); written here byte by byte, not by mingpt's code."""


def write_llmc_shard(path: Path, ids, magic: int = LLMC_MAGIC, version: int = 1, count: Optional[int] = None,
                     id_format: str = "H") -> Path:
    """An llm.c shard as llm.c writes it: 256 little-endian int32 (magic, version, token count, zeros),
    then the ids (uint16, "H"; "I" for uint32). count: what the header claims (the ids' number)."""
    ids = [int(i) for i in ids]
    header = struct.pack("<3i", magic, version, len(ids) if count is None else count) + bytes(253 * 4)
    path.write_bytes(header + struct.pack(f"<{len(ids)}{id_format}", *ids))
    return path


def llmc_shards_of(text_file: Path, folder: Path, tokenizer_json: Path, shards: int, ids_per_shard: int,
                   val_ids: int = 0) -> str:
    """The text's ids under a byte-level BPE of 300 tokens (saved as tokenizer_json), repeated to fill
    `shards` llm.c shards (train_0.bin, ...) and, with val_ids, a val.bin of the last ones; the glob
    of the training shards."""
    import numpy as np
    from tokenizers import Tokenizer

    from mingpt.tokens.tokenizer import train_bpe

    text = text_file.read_text()
    train_bpe(iter([text]), vocab_size=300).save(str(tokenizer_json))
    ids = np.resize(Tokenizer.from_file(str(tokenizer_json)).encode(text).ids, shards * ids_per_shard)
    folder.mkdir(parents=True)
    for index in range(shards):
        first = index * ids_per_shard
        write_llmc_shard(folder / f"train_{index}.bin", ids[first:first + ids_per_shard])
    if val_ids:
        write_llmc_shard(folder / "val.bin", ids[-val_ids:])
    return str(folder / "train_*.bin")


def write_nanogpt_shard(path: Path, ids) -> Path:
    """A nanoGPT prepare.py file: the uint16 ids, little-endian, nothing else."""
    ids = [int(i) for i in ids]
    path.write_bytes(struct.pack(f"<{len(ids)}H", *ids))
    return path


def tiny_overrides(text_file: Path, snapshot: Path, **extra) -> list[str]:
    """Hydra overrides for a run of a few seconds: tiny model, small batches, fp32."""
    settings = {
        "data_config.path": text_file,
        "data_config.truncate": 1.0,
        "data_config.block_size": 16,
        "gpt_config.n_layer": 2,
        "gpt_config.n_head": 2,
        "gpt_config.n_embd": 32,
        "trainer_config.max_epochs": 1,
        "trainer_config.batch_size": 32,
        "trainer_config.data_loader_workers": 0,
        "trainer_config.save_every": 1,
        "trainer_config.use_amp": False,
        "trainer_config.log_every": 20,
        "trainer_config.snapshot_path": snapshot,
        "optimizer_config.learning_rate": 3e-3,
    }
    settings.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{key}={value}" for key, value in settings.items()]


def _env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.update(extra or {})
    return env


def run(cmd: list, cwd: Path = REPO, env: Optional[dict] = None,
        timeout: float = 180) -> subprocess.CompletedProcess:
    """cmd to its end, its output captured. Whatever ends the wait early (the timeout, pytest-timeout,
    Ctrl-C), the command and every process it started (torchrun's workers, their data workers) die."""
    process = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=_env(env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        kill_tree(process)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL to a process still running and to all its descendants; nothing once it has ended."""
    if process.poll() is not None:
        return
    try:
        root = psutil.Process(process.pid)
        kill_all([root, *root.children(recursive=True)])
    except psutil.NoSuchProcess:
        return
    process.wait()


def kill_all(processes: list[psutil.Process]) -> None:
    """SIGKILL to each (those already gone are skipped), then wait until they are gone."""
    for member in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(processes, timeout=10)


def run_main(args: list, cwd: Path = REPO, nproc: Optional[int] = None, env: Optional[dict] = None,
             script: Path = MAIN) -> subprocess.CompletedProcess:
    """main.py in one process, or under torchrun with nproc workers (gloo)."""
    launcher = [sys.executable] if nproc is None else [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"]
    return run([*launcher, script, *args], cwd=cwd, env=env)


def command_in_process(main, capsys, *args) -> subprocess.CompletedProcess:
    """A command's main(args) in this process (generate.py's, hellaswag.py's): its exit status and
    what it said."""
    try:
        main([str(arg) for arg in args])
        status = 0
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, out, err)


def run_main_in_process(args: list, capsys) -> subprocess.CompletedProcess:
    """main.py's run() in this process, on the config Hydra composes from args: what a run does or
    refuses, without a process's start-up (seconds of imports), for tests of the run rather than of
    the command line (tests that start main.py cover that). Its signal handlers and process groups
    are gone when it returns; a test that trains this way wants the one_torch_thread fixture."""
    from hydra import compose, initialize_config_dir

    from mingpt.common.logger import log
    from mingpt.main import run

    with initialize_config_dir(config_dir=str(MINGPT), version_base=None):
        cfg = compose("gpt2_train_cfg", overrides=[str(arg) for arg in args])
    capsys.readouterr()
    try:
        status = run(cfg)
    except SystemExit as stop:
        status = stop.code
    finally:
        log.handlers.clear()  # it writes to this test's captured stdout
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, captured.out, captured.err)


def losses(output: str, kind: str = "Train") -> list[tuple[int, int, int, float]]:
    """(rank, epoch, iteration, loss) of each of the original's loss lines of one kind."""
    return [(int(r), int(e), int(i), float(loss))
            for r, e, i, k, loss in LOSS_LINE.findall(output) if k == kind]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


class RunsCode:
    """Pickles to a call of os.system: a snapshot holding one must be refused, never executed."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@contextmanager
def serving(body: bytes) -> Iterator[tuple[str, list]]:
    """An HTTP server on loopback answering every GET with body; yields its URL and a request log."""
    requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/input.txt", requests
    finally:
        server.shutdown()


def run_with_restarts(text_file, snapshot, fault=None, fault_rank=1, method="ddp", epochs=2, **extra):
    """Epochs on 2 ranks under torchrun --max-restarts, a step snapshot every 10 steps, with a
    fault planted by tests/workers/fault_injection.py (FAULT=...); extra: more overrides, as
    tiny_overrides'."""
    overrides = tiny_overrides(text_file, snapshot, trainer_config__max_epochs=epochs,
                               trainer_config__save_every_steps=10, trainer_config__distributed_method=method,
                               **extra)
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # reliable elastic restarts (notes)
    if fault:
        env.update(FAULT=fault, FAULT_RANK=str(fault_rank))
    result = run([*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=2",
                  WORKER_SCRIPTS / "fault_injection.py", *overrides], env=env, timeout=300)
    assert_ok(result)
    return result


def final_state(snapshot) -> dict:
    """What a snapshot holds that training computed: the weights and AdamW's state (step counts
    and moments), to compare with tests/state_equality.py."""
    state = torch.load(snapshot, weights_only=True)
    assert state["optimizer_state"]["state"], f"{snapshot} holds no optimizer state"
    return {"model": state["model_state"], "optimizer": state["optimizer_state"]["state"]}


def start_until(cmd: list, line_wanted: str,
                env: Optional[dict] = None) -> tuple[subprocess.Popen, list[str]]:
    """Start cmd in a session of its own and read its output until a line holding line_wanted."""
    process = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1",
                               "PYTHONUNBUFFERED": "1", **(env or {})}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    for line in process.stdout:
        seen.append(line)
        if line_wanted in line:
            return process, seen
    raise AssertionError("".join(seen))


def signal_every_process(process: subprocess.Popen, number: int) -> list[psutil.Process]:
    """The signal to process and every descendant (sessions of their own too), as Slurm's proctrack
    sends it; returns those signalled."""
    tree = psutil.Process(process.pid)
    everyone = [tree, *tree.children(recursive=True)]
    for member in everyone:
        member.send_signal(number)
    return everyone


def refused_leaving_nothing(folder: Path, data) -> str:
    """Preparing and opening data (a DataConfig) fails with one DataError line, and folder is left as
    it was: that line."""
    from mingpt.char_dataset import open_corpus, prepare_corpus
    from mingpt.common.errors import DataError

    before = sorted(folder.rglob("*"))
    try:
        prepare_corpus(data)
        open_corpus(data)
    except DataError as refused:
        message = str(refused)
    else:
        raise AssertionError(f"{data} was not refused")
    assert "\n" not in message and sorted(folder.rglob("*")) == before, message
    return message


def one_error_line(result) -> str:
    """The one line a failed command said (exit status 1, no traceback)."""
    assert result.returncode == 1, (result.returncode, result.stderr)  # the README's promise
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def the_error_line(output: str) -> str:
    """The one `error:` line a run said (said once for the world, by whichever rank speaks for it)."""
    said = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(said) == 1, output
    return said[0]


LAUNCHER_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):\n(?:\s.*\n)+"
                                r"torch\.distributed\.elastic\.multiprocessing\.errors\.ChildFailedError:.*\n"
                                r"=+\n(?:.*\n)*?=+$", re.M)
"""torchrun's own report of a failed worker (its traceback and its table), which the project cannot
change (README: "torchrun then adds a ChildFailedError block of its own")."""


def the_ranks_one_error_line(output: str) -> str:
    """The one `error:` line the ranks of a failed torchrun run said, with no traceback of theirs
    (torchrun's own report aside); output: the run's stderr, or its stdout and stderr together."""
    ours = LAUNCHER_TRACEBACK.sub("", output)
    assert "Traceback" not in ours, output
    said = [line for line in ours.splitlines() if line.startswith("error:")]
    assert len(said) == 1, output
    return said[0]


def rank_exit_status(output: str, rank: int) -> Optional[int]:
    """A worker's exit status, as torchrun's report of a failed run gives it (None: not reported)."""
    found = re.search(rf"^\s*rank\s*: {rank} \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)", output, re.M)
    return int(found[1]) if found else None


def rank_process(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    """The worker of a torchrun run with RANK=rank."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        if child.environ().get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in child.environ():
            if child.name() != "pt_data_worker":
                return child
    raise AssertionError(f"no rank {rank} under torchrun {launcher.pid}")


def check_two_rank_run(result, snapshot) -> None:
    """A tiny 2-rank run finished, with one snapshot writer and rank-0-only progress lines."""
    assert_ok(result)
    assert result.stdout.count("Snapshot saved at epoch 1") == 1
    assert result.stdout.count("Data has") == 1
    assert {rank for rank, *_ in losses(result.stdout)} == {0}, "a line meant for rank 0 came from another"
    assert "(mean over" in result.stdout and "on 2 ranks)" in result.stdout
    assert snapshot.exists()


def hellaswag_items(count: int, seed: int = 0) -> list[dict]:
    """Items in HellaSwag's format (ctx, 4 endings, label) in make_text's words, many longer than the
    tiny model's block of 16 characters (cut to it). In every other item the wrong endings are words
    spelt backwards (a model trained on make_text's text prefers the right one); in the others all
    four are words."""
    rng = random.Random(seed)
    items = []
    for index in range(count):
        ctx = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 2)))
        endings = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 2))) for _ in range(4)]
        label = rng.randrange(4)
        if index % 2 == 0:
            endings = [ending if i == label else ending[::-1] for i, ending in enumerate(endings)]
        items.append({"ctx": ctx, "endings": endings, "label": label})
    return items


def write_hellaswag(path: Path, items: list[dict]) -> Path:
    """A file as HellaSwag's hellaswag_val.jsonl is: one JSON object a line, with some of its other keys."""
    lines = [json.dumps({"ind": index, "activity_label": "Tests", "ctx_a": item["ctx"], "ctx_b": "", **item,
                         "split": "val", "split_type": "indomain", "source_id": f"test~{index}"})
             for index, item in enumerate(items)]
    path.write_text("\n".join(lines) + "\n")
    return path


class Writes:
    """A stderr that keeps each write apart: a line must come in one (two ranks' lines interleave
    between a text's write and its newline's)."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def small_snapshot(epoch: int = 1, n_layer: int = 2, step: int = 10):
    """A snapshot of one 3-value weight and its optimizer's groups, for the snapshot stores' tests."""
    from mingpt.storage.snapshot import Snapshot

    return Snapshot(
        finished_epoch=epoch,
        step=step,
        model_state={"w": torch.full((3,), float(epoch))},
        optimizer_state={"state": {}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}]},
        rng_states=[{"cpu": torch.get_rng_state(), "cuda": None}],
        vocab=list("abc"),
        model_config={"n_layer": n_layer, "n_head": 2, "n_embd": 8, "vocab_size": 3, "block_size": 4,
                      "activation": "gelu", "vocab_multiple": 64},
    )


def tiny_gpt(**overrides):
    """A 2-block GPT of width 32 over 11 tokens, block 16, its weights from seed 0 (settings overridden)."""
    from mingpt.model import GPT, GPTConfig

    settings = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=11, block_size=16)
    settings.update(overrides)
    torch.manual_seed(0)
    return GPT(GPTConfig(**settings))
