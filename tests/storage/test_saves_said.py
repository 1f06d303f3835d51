"""A snapshot said is a snapshot written: what a run says of its snapshots (Checkpointer.kept, the
watchdog's line) names only snapshots complete on the store, and a save that stalls is named as that
save, in whichever call to the store it stalls (DCP's own included).

In this process, on the local disk: a file of the save is a named pipe that nobody reads, so opening
it waits, as on a stale mount or a store that stopped answering; the watchdog's thread runs as in a
run of one process, its line recorded instead of ending the process. test_s3.py freezes a real S3
server's link under real torchrun ranks."""
import os
import re
import threading
import time

import pytest
import torch

from mingpt.common import files
from mingpt.common.errors import SnapshotError
from mingpt.distributed.stragglers import StepClock
from mingpt.distributed.watchdog import RunWatchdog
from mingpt.model import GPT, GPTConfig
from mingpt.optimizer import OptimizerConfig, create_optimizer
from mingpt.storage.checkpointer import Checkpointer, SnapshotPolicy
from mingpt.storage.snapshot import Progress, sharded_entries

TIMEOUT_S = 0.5


class RecordedWatchdog(RunWatchdog):
    """The watchdog of a run of one process, whose line is recorded instead of ending the process."""

    def __init__(self, kept, folder: str):
        super().__init__(0, 1, TIMEOUT_S, folder, kept, StepClock(torch.device("cpu")))
        self.lines: list[str] = []
        self.said = threading.Event()

    def _end(self, line: str) -> None:
        self.lines.append(line)
        self.said.set()
        self._stop.set()


def at_step(step: int) -> Progress:
    return Progress(epoch_step=step, epoch_samples=4 * step, step=step)


@pytest.fixture(autouse=True)
def no_settling(monkeypatch):
    from mingpt.storage import lease

    monkeypatch.setattr(lease, "SETTLE_S", 0.05)


@pytest.fixture
def training():
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=2, block_size=4))
    return model, create_optimizer(model, OptimizerConfig()), torch.amp.GradScaler("cpu", enabled=False)


def unblock(pipe) -> threading.Thread:
    """Read the pipe to its end (its writer's open then returns), in a thread of its own."""
    def drain():
        with open(pipe, "rb") as reading:
            while reading.read(1 << 16):
                pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    return reader


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("stalls_in", ["__0_0.distcp", ".metadata.tmp"], ids=["a shard", "dcp's metadata"])
def test_a_save_that_stalls_is_named_as_that_save_and_the_kept_snapshot_is_a_written_one(
        world_of_one, tmp_path, training, stalls_in, background):
    """The save of step 7 stalls in a shard's stream or in DCP's own .metadata write (the calls of
    its writer besides the shards' bytes were watched by nobody: the line came only once some other
    transfer stalled). Within the timeout and a few polls, the line names that file and that save;
    the snapshot it says is kept is step 3's, complete on the disk, and the save of step 7 (in the
    background with async_snapshots) is said not finished, never kept. Released, the save fails
    (a pipe cannot seek or be synced) and step 3's is still the newest complete."""
    model, optimizer, scaler = training
    folder = tmp_path / "run"
    saver = Checkpointer(SnapshotPolicy(path=str(folder), snapshot_format="sharded", async_snapshots=background),
                         world_of_one, vocab=list("ab"))
    watch = RecordedWatchdog(saver.kept, str(tmp_path))
    saving, pipe = None, folder / "sharded_000000007" / stalls_in
    try:
        saver.save("step 3", at_step(3), model, optimizer, scaler)
        saver.finish()
        assert saver.kept() == f"the last snapshot (step 3) is kept as it was: {folder / 'sharded_000000003'}"
        pipe.parent.mkdir()
        os.mkfifo(pipe)
        errors = []

        def save_step_7():
            try:
                saver.save("step 7", at_step(7), model, optimizer, scaler)
                saver.finish()
            except SnapshotError as error:
                errors.append(error)

        with watch:
            saving = threading.Thread(target=save_step_7, daemon=True)
            saving.start()
            assert watch.said.wait(30), f"nobody named the save stalled in {pipe}"
        [line] = watch.lines
        in_the_background = ", in the background," if background else ""
        assert re.fullmatch(
            rf"rank 0 \(host \S+, pid {os.getpid()}\): its write of {re.escape(str(pipe))} has not moved for \d+ s "
            r"\(saving the snapshot of step 7\); the store stopped answering \(.*\); the last snapshot \(step 3\) "
            rf"is kept as it was: {re.escape(str(folder / 'sharded_000000003'))}; the save of step 7"
            rf"{in_the_background} was not finished", line), line
        assert sharded_entries(str(folder)) == [str(folder / "sharded_000000003")]  # what the line says
    finally:
        if saving is not None:
            reader = unblock(pipe)
            saving.join(30)
            reader.join(30)
        saver.tidy()
    assert not saving.is_alive()
    # The cause is the pipe's, as DCP handed it from the rank that met it (not "TypeError: StorageError").
    assert len(errors) == 1 and re.search(r"could not write snapshot .*\(OSError: \[Errno \d+\] [A-Z]", str(errors[0])), \
        errors
    assert sharded_entries(str(folder)) == [str(folder / "sharded_000000003")]
    assert saver.kept().startswith("the last snapshot (step 3) is kept as it was")
    assert files.stalled_transfer(after_s=0) is None or "sharded_000000007" not in files.stalled_transfer(0).url


def test_a_save_of_a_store_that_stalls_with_other_transfers_is_the_one_named():
    """A store that stops answering stalls every transfer to it: a lease's refresh begun before the
    save, a metrics upload after it. The save is named, and says which."""
    stalled = []
    with files.transfer("read", "s3://b/run/lease.json"):
        with files.part_of("saving the snapshot of step 20"), files.transfer("write", "s3://b/run/sharded_20/x") as saving:
            saving.advance(2_000_000)
            with files.transfer("write", "s3://b/run/metrics.jsonl"):
                time.sleep(0.2)
                stalled.append(files.stalled_transfer(after_s=0.1))
    assert stalled[0] is saving
    assert saving.describe(saving.moved_at + 61) == ("write of s3://b/run/sharded_20/x has not moved for 61 s "
                                                     "(2.0 MB written; saving the snapshot of step 20)")


def test_a_run_that_fails_with_a_save_in_the_background_says_it_was_not_finished(world_of_one, tmp_path, training,
                                                                                  caplog):
    """Training fails (a lost peer, say) while the save of step 7 is written in the background, and
    that save fails too: the training error is the one raised, and a line says the save was not
    finished and which snapshot is kept (it said nothing: the snapshot a user had was anyone's guess)."""
    model, optimizer, scaler = training
    folder = tmp_path / "run"
    saver = Checkpointer(SnapshotPolicy(path=str(folder), snapshot_format="sharded", async_snapshots=True),
                         world_of_one, vocab=list("ab"))
    saver.save("step 3", at_step(3), model, optimizer, scaler)
    saver.finish()
    pipe = folder / "sharded_000000007" / "__0_0.distcp"
    pipe.parent.mkdir()
    os.mkfifo(pipe)
    saver.save("step 7", at_step(7), model, optimizer, scaler)  # its writer waits on the pipe
    reader = unblock(pipe)
    with caplog.at_level("INFO", logger="mingpt"), pytest.raises(RuntimeError, match="lost a peer"):
        with saver.finished_on_error():
            raise RuntimeError("lost a peer")
    reader.join(30)
    [said] = [record.getMessage() for record in caplog.records if "in the background" in record.getMessage()]
    assert re.fullmatch(r"A save in the background failed with the run \(SnapshotError: could not write snapshot .*\): "
                        rf"the last snapshot \(step 3\) is kept as it was: {re.escape(str(folder / 'sharded_000000003'))}; "
                        r"the save of step 7, in the background, was not finished", said), said
    assert sharded_entries(str(folder)) == [str(folder / "sharded_000000003")]
