import io
import os
import signal
import socket
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import MINGPT, run, start_until, tiny_overrides
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from mingpt import launch
from mingpt.common import errors
from mingpt.distributed import control, fault_tolerance


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
def test_launch_says_a_config_mistake_once_and_does_not_start_the_workers_again(text_file, tmp_path):
    """A config mistake, the same on every rank before any process group exists: local rank 0 alone
    says it (launch.py runs torchrun's own launcher: this is also `torchrun` with a bad key), and every
    failed rank having said its error (errors.record_user_error), launch.py adds nothing and starts
    nothing again, whatever --max-restarts allows."""
    result = run([sys.executable, MINGPT / "launch.py", "--nproc", "2", "--max-restarts", "2",
                  *tiny_overrides(text_file, tmp_path / "snap.pt"), "trainer_config.batch_size=0"])
    assert result.returncode == 1
    assert result.stderr.count("error: trainer_config.batch_size: must be positive") == 1
    assert result.stderr.count("error:") == 1 and "again" not in result.stderr, result.stderr


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


@pytest.mark.parametrize("statuses, ending, errors_said, status, said", [
    ([0, 0], "", set(), 0, ""),
    ([1, 0], "", set(), 0, "launch.py: replica group 0 (exit 1) failed; the others finished the run\n"),
    ([1, 0], "", {0}, 0, "launch.py: replica group 0 failed; the others finished the run\n"),  # its error said
    ([75, 75], "SIGTERM", set(), 75, "launch.py: stopped on SIGTERM; every replica group stopped with the "
                                     "snapshot written\n"),
    ([130, 75], "SIGINT", set(), 130, "launch.py: stopped on SIGINT; every replica group stopped with the "
                                      "snapshot written\n"),  # Ctrl-C, one group's workers taking a SIGTERM
    ([75, 0], "SIGTERM", set(), 0, ""),  # one group finished the run as the other stopped
    ([75, 1], "", set(), 75, "launch.py: stopped on a signal; replica group 1 (exit 1) failed, the others stopped "
                             "with the snapshot written\n"),
    ([1, 1], "", {0}, 1, "error: every replica group failed (replica group 0, replica group 1 (exit 1)); see the "
                         "output above\n"),
    ([1, 1], "", {0, 1}, 1, ""),  # each said its error (a user's, not started again): nothing to add
    ([75, 75], "lighthouse", set(), 1, ""),  # said when the lighthouse ended
])
def test_a_fault_tolerant_run_exits_as_its_groups_ended(statuses, ending, errors_said, status, said, capsys):
    assert launch.replica_groups_status(statuses, ending, frozenset(errors_said)) == status
    assert capsys.readouterr().err == said


class Workers:
    """torch's elastic launcher as launch_workers sees it: each start fails as `fails` says (a rank
    killed by SIGKILL, or one that said a user's error and recorded it, as errors.command does)."""

    def __init__(self, fails: str):
        self.fails, self.starts, self.restart_counts = fails, 0, []

    def __call__(self, args) -> None:
        self.starts += 1
        self.restart_counts.append(os.environ[fault_tolerance.RESTART_ENV])
        if self.fails == "user error":
            errors.record_user_error("trainer_config.batch_size: must be positive, got 0")
            exitcode = 1
        elif self.fails == "clean stop":
            control.record_clean_stop(75)
            exitcode = 75
        else:
            exitcode = -signal.SIGKILL
        failure = ProcessFailure(local_rank=0, pid=123, exitcode=exitcode, error_file="/nonexistent")
        raise ChildFailedError("main.py", {0: failure})


def test_workers_that_said_a_user_error_are_not_started_again(monkeypatch, capsys):
    """A config or data mistake is no crash to restart from: every failed rank said it already (one line),
    and would say it again at each restart."""
    workers = Workers("user error")
    monkeypatch.setattr(launch, "run", workers)
    assert launch.launch_workers(1, max_restarts=3, overrides=[]) == 1
    assert workers.starts == 1 and capsys.readouterr().err == ""


def test_crashed_workers_are_started_again_up_to_max_restarts(monkeypatch, capsys):
    workers = Workers("crash")
    monkeypatch.setattr(launch, "run", workers)
    assert launch.launch_workers(1, max_restarts=2, overrides=[]) == 1
    assert workers.starts == 3 and workers.restart_counts == ["0", "1", "2"]  # the workers know a restart
    assert capsys.readouterr().err.splitlines() == [
        "launch.py: training failed on rank 0 (killed by SIGKILL): starting the workers again (1 of 2)",
        "launch.py: training failed on rank 0 (killed by SIGKILL): starting the workers again (2 of 2)",
        "error: training failed on rank 0 (killed by SIGKILL) after 2 restart(s); see the output above"]


def test_without_restarts_a_crash_ends_the_run_in_one_line(monkeypatch, capsys):
    workers = Workers("crash")
    monkeypatch.setattr(launch, "run", workers)
    assert launch.launch_workers(2, max_restarts=0, overrides=[]) == 1
    assert workers.starts == 1
    assert capsys.readouterr().err == "error: training failed on rank 0 (killed by SIGKILL); see the output above\n"


def test_workers_that_stopped_cleanly_are_not_started_again(monkeypatch, capsys):
    workers = Workers("clean stop")  # a signal that reached the workers but not the launcher
    monkeypatch.setattr(launch, "run", workers)
    assert launch.launch_workers(1, max_restarts=3, overrides=[]) == 75
    assert workers.starts == 1
    assert capsys.readouterr().err == "launch.py: stopped on a signal; every worker saved its snapshot first\n"


def test_a_replica_group_is_not_started_again_once_its_lighthouse_is_gone(monkeypatch, capsys):
    """Its workers would wait for a lighthouse that is not there, and fail again."""
    workers = Workers("crash")
    monkeypatch.setattr(launch, "run", workers)
    monkeypatch.setattr(launch, "quiet_torch_launcher", lambda: None)  # torch's logging left as the suite has it
    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{probe.getsockname()[1]}"
    assert launch.launch_workers(1, max_restarts=3, overrides=[], group=launch.GroupOfRun(1, gone)) == 1
    assert workers.starts == 1
    assert capsys.readouterr().err == (f"error: lost rank 0 (killed by SIGKILL), and is not started again: the "
                                       f"lighthouse at {gone} does not answer; see the output above\n")


def test_a_config_mistake_under_replica_groups_is_said_once_before_anything_starts(monkeypatch, capsys):
    """Not once per group and per restart (issue 54: 20 lines, the error eight times, 17 s): the launcher
    checks the config as main.py will, before the lighthouse and the groups start."""
    monkeypatch.setattr(launch, "start_lighthouse", lambda groups: pytest.fail("the lighthouse was started"))
    with pytest.raises(SystemExit) as stop:
        launch.main(["--replica-groups", "2", "--config-name", "laptop", "trainer_config.batch_size=0"])
    assert stop.value.code == 1
    assert capsys.readouterr().err == "error: trainer_config.batch_size: must be positive, got 0\n"
    with pytest.raises(SystemExit):  # the mode's own refusals too, with the launcher's settings
        launch.main(["--replica-groups", "2", "trainer_config.distributed_method=fsdp"])
    assert capsys.readouterr().err.startswith("error: trainer_config.distributed_method: fsdp shards every parameter")


def test_the_groups_lines_are_said_once_each_prefixed_with_its_group(capsysbinary):
    """A line each group says (the data's, a warning) is said once; a group started again does not say
    its start-up's lines again; its own lines, and every line of one group, are said as they come."""
    chorus = launch.Chorus()
    for group, lines in enumerate([
        [b"Data has 20000 characters, 58 unique.\n", b"[RANK0] Epoch 1 | Iter 0 | Train Loss 4.06880\n",
         b"warning: data_config.truncate=0.05 keeps the first 10 of the text's 200 characters\n",
         b"warning: data_config.truncate=0.05 keeps the first 10 of the text's 200 characters\n"],
        [b"Data has 20000 characters, 58 unique.\n",
         b"warning: data_config.truncate=0.05 keeps the first 10 of the text's 200 characters\n",
         b"lost rank 0 (killed by SIGKILL): starting the group again (1 of 3); it heals from a live replica group\n",
         b"Data has 20000 characters, 58 unique.\n", b"Healed from replica group 0 at step 7\n",
         b"error: cannot reach the lighthouse at http://127.0.0.1:1 (step 9); start it again\n"],
    ]):
        process = SimpleNamespace(stdout=io.BytesIO(b"".join(lines)), stderr=io.BytesIO(b""))
        chorus.follow(process, group)
        chorus.finish()
    assert capsysbinary.readouterr().out.decode().splitlines() == [
        "[replica 0] Data has 20000 characters, 58 unique.",
        "[replica 0] [RANK0] Epoch 1 | Iter 0 | Train Loss 4.06880",
        "[replica 0] warning: data_config.truncate=0.05 keeps the first 10 of the text's 200 characters",
        "[replica 0] warning: data_config.truncate=0.05 keeps the first 10 of the text's 200 characters",
        "[replica 1] lost rank 0 (killed by SIGKILL): starting the group again (1 of 3); it heals from a live "
        "replica group",
        "[replica 1] Healed from replica group 0 at step 7",
        "[replica 1] error: cannot reach the lighthouse at http://127.0.0.1:1 (step 9); start it again"]
    assert chorus.errors_said == {1}


def test_ranks_stopped_by_the_launcher_after_a_user_error_are_no_crash():
    def failure(exitcode: int) -> ProcessFailure:
        return ProcessFailure(local_rank=0, pid=123, exitcode=exitcode, error_file="/nonexistent")

    said_by_0 = {0: failure(1), 1: failure(-signal.SIGTERM)}  # rank 1 waited for rank 0 to say it
    assert launch.crashes(said_by_0, said={0}) == {}
    assert launch.crashes(said_by_0, said=set()).keys() == {0, 1}  # no error said: a crash, restarted
    killed = {0: failure(1), 1: failure(-signal.SIGKILL)}
    assert launch.crashes(killed, said={0}).keys() == {1}  # a rank killed from outside is a crash
