"""Pieces the benchmarks share: a trainer over synthetic text, timed steps, and torchrun workers."""
import argparse
import ctypes
import json
import os
import platform
import shutil
import string
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch

from mingpt.char_dataset import CharDataset
from mingpt.distributed.parallel import local_bytes
from mingpt.distributed.process_group import DistEnv
from mingpt.model import GPT, GPTConfig
from mingpt.optimizer import OptimizerConfig
from mingpt.start_up import place_model
from mingpt.trainer import Trainer, TrainerConfig

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
RESULT_PREFIX = "RESULT "


def synthetic_text(chars: int = 200_000, seed: int = 0, vocab_size: int = 65) -> str:
    """Seeded random text over a Shakespeare-sized alphabet (65 symbols): no data file needed, and
    the vocabulary, and with it the output layer's cost, is about what the real corpus gives. A larger
    vocab_size (GPT-2's 50,257) takes that many characters from the code points after U+4E00
    (surrogates skipped), so that a character model has GPT-2's output layer."""
    alphabet = string.ascii_letters + " .,;:!?'-&$3\n"
    if vocab_size != len(alphabet):
        points = (point for point in range(0x4E00, 0x4E00 + 2 * vocab_size) if not 0xD800 <= point < 0xE000)
        alphabet = "".join(chr(point) for _, point in zip(range(vocab_size), points))
    ids = torch.randint(len(alphabet), (chars,), generator=torch.Generator().manual_seed(seed))
    return "".join(alphabet[i] for i in ids.tolist())


def synthetic_dataset(block_size: int, chars: int = 200_000) -> CharDataset:
    return CharDataset(synthetic_text(chars), block_size)


@contextmanager
def benchmark_trainer(env: DistEnv, n_layer: int, n_head: int, n_embd: int, block_size: int,
                      dataset: Optional[CharDataset] = None, **trainer_settings) -> Iterator[Trainer]:
    """A Trainer built through the project's code, snapshotting into a scratch folder (over a
    synthetic text unless given a dataset).

    On the way out its model and optimizer are dropped, while the caller's process-group session
    is still open: a DDP model freed only once the caller's variable goes, after the group is
    destroyed, sometimes hung the worker as it returned (seen about once in 12 DDP runs under load)."""
    dataset = dataset or synthetic_dataset(block_size)
    torch.manual_seed(0)  # dropout
    with torch.device("meta"):  # as main.py builds it: place_model allocates (under FSDP, shards only)
        model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                              vocab_size=dataset.vocab_size, block_size=block_size))
    with tempfile.TemporaryDirectory() as scratch:
        settings = {"data_loader_workers": 0, "use_amp": False, "snapshot_path": f"{scratch}/snap.pt",
                    **trainer_settings}
        config = TrainerConfig(**settings)
        trainer = Trainer(config, place_model(config, OptimizerConfig(), model, env), dataset, None,
                          dataset.vocab, env)
        try:
            yield trainer
        finally:
            trainer.model = trainer.optimizer = trainer.placed = None


def timed_steps(trainer: Trainer, warmup: int, steps: int, before_timing=lambda: None) -> float:
    """Seconds for `steps` training steps after `warmup` untimed ones (each waits for the device)."""
    batches = iter(trainer.train_loader)
    start = time.perf_counter()
    for step in range(warmup + steps):
        if step == warmup:
            before_timing()
            start = time.perf_counter()
        inputs, targets = trainer.to_device(next(batches))
        trainer._run_batch(inputs, targets)[0].item()
    return time.perf_counter() - start


def held_state_bytes(trainer: Trainer) -> int:
    """Parameters, gradients and optimizer state this rank holds."""
    params = list(trainer.model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    moments = [v for state in trainer.optimizer.state.values() for v in state.values() if hasattr(v, "numel")]
    return local_bytes(params) + local_bytes(grads) + local_bytes(moments)


def reset_peak_memory(device: torch.device) -> None:
    """Start measuring a new peak (of the training steps, not of start-up before them)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed start-up memory back to the system
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets the peak resident set (VmHWM)


def peak_memory(device: torch.device) -> int:
    """Bytes at the peak since reset_peak_memory: torch.cuda.max_memory_allocated on a GPU; on the
    CPU the process's peak resident memory (everything: Python, torch, activations)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    status = Path("/proc/self/status").read_text()
    kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(kib) * 1024


SHARED_FLAGS = ("layers", "heads", "embd", "block_size", "warmup", "steps")


def add_shared_arguments(parser: argparse.ArgumentParser, layers: int, heads: int, embd: int,
                         steps: int) -> None:
    """The model shape and timing flags every torchrun benchmark takes, and its hidden worker mode."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--embd", type=int, default=embd)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def shared_flags(args: argparse.Namespace) -> list[str]:
    """The shared flags' values, to pass on to the workers."""
    return [item for name in SHARED_FLAGS
            for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def emit(result: dict) -> None:
    """A worker's figures, for run_workers to find in its output."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_workers(script: str, nproc: int, threads: int, args: list[str]) -> dict:
    """Run `script --worker args` on nproc processes (torchrun if more than one); its RESULT."""
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    result = subprocess.run([*launcher, script, "--worker", *map(str, args)], capture_output=True, text=True,
                            env=env)
    found = [line for line in result.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if result.returncode != 0 or not found:
        sys.exit(f"{script} {args} failed:\n{result.stdout}\n{result.stderr}")
    return json.loads(found[0][len(RESULT_PREFIX):])


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux); platform.processor() is often empty."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The CPU features that decide this project's speed: fp32 vector width, native bf16, AMX tiles.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine() -> dict:
    """What a result was measured on, so that figures from different machines are not compared."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu_name(),
        "cpu_flags": [flag for flag in SPEED_FLAGS if flag in flags],
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


@contextmanager
def scratch_folder(prefix: str, given: Optional[Path] = None, keep: bool = False) -> Iterator[Path]:
    """A temporary folder for a benchmark's runs: removed once the benchmark has its figures, kept
    (and named) when it fails, for the runs' logs, or when asked to (keep). A folder the user gave
    (a --workdir) is theirs: made if need be, never removed."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given.resolve()
        return
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    except BaseException:
        print(f"the runs' files are kept in {folder}", file=sys.stderr, flush=True)
        raise
    if keep:
        print(f"kept {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)


def save_json(path: Path, payload: dict) -> None:
    """The figures, with the machine they were measured on (bench/results/ is committed: the
    docs/performance.md's tables cite these files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2, default=str))
    print(f"wrote {path}")
