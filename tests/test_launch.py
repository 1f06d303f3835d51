import signal
import sys

import pytest
import torch
from helpers import MINGPT, run, start_until, tiny_overrides

from mingpt import launch


@pytest.mark.parametrize("gpus, flags, workers", [
    (0, [], 2),  # no GPU: two CPU workers
    (4, [], 4),  # one worker per GPU
    (0, ["--nproc", "3"], 3),
    (4, ["--nproc", "1"], 1),
])
def test_workers_started_are_one_per_gpu_or_two_without_gpus(monkeypatch, gpus, flags, workers):
    launched = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(launch, "run", launched.append)  # torch's elastic launcher, not started here
    assert launch.main([*flags, "trainer_config.max_epochs=1"]) == 0
    (args,) = launched
    assert int(args.nproc_per_node) == workers and args.standalone
    assert (args.training_script, args.training_script_args) == (str(MINGPT / "main.py"),
                                                                 ["trainer_config.max_epochs=1"])


@pytest.mark.slow
def test_launch_reports_failed_workers(text_file, tmp_path):
    """A config mistake, the same on every rank before any process group exists: local rank 0 alone
    says it (launch.py runs torchrun's own launcher: this is also `torchrun` with a bad key), and
    launch.py names the failed job."""
    result = run([sys.executable, MINGPT / "launch.py", "--nproc", "2",
                  *tiny_overrides(text_file, tmp_path / "snap.pt"), "trainer_config.batch_size=0"])
    assert result.returncode == 1
    assert result.stderr.count("error: trainer_config.batch_size: must be positive") == 1
    assert "error: training failed on rank" in result.stderr


def test_bad_nproc_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        launch.main(["--nproc", "0"])
    assert stop.value.code == 1
    assert capsys.readouterr().err == "error: --nproc must be at least 1 (see --help)\n"


@pytest.mark.slow
def test_ranks_that_die_of_the_stop_signal_make_launch_say_no_snapshot_was_written(text_file, tmp_path):
    """Ranks that do not handle SIGTERM (stop_signals empty) die of it: no 75, and no false 'saved'."""
    snapshot = tmp_path / "snap.pt"
    overrides = tiny_overrides(text_file, snapshot, trainer_config__stop_signals="[]",
                               trainer_config__data_loader_workers=1)
    command = [sys.executable, MINGPT / "launch.py", "--nproc", "2", *overrides]
    process, _ = start_until(command, "| Iter 40 |")
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 1, output
    assert ("error: stopped on SIGTERM, but rank 0, rank 1 did not stop cleanly: no snapshot was written at "
            "the stop (the last complete one is kept)") in output
    assert "saved its snapshot" not in output and not snapshot.exists()


@pytest.mark.parametrize("statuses, status, said", [
    ([0, 0], 0, ""),
    ([1, 0], 0, "launch.py: replica group 0 (exit 1) failed after its restarts; the others finished the run\n"),
    ([75, 75], 75, ""),  # a stop signal: every group saved and stopped
    ([130, 75], 130, ""),  # Ctrl-C, one group's workers taking a forwarded SIGTERM
    ([75, 0], 0, ""),  # one group finished the run as the other stopped
    ([75, 1], 75, "launch.py: replica group 1 (exit 1) failed after its restarts; the others stopped with a snapshot\n"),
    ([1, 1], 1, "error: every replica group failed (replica group 0 (exit 1), replica group 1 (exit 1)); "
                "see the output above\n"),
])
def test_a_fault_tolerant_run_exits_as_its_groups_ended(statuses, status, said, capsys):
    assert launch.replica_groups_status(statuses) == status
    assert capsys.readouterr().err == said
