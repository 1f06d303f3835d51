"""bench/bench_train.py: the figures it promises are there and add up, in one process and under torchrun;
the step split's communication is what gradient sync adds to the backward pass."""
import importlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from helpers import REPO, TORCHRUN
from torch.nn.parallel import DistributedDataParallel as DDP

BENCH = REPO / "bench" / "bench_train.py"
PHASES = {"data", "forward", "backward", "optimizer", "communication"}


def run_bench(tmp_path, text_file, launcher: list[str], *flags: str) -> tuple[dict, str]:
    report = tmp_path / "train.json"
    command = [*launcher, str(BENCH), "--models", "gpt-nano", "--block-size", "32", "--batch-size", "4",
               "--warmup", "1", "--steps", "2", "--split-steps", "2", "--threads", "1", "--workers", "0",
               "--peak-sizes", "128", "--data", str(text_file), "--json", str(report), *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(report.read_text()), result.stdout


def percentages(ms: dict[str, float]) -> dict:
    return {phase: pytest.approx(100 * value / sum(ms.values())) for phase, value in ms.items()}


@pytest.mark.slow
def test_one_process_reports_speed_split_mfu_and_memory(tmp_path, text_file):
    report, stdout = run_bench(tmp_path, text_file, [sys.executable])
    (result,) = report["results"]
    assert result["tokens_per_s"] > 0
    split = result["split"]
    assert set(split["ms"]) == set(split["pct"]) == PHASES
    assert split["pct"] == percentages(split["ms"])
    assert split["ms"]["communication"] == 0  # nothing to reduce in one process
    assert min(split["ms"][phase] for phase in PHASES - {"communication"}) > 0
    assert 0 < result["mfu"]["fp32"] < result["matmul_efficiency"]["fp32"]
    assert 0 < result["matmuls"]["pct_of_step"] < 100
    assert result["peak_memory_mb"] > result["state_mb"] > 0
    assert report["peak"]["fp32"]["gflops_by_size"].keys() == {"128"}
    assert "split: data" in stdout and "Linear matmuls in the step" in stdout


@pytest.mark.slow
def test_under_torchrun_rank_zero_reports_for_the_world(tmp_path, text_file):
    report, stdout = run_bench(tmp_path, text_file,
                               [*TORCHRUN, "--standalone", "--nproc_per_node=2"])
    (result,) = report["results"]
    assert report["environment"]["world_size"] == 2
    assert result["tokens_per_step"] == 2 * 4 * 32
    assert result["split"]["pct"] == percentages(result["split"]["ms"])
    assert stdout.count("summary:") == 1  # rank 1 trains but says nothing


# The step split, in-process: every phase takes a set time on a fake clock, the backward pass
# longer when it reduces gradients, so the figures step_split derives from them are known exactly.
DATA_S, FORWARD_S, OPTIMIZER_S = 0.001, 0.004, 0.002


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class TimedTrainer:
    """What step_split uses of a Trainer. The model is a DDP module (over a world of one): the
    benchmark turns its gradient reduction off through DDP's own no_sync."""

    def __init__(self, clock: FakeClock, world_size: int, synced_s: list, unsynced_s: list):
        self.clock, self.env = clock, SimpleNamespace(world_size=world_size)
        self.model = DDP(nn.Linear(2, 2))
        self.optimizer = SimpleNamespace(zero_grad=lambda set_to_none: None)
        self.backward_s = {True: iter(synced_s), False: iter(unsynced_s)}
        self.synced = []  # whether each backward pass reduced gradients

    def batches(self):
        while True:
            self.clock.now += DATA_S
            yield torch.zeros(1, 2, dtype=torch.long)  # one window: inputs and targets of one token

    def compute_loss(self, inputs, targets):
        self.clock.now += FORWARD_S

    def backward(self, loss):
        self.synced.append(self.model.require_backward_grad_sync)
        self.clock.now += next(self.backward_s[self.synced[-1]])

    def optimizer_step(self):
        self.clock.now += OPTIMIZER_S


@pytest.fixture
def bench_train(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    module = importlib.import_module("bench_train")
    clock = FakeClock()
    monkeypatch.setattr(module, "time", clock)
    return module, clock


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("world_size, synced_s, unsynced_s, backward_ms, communication_ms", [
    (2, [0.030, 0.034, 0.031], [0.012, 0.009, 0.011], 11, 20),  # medians 31 and 11 ms (not means)
    (2, [0.010, 0.010, 0.010], [0.012, 0.012, 0.012], 10, 0),  # noise: sync looks free, not negative
    (1, [0.030, 0.034, 0.031], [0.012, 0.009, 0.011], 31, 0),  # one process: nothing to reduce
], ids=["unhidden-reduction", "noise", "one-process"])
def test_communication_is_what_gradient_sync_adds_to_the_backward_pass(
        bench_train, world_size, synced_s, unsynced_s, backward_ms, communication_ms):
    module, clock = bench_train
    trainer = TimedTrainer(clock, world_size, synced_s, unsynced_s)
    split = module.step_split(trainer, trainer.batches(), torch.device("cpu"), steps=3)
    assert trainer.synced == [True] * 3 + [False] * (3 if world_size > 1 else 0)
    expected = {"data": 1, "forward": 4, "backward": backward_ms, "optimizer": 2,
                "communication": communication_ms}
    assert split["ms"] == {phase: pytest.approx(ms) for phase, ms in expected.items()}
    assert split["pct"] == percentages(expected)
