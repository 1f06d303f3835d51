"""What two torchrun ranks say when a run goes wrong: one line for the run (README, "When a run goes
wrong"); torchrun's own report aside."""
import time

from helpers import (
    MAIN,
    TORCHRUN,
    rank_exit_status,
    rank_process,
    start_until,
    the_ranks_one_error_line,
    tiny_overrides,
)

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
