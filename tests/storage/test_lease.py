"""lease.py: one run per snapshot path. Holders are real processes (a live one, an ended one) or
leases another host would have written; two real training runs meet on one path at the end."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from helpers import (
    MAIN,
    TORCHRUN,
    assert_ok,
    kill_tree,
    one_error_line,
    run_main,
    sha256,
    start_until,
    tiny_overrides,
)

from mingpt.common.errors import SnapshotError
from mingpt.reporting.metrics import read_metrics
from mingpt.storage import lease
from mingpt.storage.lease import Holder, SnapshotLease, lease_path


def write_lease(url, pid: int, host: str = "", refreshed_ago: float = 0.0, **fields) -> None:
    """A lease as another run would have written it (by default a process of this host)."""
    import socket

    started = psutil.Process(pid).create_time() if psutil.pid_exists(pid) else time.time() - 60
    holder = Holder(token="theirs", host=host or socket.gethostname(), pid=pid, started=started,
                    refreshed=time.time() - refreshed_ago, **fields)
    with open(f"{url}.tmp", "w") as f:  # replaced whole, as a run writes it: a refresher never reads it torn
        json.dump(holder.__dict__, f)
    os.replace(f"{url}.tmp", url)


@pytest.fixture
def other_process():
    """A live process that is not this one: the holder of another run's lease."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


@pytest.fixture(autouse=True)
def no_settling(monkeypatch):
    monkeypatch.setattr(lease, "SETTLE_S", 0.05)


def test_the_lease_lies_beside_the_snapshots():
    assert lease_path("gpt_snapshot.pt") == "gpt_snapshot.lease.json"
    assert lease_path("s3://bucket/run/") == "s3://bucket/run/lease.json"


def test_a_second_run_is_refused_naming_the_first(tmp_path, other_process):
    snapshot = str(tmp_path / "snap.pt")
    write_lease(lease_path(snapshot), other_process.pid)
    with pytest.raises(SnapshotError) as refused:
        SnapshotLease(snapshot).acquire()
    assert f"pid {other_process.pid}" in str(refused.value) and "another run" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert json.loads(open(lease_path(snapshot)).read())["token"] == "theirs"  # left as it was


def test_a_lease_whose_process_has_ended_is_taken_over_with_a_line(tmp_path, caplog):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    snapshot = str(tmp_path / "snap.pt")
    write_lease(lease_path(snapshot), ended.pid)
    taken = SnapshotLease(snapshot)
    with caplog.at_level("INFO", logger="mingpt"), taken:
        assert json.loads(open(lease_path(snapshot)).read())["token"] == taken.me.token
    assert "Taking over the lease" in caplog.text and "its process has ended" in caplog.text
    assert not (tmp_path / "snap.lease.json").exists()  # released on the way out


def test_another_host_s_lease_is_refused_until_it_goes_stale(tmp_path):
    snapshot = str(tmp_path / "snap.pt")
    write_lease(lease_path(snapshot), 12345, host="elsewhere", refreshed_ago=5)
    with pytest.raises(SnapshotError, match="host elsewhere, pid 12345"):
        SnapshotLease(snapshot).acquire()
    write_lease(lease_path(snapshot), 12345, host="elsewhere", refreshed_ago=lease.STALE_AFTER_S + 1)
    with SnapshotLease(snapshot):
        pass


def test_a_requeued_slurm_job_takes_over_its_own_lease_at_once(tmp_path, monkeypatch, caplog):
    snapshot = str(tmp_path / "snap.pt")
    write_lease(lease_path(snapshot), 12345, host="node-7", job="4242")  # fresh: the first attempt
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with caplog.at_level("INFO", logger="mingpt"), SnapshotLease(snapshot):
        pass
    assert "Taking over" not in caplog.text
    monkeypatch.setenv("SLURM_JOB_ID", "4243")  # another job: refused
    write_lease(lease_path(snapshot), 12345, host="node-7", job="4242")
    with pytest.raises(SnapshotError, match="Slurm job 4242"):
        SnapshotLease(snapshot).acquire()


def test_a_run_whose_lease_was_taken_over_learns_it_and_does_not_remove_it(tmp_path, monkeypatch,
                                                                          other_process):
    monkeypatch.setattr(lease, "REFRESH_S", 0.05)
    snapshot = str(tmp_path / "snap.pt")
    held = SnapshotLease(snapshot)
    held.acquire()
    write_lease(lease_path(snapshot), other_process.pid)  # another run thought this one gone
    deadline = time.monotonic() + 5
    while held.lost() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"pid {other_process.pid}" in held.lost()
    held.release()
    assert json.loads(open(lease_path(snapshot)).read())["token"] == "theirs"


def holder_of(snapshot: str) -> dict:
    return json.loads(open(lease_path(snapshot)).read())


def test_the_lease_is_refreshed_again_and_again(tmp_path, monkeypatch):
    """A refresher that stopped after its first refresh would leave a live run's lease to go stale,
    to be taken over by the next run on the path while this one trains on."""
    monkeypatch.setattr(lease, "REFRESH_S", 0.05)
    snapshot = str(tmp_path / "snap.pt")
    refreshes = set()
    with SnapshotLease(snapshot):
        deadline = time.monotonic() + 10
        while len(refreshes) < 5:
            assert time.monotonic() < deadline, f"refreshed {len(refreshes) - 1} time(s) in 10 s, every 0.05 s asked"
            refreshes.add(holder_of(snapshot)["refreshed"])
            time.sleep(0.02)


def test_a_run_whose_lease_another_run_took_over_saves_no_more(tmp_path, monkeypatch, world_of_one, other_process):
    """Another run took the lease over (it thought this one gone): within a refresh this run knows it
    (failed(), which the Trainer asks at every step, and every rank then stops at the same step), its
    next save writes nothing and raises the one line, and the other run's lease is left as it is."""
    import torch

    from mingpt.model import GPT, GPTConfig
    from mingpt.optimizer import OptimizerConfig, create_optimizer
    from mingpt.storage.checkpointer import Checkpointer, SnapshotPolicy, holding_the_path
    from mingpt.storage.snapshot import Progress, read_snapshot

    monkeypatch.setattr(lease, "REFRESH_S", 0.05)
    snapshot = str(tmp_path / "snap.pt")
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=2, block_size=4))
    training = model, create_optimizer(model, OptimizerConfig()), torch.amp.GradScaler("cpu", enabled=False)
    policy = SnapshotPolicy(path=snapshot)
    with holding_the_path(policy, world_of_one) as held:  # as main.py takes it
        saver = Checkpointer(policy, world_of_one, vocab=list("ab"), lease=held)
        saver.save("step 10", Progress(step=10, epoch_step=10, epoch_samples=40), *training)
        time.sleep(0.2)
        assert not saver.failed()  # its own refreshes are no takeover
        deadline = time.monotonic() + 10
        while not saver.failed():
            assert time.monotonic() < deadline, "the run never learnt that its lease was taken over"
            if holder_of(snapshot)["token"] != "theirs":
                # A refresh that read the lease just before the takeover wrote over it: the other run's
                # settle check would see that and try again, as this does (CI's loaded machine did).
                write_lease(lease_path(snapshot), other_process.pid)
            time.sleep(0.02)
        with pytest.raises(SnapshotError) as stopped:
            saver.save("step 20", Progress(step=20, epoch_step=20, epoch_samples=80), *training)
    assert str(stopped.value) == (
        f"trainer_config.snapshot_path: another run (host {socket.gethostname()}, pid {other_process.pid}) took "
        f"over the lease {lease_path(snapshot)} while this run could not refresh it; this run stops without "
        "writing over that run's snapshots")
    assert read_snapshot(snapshot).step == 10
    assert holder_of(snapshot)["token"] == "theirs"


def test_a_torn_lease_is_taken_over(tmp_path):
    snapshot = str(tmp_path / "snap.pt")
    (tmp_path / "snap.lease.json").write_text('{"token": "theirs", "ho')
    with SnapshotLease(snapshot):
        pass


def test_a_lease_on_s3_refuses_a_second_run(s3, monkeypatch, other_process):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    snapshot = f"s3://{s3.bucket}/leased/snap.pt"
    with SnapshotLease(snapshot) as first:
        second = SnapshotLease(snapshot)
        second.me = Holder(**{**first.me.__dict__, "token": "second", "pid": other_process.pid,
                              "started": psutil.Process(other_process.pid).create_time()})
        with pytest.raises(SnapshotError, match=f"pid {first.me.pid}"):
            second.acquire()
    from mingpt.common import files

    assert not files.exists(lease_path(snapshot))


def test_the_refresher_outlives_writes_the_store_refuses(s3, monkeypatch):
    """The store refuses the lease's writes for a while (its connections reset; reads still pass):
    every refresh then fails, after s3fs's retries. A refresher that ended at its first failed write
    would let the lease go stale while the run lives; once the writes pass again, it refreshes."""
    from urllib.parse import urlsplit

    import fsspec
    from flaky_link import FlakyLink

    upstream = urlsplit(s3.endpoint)
    link = FlakyLink((upstream.hostname, upstream.port))
    for key, value in s3.env(AWS_ENDPOINT_URL=link.endpoint).items():
        monkeypatch.setenv(key, value)
    fsspec.get_filesystem_class("s3").clear_instance_cache()
    monkeypatch.setattr(lease, "REFRESH_S", 0.2)
    snapshot = f"s3://{s3.bucket}/refused-writes/snap.pt"

    def refreshed() -> float:
        return json.loads(fsspec.filesystem("s3", skip_instance_cache=True).cat_file(lease_path(snapshot)))["refreshed"]

    try:
        with SnapshotLease(snapshot) as held:
            link.refuse(lambda request: re.match(rb"PUT \S*lease\.json", request) is not None)
            deadline = time.monotonic() + 60
            while link.refusals < 2 * 6:  # two refreshes' writes, with s3fs's five retries each
                assert time.monotonic() < deadline, f"{link.refusals} write(s) refused in 60 s"
                time.sleep(0.1)
            last = refreshed()
            time.sleep(1)
            assert refreshed() == last  # the writes did fail
            link.refuse(None)
            allowed_at = time.time()
            deadline = time.monotonic() + 30
            while refreshed() <= allowed_at:
                assert time.monotonic() < deadline, "the refresher never refreshed again after failed writes"
                time.sleep(0.1)
            assert held.lost() is None
    finally:
        link.heal()
        fsspec.get_filesystem_class("s3").clear_instance_cache()  # made through the link


@pytest.mark.slow
def test_a_real_run_whose_lease_is_taken_over_stops_before_its_next_snapshot(text_file, tmp_path, other_process):
    """A run trains, its lease refreshed every 0.1 s; another run takes the lease over (it took this
    one for gone) after the snapshot of step 200. Within a refresh and a step or two the run stops
    (long before step 400, its next snapshot, where a run that only checked at its saves would stop):
    one line naming the other run, exit status 1, its snapshot as it was, and the other run's lease
    left in place."""
    snapshot = tmp_path / "snap.pt"
    overrides = tiny_overrides(text_file, snapshot, trainer_config__max_epochs=40, trainer_config__log_every=1,
                               trainer_config__save_every_steps=200, trainer_config__save_every=100)
    run, seen = start_until([sys.executable, MAIN, *overrides], "Snapshot saved at step 200",
                            {"MINGPT_LEASE_REFRESH_S": "0.1"})
    try:
        saved = sha256(snapshot)
        write_lease(str(tmp_path / "snap.lease.json"), other_process.pid)
        try:
            rest, _ = run.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            rest = ""
    finally:
        kill_tree(run)
    output = "".join(seen) + rest
    trained_after = len(re.findall(r"\| Train Loss", rest))  # one line a step
    assert trained_after < 100, f"trained {trained_after} steps on after its lease was taken over at step 200"
    assert run.returncode == 1, output[-2000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: trainer_config.snapshot_path: another run (host {socket.gethostname()}, pid "
                      f"{other_process.pid}) took over the lease {tmp_path / 'snap.lease.json'} while this run could "
                      "not refresh it; this run stops without writing over that run's snapshots"], output[-2000:]
    assert sha256(snapshot) == saved
    assert json.loads((tmp_path / "snap.lease.json").read_text())["token"] == "theirs"


@pytest.mark.slow
def test_two_real_runs_on_one_path(text_file, tmp_path):
    """A 2-rank run holds its path: a second run started on it is refused in one line and changes
    nothing; the first trains on undisturbed. Killed (every process, as by SIGKILL), it leaves its
    lease behind, and the next run on this host takes it over with a line and resumes."""
    snapshot = tmp_path / "snap.pt"
    overrides = tiny_overrides(text_file, snapshot, trainer_config__max_epochs=40,
                               trainer_config__save_every_steps=20)
    first, _ = start_until([*TORCHRUN, "--standalone", "--nproc_per_node=2", MAIN, *overrides],
                           "Snapshot saved at step 20")
    try:
        metrics_before = (tmp_path / "snap.metrics.jsonl").read_bytes()
        second = run_main(overrides)
        line = one_error_line(second)
        holder = json.loads((tmp_path / "snap.lease.json").read_text())
        assert "another run is using these snapshots" in line and f"pid {holder['pid']}" in line, line
        assert (tmp_path / "snap.metrics.jsonl").read_bytes().startswith(metrics_before)  # not rewritten
        assert first.poll() is None  # undisturbed
        for member in [psutil.Process(first.pid), *psutil.Process(first.pid).children(recursive=True)]:
            member.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        kill_tree(first)
    third = run_main(tiny_overrides(text_file, snapshot, trainer_config__max_steps=25))
    assert_ok(third)
    assert "Taking over the lease" in third.stdout and "its process has ended" in third.stdout
    assert "Resuming training from snapshot" in third.stdout
    assert not (tmp_path / "snap.lease.json").exists()
    steps = [line["step"] for line in read_metrics(str(tmp_path / "snap.metrics.jsonl"), "train")]
    assert steps == sorted(set(steps))  # one run's lines, never two interleaved
