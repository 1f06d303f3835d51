"""What two torchrun ranks say when a run goes wrong: one line for the run (README, "When a run goes
wrong"), from the rank that knows, rank 0 for what every rank meets alike; torchrun's own report aside."""
import time

import pytest
from helpers import (
    MAIN,
    TORCHRUN,
    llmc_shards_of,
    rank_exit_status,
    rank_process,
    run,
    run_main,
    start_until,
    the_ranks_one_error_line,
    tiny_overrides,
)

pytestmark = pytest.mark.slow

PROCESS_GROUP_TIMEOUT_S = 5


def test_a_stalled_rank_is_a_collective_timeout_in_one_line(text_file, tmp_path):
    """Rank 1 SIGSTOPped mid-run, with the project's watchdog set far beyond the process group's
    timeout: rank 0's collective gives up after that timeout (gloo's raw `Timed out waiting 5000ms
    for recv operation`) and rank 0 says so in one line naming the timeout and its key, exit 1."""
    overrides = tiny_overrides(text_file, tmp_path / "snap.pt", trainer_config__max_epochs=100,
                               trainer_config__process_group_timeout_s=PROCESS_GROUP_TIMEOUT_S,
                               trainer_config__hang_timeout_s=600)
    process, seen = start_until([*TORCHRUN, "--standalone", "--nproc_per_node=2", MAIN, *overrides],
                                "| Iter 20 |")
    waiting, stalled = rank_process(process, 0), rank_process(process, 1)
    stalled.suspend()
    stalled_at = time.monotonic()
    for line in process.stdout:
        seen.append(line)
        if line.startswith("error:"):
            break
    said_after = time.monotonic() - stalled_at
    waiting.wait(timeout=30)  # its own exit, before torchrun stops it on seeing the stalled one killed
    stalled.kill()  # torchrun would wait 30 s for a stopped worker to answer its SIGTERM
    rest, _ = process.communicate(timeout=60)
    output = "".join(seen) + rest
    said = the_ranks_one_error_line(output)
    assert said.startswith("error: [rank 0] a collective timed out: another process stopped answering for "
                           "5 s (trainer_config.process_group_timeout_s=5): it hung, was stopped or fell "
                           "far behind; see the other processes' output"), said
    assert "raise trainer_config.process_group_timeout_s if a step can take that long" in said
    assert PROCESS_GROUP_TIMEOUT_S <= said_after < PROCESS_GROUP_TIMEOUT_S + 15, said_after
    assert process.returncode == 1 and rank_exit_status(output, 0) == 1, output


def test_a_failed_snapshot_write_on_rank_0_is_the_runs_one_line(text_file, tmp_path):
    """Rank 0's first snapshot write fails for real (a file size limit: RLIMIT_FSIZE binds root too,
    and only rank 0 writes so large a file), as on a full disk; rank 1, waiting for it in a
    collective, loses contact when rank 0 exits. torchrun looks at its workers every 2 s here (not
    every 0.1 s), so rank 1 always has the time to speak before torchrun stops it: it must not, rank
    0's line is the run's."""
    snapshot = tmp_path / "snap.pt"
    overrides = tiny_overrides(text_file, snapshot, trainer_config__save_every_steps=10)
    limit = 100_000  # bytes: the tiny model's snapshot is ~360 KB; the metrics and the token file far less
    result = run(["prlimit", f"--fsize={limit}", *TORCHRUN, "--standalone", "--nproc_per_node=2",
                  "--monitor-interval=2", MAIN, *overrides])
    said = the_ranks_one_error_line(result.stderr)
    assert said.startswith(f"error: could not write snapshot {snapshot} ("), said
    assert result.returncode == 1 and rank_exit_status(result.stderr, 0) == 1, result.stderr
    assert not snapshot.exists()


def test_a_torn_validation_shard_is_said_by_rank_zero(text_file, tmp_path):
    """Every rank opens data_config.val_path and meets the same torn shard at the same moment: the
    line is local rank 0's (no `[rank 1]`), as for every mistake in the data."""
    shards = llmc_shards_of(text_file, tmp_path / "shards", tmp_path / "tokenizer.json", shards=2,
                            ids_per_shard=2000, val_ids=500)
    val = tmp_path / "shards" / "val.bin"
    val.write_bytes(val.read_bytes()[:-10])
    overrides = tiny_overrides(shards, tmp_path / "snap.pt", data_config__val_path=val,
                               data_config__tokenizer=tmp_path / "tokenizer.json")
    result = run_main(overrides, nproc=2)
    said = the_ranks_one_error_line(result.stderr)
    assert said.startswith(f"error: data_config.val_path: {val} is 2,014 bytes where its header says "), said
    assert result.returncode == 1
