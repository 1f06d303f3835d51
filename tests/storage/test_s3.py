"""Snapshots on S3: a real S3 server (moto) on loopback, reached through s3fs and the standard
AWS environment variables, exactly as a user would point the trainer at a bucket."""
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import fsspec
import pytest
import torch
from helpers import (
    MAIN,
    TORCHRUN,
    assert_ok,
    kill_tree,
    llmc_shards_of,
    one_error_line,
    run_main,
    run_main_in_process,
    start_until,
    the_ranks_one_error_line,
    tiny_overrides,
)

from mingpt.common import files
from mingpt.reporting.metrics import local_copy_of, read_metrics

pytestmark = pytest.mark.slow

PART = 5 * 2**20
"""s3fs's smallest write block size (S3's smallest multipart part); s3fs's default is 50 MiB."""

SAVE_PAST_ONE_PART = """
import signal, sys, time, torch
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C's own, whatever the parent ignores
from mingpt.storage import snapshot as s
def one_part_then_hang(obj, f):
    f.write(b"PK" + bytes({part}))  # past the block size: s3fs uploads a part before returning
    print("part uploaded", flush=True)
    time.sleep(600)
torch.save = one_part_then_hang
s.write_snapshot(s.Snapshot(step=2), {path!r})
"""


@pytest.fixture
def s3_fs(s3, monkeypatch):
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return fsspec.filesystem("s3", skip_instance_cache=True)


def load_object(fs, key):
    return torch.load(io.BytesIO(fs.cat_file(key)), weights_only=True)


def folder_names(fs, folder):
    return sorted(path.rsplit("/", 1)[-1] for path in fs.ls(folder))


def test_one_process_saves_to_and_resumes_from_s3(text_file, s3, s3_fs, capsys, one_torch_thread):
    """main.run() in this process, its environment the AWS variables (s3_fs sets them); the 2-rank
    test below starts real processes. The metrics file, flushed at every step, is uploaded only when
    a snapshot is taken and when the run ends (an object store cannot append: each flush would
    rewrite it whole)."""
    url = f"s3://{s3.bucket}/single/snap.pt"
    assert_ok(run_main_in_process(tiny_overrides(text_file, url, trainer_config__log_every=1), capsys))
    assert load_object(s3_fs, url)["finished_epoch"] == 1
    metrics_url = f"s3://{s3.bucket}/single/snap.metrics.jsonl"
    lines = read_metrics(metrics_url)
    assert len(lines) == 169 + 1  # every step's line and the eval's: 5,385 samples in batches of 32
    assert files.read_bytes(local_copy_of(metrics_url)) == files.read_bytes(metrics_url)
    uploads = s3.requests("PUT", "snap.metrics.jsonl")  # each upload: a temporary object and its copy
    assert uploads == 2 * 3, "uploads at the start, at the epoch's snapshot and at the end"
    second = run_main_in_process(tiny_overrides(text_file, url, trainer_config__max_epochs=2), capsys)
    assert_ok(second)
    assert "Resuming training from snapshot at Epoch 1" in second.stdout
    assert load_object(s3_fs, url)["finished_epoch"] == 2
    steps = [line["step"] for line in read_metrics(metrics_url, "train")]
    assert steps == list(range(1, 2 * 169 + 1))  # the resumed run's lines follow the first run's


def test_two_processes_keep_the_newest_step_snapshots_in_an_s3_folder(text_file, s3, s3_fs, capsys, tmp_path,
                                                                      one_torch_thread, monkeypatch):
    """Two real processes write the folder; a one-process run (main.run() here) resumes from it and
    prunes what the first run left. They train on llm.c shards in the same bucket (the text's 6,000
    ids, as many as its characters), which the two processes fetch into the machine's one cache."""
    llmc_shards_of(text_file, tmp_path / "shards", tmp_path / "tokenizer.json", shards=3, ids_per_shard=2000)
    s3_fs.put(f"{tmp_path / 'shards'}/", f"{s3.bucket}/shards/", recursive=True)
    cache = tmp_path / "cache"
    monkeypatch.setenv("MINGPT_CACHE_DIR", str(cache))
    folder = f"s3://{s3.bucket}/folder/"
    overrides = tiny_overrides(f"s3://{s3.bucket}/shards/", folder, trainer_config__save_every_steps=20,
                               trainer_config__keep_last=2,
                               data_config__tokenizer=tmp_path / "tokenizer.json")
    first = run_main(overrides, nproc=2, env={**s3.env(), "MINGPT_CACHE_DIR": str(cache)})
    assert_ok(first)
    assert "Data: 3 llm.c shards" in first.stdout, first.stdout
    copies = sorted(path.stat().st_size for path in (cache / "shards").glob("*.bin"))
    assert copies == [1024 + 2 * 2000] * 3, copies  # each shard once, whole, nothing half-written
    # 85 steps: snapshots at steps 20, 40, 60, 80 and 85 (the epoch); the newest two are kept.
    assert folder_names(s3_fs, f"{s3.bucket}/folder") == ["metrics.jsonl", "snapshot_000000080.pt",
                                                          "snapshot_000000085.pt"]
    resumed = run_main_in_process([*overrides, "trainer_config.max_epochs=2", "trainer_config.max_steps=125"],
                                  capsys)
    assert_ok(resumed)
    assert "Resuming training from snapshot at Epoch 1" in resumed.stdout
    s3_fs.invalidate_cache()  # the listing above is cached
    # One rank, 40 steps more: snapshots at steps 100, 120 and 125 (the last).
    assert folder_names(s3_fs, f"{s3.bucket}/folder") == ["metrics.jsonl", "snapshot_000000120.pt",
                                                          "snapshot_000000125.pt"]
    assert load_object(s3_fs, f"{s3.bucket}/folder/snapshot_000000125.pt")["step"] == 125


def bytes_in_flight(fs, bucket: str, prefix: str) -> list[int]:
    """Bytes received so far by each unfinished multipart upload under prefix."""
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    return [sum(part["Size"] for part in fs.call_s3("list_parts", Bucket=bucket, Key=upload["Key"],
                                                    UploadId=upload["UploadId"]).get("Parts", []))
            for upload in uploads]


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGINT], ids=["killed", "interrupted"])
def test_an_upload_stopped_half_way_keeps_the_previous_snapshot(s3, s3_fs, stop):
    """A save is stopped once its first part is on the server.

    SIGKILL abandons the upload: S3 shows an object only once its upload completes, so this case
    guards the old snapshot against being removed early. SIGINT (Ctrl-C) raises KeyboardInterrupt,
    and leaving the `with` block closes the file, which completes the upload with what was written
    so far: only the temporary name keeps that partial object off the snapshot's key."""
    from mingpt.storage.snapshot import Snapshot, read_snapshot, write_snapshot

    prefix = f"stopped-{stop.name}/"
    url = f"s3://{s3.bucket}/{prefix}snap.pt"
    write_snapshot(Snapshot(step=1), url)
    before = s3_fs.cat_file(url)
    code = SAVE_PAST_ONE_PART.format(part=PART, path=url)
    env = {**os.environ, **s3.env(), "FSSPEC_S3": json.dumps({"default_block_size": PART})}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "part uploaded"
        (received,) = bytes_in_flight(s3_fs, s3.bucket, prefix)
        assert received > PART  # the bytes really reached the server before the stop
        child.send_signal(stop)
        assert child.wait(timeout=180) != 0
    finally:
        child.kill()
        child.wait()
    s3_fs.invalidate_cache()
    assert s3_fs.cat_file(url) == before
    assert read_snapshot(url).step == 1


@pytest.mark.parametrize("case, env_overrides, path", [
    ("missing bucket", {}, "s3://no-such-bucket/snap.pt"),
    ("wrong credentials", {"AWS_SECRET_ACCESS_KEY": "wrong"}, None),
    # One attempt: botocore would retry a refused connection for about 8 s before giving up.
    ("unreachable endpoint", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1"}, None),
])
def test_unusable_s3_fails_before_training(text_file, s3, monkeypatch, capsys, case, env_overrides, path):
    """main.run() in this process under the case's AWS variables (s3fs reads them when it makes a
    filesystem: none made under other variables may be reused)."""
    url = path or f"s3://{s3.bucket}/refused/snap.pt"
    for key, value in s3.env(**env_overrides).items():
        monkeypatch.setenv(key, value)
    fsspec.get_filesystem_class("s3").clear_instance_cache()
    result = run_main_in_process(tiny_overrides(text_file, url), capsys)
    fsspec.get_filesystem_class("s3").clear_instance_cache()  # made under this case's variables
    line = one_error_line(result)
    assert line.startswith("error: trainer_config.snapshot_path: cannot write to"), case
    assert "Epoch 1 |" not in result.stdout


@pytest.mark.parametrize("case", ["no credentials", "unreachable endpoint"])
def test_unusable_s3_data_is_one_line(text_file, s3, tmp_path, monkeypatch, capsys, case):
    """A text on S3 that cannot be read: one line naming data_config.path (it was an 80-line
    botocore traceback without credentials, 152 lines for an endpoint that refuses), nothing made."""
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    if case == "no credentials":
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(key)
        for key in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
            monkeypatch.setenv(key, str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask for either
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = f"s3://{s3.bucket}/data/input.txt"
    fsspec.get_filesystem_class("s3").clear_instance_cache()
    overrides = [*tiny_overrides(text_file, tmp_path / "snap.pt"), f"data_config.path={url}"]
    result = run_main_in_process(overrides, capsys)
    fsspec.get_filesystem_class("s3").clear_instance_cache()  # made under this case's variables
    line = one_error_line(result)
    assert line.startswith(f"error: data_config.path: cannot read {url} ("), line
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def link(s3):
    """A link between the run and the S3 server that the test cuts or freezes (tests/flaky_link.py)."""
    from urllib.parse import urlsplit

    from flaky_link import FlakyLink

    upstream = urlsplit(s3.endpoint)
    link = FlakyLink((upstream.hostname, upstream.port))
    yield link
    link.heal()


def train_through(link, s3, path: str, nproc: int = 1, **settings):
    """A long run saving to path every 10 steps through link; returns it once step 10 is saved."""
    overrides = tiny_overrides("data/input.txt", path, trainer_config__max_epochs=50,
                               trainer_config__save_every_steps=10, data_config__truncate=0.05, **settings)
    launcher = [sys.executable] if nproc == 1 else [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"]
    return start_until([*launcher, MAIN, *overrides], "Snapshot saved at step 10",
                       s3.env(AWS_ENDPOINT_URL=link.endpoint))


def test_s3_going_away_mid_run_is_one_line_and_keeps_the_snapshot(s3, s3_fs, link):
    """The connection to S3 is cut mid-run (the server or its host gone): whatever write of the
    run's files meets it first (the metrics' upload, the snapshot's, the lease's) says one line
    naming its URL, exit status 1, in bounded time; the snapshot on S3 is a whole one."""
    url = f"s3://{s3.bucket}/gone/snap.pt"
    run, seen = train_through(link, s3, url)
    try:
        link.cut()
        cut_at = time.monotonic()
        rest, _ = run.communicate(timeout=180)
    finally:
        kill_tree(run)
    output = "".join(seen) + rest
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert run.returncode == 1 and len(errors) == 1 and "Traceback" not in output, output
    assert re.match(rf"error: could not write s3://{s3.bucket}/gone/\S+ \(\w+", errors[0]) \
        or f"s3://{s3.bucket}/gone/" in errors[0], errors[0]
    assert time.monotonic() - cut_at < 90
    link.heal()
    s3_fs.invalidate_cache()
    assert load_object(s3_fs, url)["step"] % 10 == 0  # a whole snapshot of a save that completed


def test_s3_that_stops_answering_mid_save_is_named_by_the_rank_that_waits(s3, s3_fs, link):
    """The connection is frozen (the server stops answering, the connection stays open) on 2 ranks:
    rank 0's next write of the run's files does not move, and within hang_timeout_s and a few
    heartbeats one line names the rank, the file and how much was written, and the snapshot kept;
    exit status 1, long before the collective timeout. The snapshot on S3 is the one named."""
    url = f"s3://{s3.bucket}/frozen/snap.pt"
    run, seen = train_through(link, s3, url, nproc=2, trainer_config__hang_timeout_s=4)
    try:
        link.freeze()
        frozen_at = time.monotonic()
        rest, _ = run.communicate(timeout=120)
    finally:
        kill_tree(run)
    said = the_ranks_one_error_line("".join(seen) + rest)
    assert run.returncode == 1
    match = re.match(rf"error: rank 0 \(host \S+, pid \d+\): its (write|read|list|look \w+) of "
                     rf"s3://{s3.bucket}/frozen/\S* has not moved for \d+ s.*; the store stopped answering .*"
                     r"the last snapshot \(step (\d+)\) is kept as it was", said)
    assert match, said
    assert time.monotonic() - frozen_at < 4 + 30
    link.heal()
    s3_fs.invalidate_cache()
    assert load_object(s3_fs, url)["step"] == int(match[2])


@pytest.mark.parametrize("snapshot_format, method, background, frozen_at, named", [
    ("sharded", "fsdp", False, "sharded_000000020/.metadata.tmp", "sharded_000000020/.metadata.tmp"),
    ("sharded", "fsdp", True, "sharded_000000020/__0_", "sharded_000000020/__{rank}_0.distcp"),
    ("single", "ddp", True, "snap.pt.tmp-", "snap.pt"),  # written to a temporary, renamed when whole
], ids=["sharded, dcp's metadata", "sharded in the background, a shard", "single file in the background"])
def test_a_save_frozen_in_any_call_is_named_as_that_save_and_only_a_written_snapshot_is_kept(
        s3, s3_fs, link, snapshot_format, method, background, frozen_at, named):
    """The store stops answering at one request of the save of step 20 on 2 ranks: DCP's .metadata
    (written by rank 0 at the end, while rank 1 waits for it in DCP's collective; its upload happens
    when the file is closed, which nobody watched: the line came once the lease's refresh stalled,
    and named that), a shard written in the background, or a single file's upload in the background.
    Within hang_timeout_s + 30 s one line names that save (its file, what it was) and, as kept, the
    snapshot of step 10, complete on the store (it named step 20's, only queued, in the background),
    with the save of step 20 not finished; exit status 1. On the store the one named is the newest
    complete snapshot. Every request after the frozen one waits too: a shard's line may come from
    either rank (naming its own shard), whichever rank's write stalled first."""
    from mingpt.storage.snapshot import read_snapshot, sharded_entries

    folder = f"s3://{s3.bucket}/frozen-{snapshot_format}-{background}"
    path = f"{folder}/snap.pt" if snapshot_format == "single" else folder
    run, seen = train_through(link, s3, path, nproc=2, trainer_config__hang_timeout_s=4,
                              trainer_config__snapshot_format=snapshot_format,
                              trainer_config__distributed_method=method, trainer_config__async_snapshots=background)
    try:
        link.freeze_at(frozen_at.encode())
        rest, _ = run.communicate(timeout=180)
        said_at = time.monotonic()
    finally:
        kill_tree(run)
    link.cut()  # what the frozen link holds never reaches the server
    said = the_ranks_one_error_line("".join(seen) + rest)
    assert run.returncode == 1
    kept = f"{folder}/sharded_000000010" if snapshot_format == "sharded" else path
    in_the_background = ", in the background," if background else ""
    rank = re.match(r"error: rank (\d+)", said)[1] if "{rank}" in named else "0"
    named = named.format(rank=rank)
    assert re.fullmatch(
        rf"error: rank {rank} \(host \S+, pid \d+\): its write of {re.escape(f'{folder}/{named}')} "
        r"has not moved for \d+ s \((\d+\.\d MB written; )?saving the snapshot of step 20\); the store stopped "
        r"answering \(.*\); the last snapshot \(step 10\) is kept as it was: "
        rf"{re.escape(kept)}; the save of step 20{in_the_background} was not finished(; each rank's .*| \(no report: .*\))", said), said
    assert said_at - link.frozen_at < 4 + 30
    s3_fs.invalidate_cache()
    if snapshot_format == "sharded":
        assert sharded_entries(folder) == [kept]
    else:
        assert read_snapshot(path).step == 10
