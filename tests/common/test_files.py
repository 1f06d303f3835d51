"""files.py: one door to files. A store's failure is one line naming the file (StorageError); every
transfer under way is seen, with how far it got, by the watchdog."""
import re
import subprocess
import sys
import threading
import time

import pytest

from mingpt.common import files
from mingpt.common.errors import MinGPTError, StorageError, short_reason


def test_a_store_s_failure_is_one_line_naming_the_file_and_still_an_os_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    url = str(tmp_path / "a-file" / "metrics.jsonl")  # a file where a folder should be
    with pytest.raises(StorageError) as failed:
        files.write_atomically(url, lambda f: f.write(b"{}"))
    line = str(failed.value)
    assert line.startswith(f"could not write {url} (") and "\n" not in line
    assert isinstance(failed.value, (MinGPTError, OSError))
    assert short_reason(failed.value).startswith(("NotADirectoryError", "FileExistsError"))
    with pytest.raises(StorageError, match="could not append to"):
        files.append_text(url, "{}\n")
    with pytest.raises(FileNotFoundError):  # "none yet" stays what it was
        files.read_bytes(str(tmp_path / "none"))


def test_a_store_s_failure_passes_between_processes_as_it_is(tmp_path):
    """torch.distributed.checkpoint hands each rank's failure to the others pickled: a StorageError
    (whose cause, a store's own exception, may not unpickle) arrives as the same line and reason."""
    import pickle

    with pytest.raises(StorageError) as failed:
        files.read_bytes(str(tmp_path))  # a folder: IsADirectoryError
    arrived = pickle.loads(pickle.dumps(failed.value))
    assert type(arrived) is StorageError and isinstance(arrived, OSError)
    assert str(arrived) == str(failed.value) and short_reason(arrived) == short_reason(failed.value)
    assert short_reason(arrived).startswith("IsADirectoryError")


def test_a_bug_in_what_a_write_writes_keeps_its_traceback(tmp_path):
    def buggy(f):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        files.write_atomically(str(tmp_path / "x"), buggy)
    assert list(tmp_path.iterdir()) == []  # the temporary is gone too


def test_a_transfer_that_stops_moving_is_seen_with_how_far_it_got(tmp_path):
    seen = []

    def write_then_stop(f):
        f.write(bytes(3_000_000))
        seen.append(files.stalled_transfer(after_s=60))  # moving: not stalled
        time.sleep(0.3)
        seen.append(files.stalled_transfer(after_s=0.2))

    files.write_atomically(str(tmp_path / "snap.pt"), write_then_stop)
    assert seen[0] is None
    assert seen[1].url == str(tmp_path / "snap.pt") and seen[1].done == 3_000_000
    assert seen[1].describe(seen[1].moved_at + 62) == f"write of {tmp_path / 'snap.pt'} has not moved for 62 s (3.0 MB written)"
    # Ended: no longer under way (another test's leftover thread may be writing a file of its own).
    still = files.stalled_transfer(after_s=0)
    assert still is None or still.url != str(tmp_path / "snap.pt")


STALLED_WRITE = """
import time, torch
from mingpt.common import files
from mingpt.distributed.stragglers import StepClock
from mingpt.distributed.watchdog import RunWatchdog
watch = RunWatchdog(0, 1, 1.0, {folder!r}, lambda: "the last snapshot (step 20) is kept as it was",
                    StepClock(torch.device("cpu")))
def write_then_hang(f):
    f.write(bytes(100_000))
    time.sleep(60)
with watch:
    files.write_atomically({path!r}, write_then_hang)
"""


@pytest.mark.slow
def test_a_single_process_whose_write_stops_moving_ends_in_one_line(tmp_path):
    """No other rank to wait for it: the process's own watchdog names its stalled write and ends it."""
    path = str(tmp_path / "snap.pt")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", STALLED_WRITE.format(folder=str(tmp_path), path=path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and time.monotonic() - started < 30
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 (host "), result.stderr
    # 1 s is the watch's bound; a loaded machine's watchdog may look a second or two later.
    assert re.search(rf"its write of {re.escape(path)} has not moved for \d+ s \(0\.1 MB written\)", lines[0])
    assert lines[0].endswith("; the last snapshot (step 20) is kept as it was")


HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()  # until the test lets go
"""


def test_a_lock_another_process_holds_is_waited_for_or_passed_by(tmp_path):
    """Another process of the machine holds `<path>.lock` (an flock, as every version of this module
    takes it): try_locked passes by at once, locked waits until it lets go."""
    path = tmp_path / "input.txt.tokens"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, f"{path}.lock"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        started = time.monotonic()
        with files.try_locked(path) as held:
            assert not held
        assert time.monotonic() - started < 1
        started = time.monotonic()
        threading.Timer(1.0, holder.stdin.close).start()
        with files.locked(path):
            assert time.monotonic() - started >= 1.0  # taken once the holder let go, not before
        assert holder.wait(timeout=30) == 0
        with files.try_locked(path) as held:
            assert held
    finally:
        holder.kill()
        holder.wait()


def test_a_failure_under_the_lock_leaves_no_lock_file_and_lets_in_one_waiter_at_a_time(tmp_path):
    """Nothing made, nothing left: the failed maker removes the lock file. A waiter that had opened
    the removed file does not take the lock on it while another process takes it on a new one (two
    makers at once); it takes it on the new file, and a third waits for it."""
    path = tmp_path / "input.txt.tokens"
    first_holds, second_holds, let_go = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with pytest.raises(ValueError), files.locked(path):
            first_holds.set()
            time.sleep(0.5)  # the second is waiting, its lock file opened
            raise ValueError("a refused source")

    def second() -> None:
        first_holds.wait()
        with files.locked(path):
            second_holds.set()
            let_go.wait(timeout=30)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    try:
        assert second_holds.wait(timeout=30)
        with files.try_locked(path) as held:
            assert not held, "two holders at once: the waiter took the lock on the removed file"
    finally:
        let_go.set()
        for thread in threads:
            thread.join()
    # Only the second's lock file, if any: filelock 3.20.4 to 3.20.x removed it on release.
    assert {entry.name for entry in tmp_path.iterdir()} <= {"input.txt.tokens.lock"}
    with pytest.raises(KeyError), files.try_locked(path) as held:
        assert held
        raise KeyError("a bug")
    assert list(tmp_path.iterdir()) == []  # try_locked's failure too


def test_a_lock_file_that_cannot_be_made_is_an_os_error(tmp_path):
    """Callers take an OSError for "the lock's folder is not writable" (token_file's one line naming the
    file; step_trace traces without its cache)."""
    (tmp_path / "a-file").write_text("")
    with pytest.raises(OSError), files.locked(tmp_path / "a-file" / "x.tokens"):
        pass
    with pytest.raises(OSError), files.try_locked(tmp_path / "a-file" / "x.tokens"):
        pass
