"""A stop signal honoured in every phase (control.py): wherever it lands, the run ends within a
cluster's grace with the snapshot of its last step written and one line that says so. The long
phases are made long on purpose (tests/workers/fault_injection.py sleeps in them), so that the
signal lands inside them on a loaded machine too and the bounds hold by a wide margin."""
import signal
import sys
import time

import pytest
import torch
from helpers import (
    TORCHRUN,
    WORKER_SCRIPTS,
    hellaswag_items,
    signal_every_process,
    start_until,
    tiny_overrides,
    write_hellaswag,
)

from mingpt.distributed.control import STOP_EXIT_STATUS

pytestmark = pytest.mark.slow

FAULTS = WORKER_SCRIPTS / "fault_injection.py"
GRACE_S = 30
"""What a cluster gives a signalled run before it kills it: Slurm's default KillWait, and torchrun's
own wait for its workers after it is signalled."""


def stopped(cmd: list, wanted: str, env: dict, after_s: float = 1.0) -> tuple[int, str, float]:
    """Start cmd, signal every process SIGTERM after_s seconds after the line holding wanted; its
    exit status, whole output and the seconds from the signal to its end."""
    process, seen = start_until(cmd, wanted, env)
    time.sleep(after_s)
    signal_every_process(process, signal.SIGTERM)
    signalled = time.monotonic()
    rest, _ = process.communicate(timeout=120)
    return process.returncode, "".join(seen) + rest, time.monotonic() - signalled


def test_a_stop_during_a_long_evaluation_on_two_torchrun_ranks_saves_the_last_step(text_file, tmp_path):
    """The issue's case: every process signalled inside an evaluation of two torchrun ranks that
    would take minutes (5 s a batch). The evaluation is abandoned at the same batch on both ranks,
    step 20 is saved, the line says so, and torchrun never has to kill a worker."""
    snapshot = tmp_path / "snap.pt"
    overrides = tiny_overrides(text_file, snapshot, trainer_config__max_steps=1000,
                               trainer_config__eval_every_steps=20, trainer_config__data_loader_workers=1)
    command = [*TORCHRUN, "--standalone", "--nproc_per_node=2", FAULTS, *overrides]
    status, output, took = stopped(command, "| Eval Loss", {"SLOW": "eval:5:0", "SLOW_RANK": "all"})
    assert "Stopping on SIGTERM: snapshot saved at step 20 (the evaluation under way was abandoned)" in output
    assert output.count("Stopping on") == 1, output
    assert torch.load(snapshot, weights_only=True)["step"] == 20
    assert "forcefully exiting" not in output and "Traceback (most recent call last)" not in output.split(
        "Stopping on")[0], output
    assert took < GRACE_S, took  # a batch of 5 s, the save, the processes' end: inside the grace (the
    # evaluation left to run would have taken 50 s; bench/bench_stops.py measures the bound itself)
    assert status == 1, output  # torchrun's own status once signalled, whatever its workers did


def test_a_stop_during_hellaswag_scoring_saves_the_last_step(text_file, tmp_path):
    snapshot = tmp_path / "snap.pt"
    items = write_hellaswag(tmp_path / "hellaswag_val.jsonl", hellaswag_items(200))
    overrides = tiny_overrides(text_file, snapshot, trainer_config__max_steps=1000, trainer_config__log_every=1,
                               trainer_config__hellaswag_path=items, trainer_config__hellaswag_every_steps=10)
    command = [sys.executable, FAULTS, *overrides]
    status, output, took = stopped(command, "| Iter 9 |", {"SLOW": "eval:3:0", "SLOW_RANK": "all"})
    assert status == STOP_EXIT_STATUS, output
    assert ("Stopping on SIGTERM: snapshot saved at step 10 (the HellaSwag scoring under way was abandoned)"
            in output), output
    assert torch.load(snapshot, weights_only=True)["step"] == 10
    assert took < GRACE_S, took


def test_a_stop_in_a_step_begun_since_the_last_snapshot_ends_at_once(text_file, tmp_path):
    """Step 6 takes a minute (as a compilation or a long first step would) and step 5 is saved: the
    stop loses nothing by not waiting for it, so it does not wait."""
    snapshot = tmp_path / "snap.pt"
    overrides = tiny_overrides(text_file, snapshot, trainer_config__max_steps=1000,
                               trainer_config__save_every_steps=5)
    command = [sys.executable, FAULTS, *overrides]
    status, output, took = stopped(command, "Snapshot saved at step 5", {"SLOW": "compute:60:6", "SLOW_RANK": "all"})
    assert status == STOP_EXIT_STATUS, output
    assert output.rstrip().endswith("Stopping on SIGTERM: snapshot saved at step 5"), output
    assert torch.load(snapshot, weights_only=True)["step"] == 5
    assert took < 10, took


@pytest.mark.parametrize("wanted, env", [
    ("Data has", {}),  # the start-up: building the model, reading a snapshot
    ("Snapshots:", {"SLOW": "data:60:1", "SLOW_RANK": "all"}),  # the first step's data, a minute late
], ids=["start-up", "first-data-wait"])
def test_a_stop_before_the_first_step_ends_at_once_with_nothing_to_save(text_file, tmp_path, wanted, env):
    snapshot = tmp_path / "snap.pt"
    command = [sys.executable, FAULTS, *tiny_overrides(text_file, snapshot)]
    status, output, took = stopped(command, wanted, env, after_s=0.2)
    assert status == STOP_EXIT_STATUS, output
    assert output.rstrip().endswith("Stopping on SIGTERM before the first step: nothing to save"), output
    assert "Traceback" not in output, output
    assert sorted(path.name for path in tmp_path.iterdir()) in ([], ["snap.metrics.jsonl"])  # no lease left
    assert took < 10, took
