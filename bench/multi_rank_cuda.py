"""Every multi-rank path on CUDA with a machine's one GPU: 2 ranks share it, talking through gloo.

    python bench/multi_rank_cuda.py [--only NAME,NAME] [--out FILE]

NCCL refuses two ranks on one GPU, so the ranks here talk through gloo, which carries CUDA tensors
through host memory (MINGPT_RANKS_SHARE_GPU=1, distributed/process_group.py).

What this covers: the project's own multi-rank CUDA code, with real torchrun processes. DDP's wrapper
on CUDA tensors with fp16 and its GradScaler, and bf16 (DDP needs broadcast and all_reduce, which
gloo has for CUDA tensors); activation checkpointing; async single-file and sharded snapshots staged
from GPU memory by the writer thread on the rank's device; a stop signal agreed by both ranks, and
the resume after it; a sharded snapshot resumed by 1 rank. FSDP2, with CPU offload, and HSDP as 2
"nodes" of 1 rank (two torchrun agents on this machine) need all-gather and reduce-scatter, which
the project makes of all_to_all on gloo (cpu_collectives.py): torch's backend table lists neither
all_gather nor all_to_all for gloo on CUDA tensors, so those three scenarios are the ones to watch
on the first GPU run (not run on a GPU yet). What it cannot cover: NCCL itself (its collectives,
streams, communicators and timeouts), GPUs talking to each other, and speed (gloo through host
memory is slow).

Without a GPU the same scenarios run on the CPU, as every multi-rank run there does, so the script
itself is tested by the suite (tests/bench/test_multi_rank_cuda.py). Each scenario is one or two
tiny runs of mingpt/main.py; it passes when every run exits as expected and prints what it should.
Results: bench/results/gpu/multi_rank_cuda.json with a GPU, bench/results/multi_rank_cpu.json without.
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from common import REPO, RESULTS, synthetic_text

from mingpt.distributed.process_group import RANKS_SHARE_GPU

MAIN = REPO / "mingpt" / "main.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TINY = {"data_config.block_size": 16, "data_config.truncate": 1.0, "gpt_config.n_layer": 2,
        "gpt_config.n_head": 2, "gpt_config.n_embd": 32, "trainer_config.batch_size": 32,
        "trainer_config.max_epochs": 1, "trainer_config.data_loader_workers": 0,
        "trainer_config.log_every": 10, "trainer_config.save_every": 1,
        "optimizer_config.learning_rate": 3e-3}
RUN_TIMEOUT_S = 300


@dataclass
class Run:
    exit_status: int
    output: str


@dataclass
class Workspace:
    """A scenario's folder: its text, and the snapshots its runs share."""

    folder: Path
    text: Path
    results: dict = field(default_factory=dict)

    def overrides(self, snapshot: str, **settings) -> list[str]:
        values = {**TINY, "data_config.path": self.text,
                  "trainer_config.snapshot_path": self.folder / snapshot,
                  **{key.replace("__", "."): value for key, value in settings.items()}}
        return [f"{key}={value}" for key, value in values.items()]


def environment() -> dict:
    return {**os.environ, RANKS_SHARE_GPU: "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(overrides: list[str], nproc: int = 2, stop_when: Callable[[str], bool] = None) -> Run:
    """main.py on nproc ranks of this machine; with stop_when, SIGTERM to every process of the run
    (as Slurm's scancel sends it) once the output so far satisfies it."""
    command = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", MAIN, *overrides]
    return _run([command], stop_when)[0]


def two_nodes(overrides: list[str]) -> Run:
    """main.py on 2 "nodes" of 1 rank: two torchrun agents on this machine meeting at a rendezvous."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = [*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
             f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=multi-rank-{port}"]
    return _run([[*agent, MAIN, *overrides], [*agent, MAIN, *overrides]])[0]


def _run(commands: list[list], stop_when: Callable[[str], bool] = None) -> list[Run]:
    with tempfile.TemporaryDirectory() as logs:
        paths = [Path(logs) / f"{index}.log" for index in range(len(commands))]
        processes = [subprocess.Popen([str(part) for part in command], stdout=path.open("w"),
                                      stderr=subprocess.STDOUT, env=environment(), start_new_session=True)
                     for command, path in zip(commands, paths)]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
            if stop_when and stop_when(paths[0].read_text()):
                os.killpg(processes[0].pid, signal.SIGTERM)
                stop_when = None
            time.sleep(0.2)
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        return [Run(p.returncode, path.read_text()) for p, path in zip(processes, paths)]


def check(run: Run, *expected: str, exit_status: int = 0) -> None:
    missing = [line for line in expected if line not in run.output]
    if run.exit_status != exit_status or missing:
        raise AssertionError(f"exit status {run.exit_status} (expected {exit_status}); missing {missing}\n"
                             + run.output[-3000:])


# -- the scenarios -------------------------------------------------------------------------------

ON_GPU = torch.cuda.is_available()
FIRST_LOSS = "[RANK0] Epoch 1 | Iter 0 | Train Loss"


def ddp_fp16(space: Workspace) -> None:
    run = torchrun(space.overrides("snap.pt", trainer_config__use_amp=True,
                                   trainer_config__amp_dtype="float16"))
    check(run, FIRST_LOSS, "Snapshot saved at epoch 1", *(["GradScaler"] if ON_GPU else []))


def ddp_bf16(space: Workspace) -> None:
    run = torchrun(space.overrides("snap.pt", trainer_config__use_amp=True,
                                   trainer_config__amp_dtype="bfloat16"))
    check(run, FIRST_LOSS, "Snapshot saved at epoch 1")


def fsdp(space: Workspace) -> None:
    check(torchrun(space.overrides("snap.pt", trainer_config__distributed_method="fsdp")),
          "; fsdp;", "Snapshot saved at epoch 1")


def fsdp_offload(space: Workspace) -> None:
    run = torchrun(space.overrides("snap.pt", trainer_config__distributed_method="fsdp",
                                   trainer_config__cpu_offload=True))
    check(run, "fsdp with CPU offload", "Snapshot saved at epoch 1")


def hsdp(space: Workspace) -> None:
    run = two_nodes(space.overrides("snap.pt", trainer_config__distributed_method="hsdp"))
    check(run, "2 process(es) on 2 node(s)", "; hsdp;", "Snapshot saved at epoch 1")


def activation_checkpointing(space: Workspace) -> None:
    run = torchrun(space.overrides("snap.pt", trainer_config__activation_checkpointing="full"))
    check(run, FIRST_LOSS, "Snapshot saved at epoch 1")


def async_single(space: Workspace) -> None:
    run = torchrun(space.overrides("snap.pt", trainer_config__async_snapshots=True,
                                   trainer_config__save_every_steps=20))
    check(run, "Snapshot saved at step 20", "Snapshot saved at epoch 1")


def async_sharded_then_one_rank(space: Workspace) -> None:
    """Sharded snapshots written in the background by 2 ranks, the last mid-epoch (a step budget
    ends with one); 1 rank resumes from it."""
    settings = dict(trainer_config__async_snapshots=True, trainer_config__snapshot_format="sharded",
                    trainer_config__save_every_steps=20)
    check(torchrun(space.overrides("snaps", trainer_config__max_steps=50, **settings)),
          "Snapshot saved at step 20", "Snapshot saved at step 50")
    resumed = torchrun(space.overrides("snaps", trainer_config__max_steps=60, **settings), nproc=1)
    check(resumed, "Resuming training from snapshot at Epoch 0 (step 50,", "resumed by 1")


def stop_signal_and_resume(space: Workspace) -> None:
    """SIGTERM to every process mid-run: both ranks stop at one step with a snapshot; a new run resumes."""
    overrides = space.overrides("snap.pt", trainer_config__max_epochs=20, trainer_config__log_every=1)
    stopped = torchrun(overrides, stop_when=lambda output: "Iter 3 |" in output)
    if "Stopping on SIGTERM: snapshot saved at step" not in stopped.output:
        raise AssertionError("no stop with a snapshot:\n" + stopped.output[-3000:])
    resumed = torchrun(space.overrides("snap.pt", trainer_config__max_epochs=1))
    check(resumed, "Resuming training from snapshot at Epoch 0 (step")


SCENARIOS = {
    "ddp-fp16": ddp_fp16,
    "ddp-bf16": ddp_bf16,
    "fsdp": fsdp,
    "fsdp-offload": fsdp_offload,
    "hsdp": hsdp,
    "activation-checkpointing": activation_checkpointing,
    "async-single": async_single,
    "async-sharded-then-one-rank": async_sharded_then_one_rank,
    "stop-signal-and-resume": stop_signal_and_resume,
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenario names")
    default_out = RESULTS / ("gpu/multi_rank_cuda.json" if ON_GPU else "multi_rank_cpu.json")
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args(argv)
    names = args.only.split(",")
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        sys.exit(f"error: --only: unknown scenario(s) {', '.join(unknown)}; "
                 f"choose from {', '.join(SCENARIOS)}")
    device = torch.cuda.get_device_name(0) if ON_GPU else "cpu"
    results = {}
    with tempfile.TemporaryDirectory() as root:
        text = Path(root) / "input.txt"
        text.write_text(synthetic_text(6000))
        for name in names:
            folder = Path(root) / name
            folder.mkdir()
            start = time.perf_counter()
            try:
                SCENARIOS[name](Workspace(folder, text))
                outcome = "passed"
            except AssertionError as failure:
                outcome = f"failed: {failure}"
            seconds = round(time.perf_counter() - start, 1)
            results[name] = {"outcome": outcome.split("\n")[0], "seconds": seconds}
            print(f"{name}: {outcome}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": device, "torch": torch.__version__, "ranks": 2,
                                    "scenarios": results}, indent=2) + "\n")
    print(f"RESULT {json.dumps(results)}")
    sys.exit(0 if all(r["outcome"] == "passed" for r in results.values()) else 1)


if __name__ == "__main__":
    main()
