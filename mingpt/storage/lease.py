"""One run per snapshot path: a lease beside the snapshots, local or on any fsspec URL.

Two runs on one snapshot path (a job submitted twice, a sweep with a fixed path) would both train and
both write: the last writer wins, the metrics hold both runs' steps interleaved, and a later resume
does not notice. So global rank 0 holds `<snapshot>.lease.json` (a folder's `lease.json`) while its
run lives: who holds it (host, pid, Slurm job, torchrun run id) and when it last said so, refreshed
every REFRESH_S by a thread of its own.

At start-up a lease held by another run refuses the new run in one line naming the holder. A lease
is taken over, with a line saying so, when its run is gone: not refreshed for STALE_AFTER_S, or its
process dead on this host; at once, silently, when it is this run's own (a Slurm requeue of the same
job, a torchrun restart of the same run, an earlier job of the same sweep process). Two runs that
start at the same moment both write; each reads the lease back SETTLE_S later and the one that
finds another's token gives way. A run whose lease another run took over meanwhile (it was thought
gone: its store stalled past STALE_AFTER_S) learns it at its next refresh and stops before it
writes another snapshot (Checkpointer.failed). The lease is removed when the run ends.
"""
import atexit
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Optional

import psutil

from mingpt.common import files
from mingpt.common.errors import SnapshotError, short_reason
from mingpt.common.logger import log
from mingpt.storage.snapshot import TRAINING_KEY, is_folder

REFRESH_S = float(os.environ.get("MINGPT_LEASE_REFRESH_S", 30))
"""How often the holder says it is alive (a small write: the tests set it lower)."""
STALE_AFTER_S = float(os.environ.get("MINGPT_LEASE_STALE_S", 4 * REFRESH_S))
"""A lease not refreshed for this long belongs to a run that is gone (hosts' clocks may differ a
little: this is minutes, not seconds)."""
SETTLE_S = 0.5
"""How long after writing its lease a run reads it back to see whether another run wrote at the same
moment (two writes that close are a race only one may win)."""


def lease_path(snapshot_path: str) -> str:
    """`gpt_snapshot.pt` -> `gpt_snapshot.lease.json`; a folder `run/` -> `run/lease.json`."""
    if is_folder(snapshot_path):
        return snapshot_path.rstrip("/") + "/lease.json"
    return snapshot_path[: -len(".pt")] + ".lease.json"


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as its JSON says."""

    token: str
    host: str
    pid: int
    started: float
    """The holder process's start time (psutil's create_time): a pid reused by another process
    later is not the holder."""
    refreshed: float
    """Wall-clock time of its last refresh (seconds since the epoch)."""
    job: str = ""
    """SLURM_JOB_ID, kept across a requeue."""
    run: str = ""
    """TORCHELASTIC_RUN_ID, kept across torchrun's restarts of the same run."""

    @classmethod
    def me(cls, token: str) -> "Holder":
        return cls(token=token, host=socket.gethostname(), pid=os.getpid(),
                   started=psutil.Process().create_time(), refreshed=time.time(),
                   job=os.environ.get("SLURM_JOB_ID", ""), run=os.environ.get("TORCHELASTIC_RUN_ID", ""))

    def describe(self) -> str:
        job = f", Slurm job {self.job}" if self.job else ""
        return f"host {self.host}, pid {self.pid}{job}"

    def same_run_as(self, other: "Holder") -> bool:
        """An earlier attempt of this very run: the same Slurm job (requeued), the same torchrun run
        (restarted), or the same process (an earlier job of a sweep)."""
        return ((bool(self.job) and self.job == other.job) or (bool(self.run) and self.run == other.run)
                or (self.host, self.pid, self.started) == (other.host, other.pid, other.started))

    def gone(self, now: float) -> Optional[str]:
        """Why this holder's run is over ("its process has ended", "not refreshed for 300 s"), or None
        while it may still be running."""
        if self.host == socket.gethostname() and not _alive(self.pid, self.started):
            return "its process has ended"
        if now - self.refreshed > STALE_AFTER_S:
            return f"not refreshed for {now - self.refreshed:.0f} s"
        return None


def _alive(pid: int, started: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.Error:
        return False


class SnapshotLease:
    """Global rank 0's hold on a snapshot path (a context: held inside, released on the way out)."""

    def __init__(self, snapshot_path: str):
        self.url = lease_path(snapshot_path)
        self.me = Holder.me(uuid.uuid4().hex)
        self.lost_to: Optional[Holder] = None
        """The run that took this lease over while this one ran (it then stops before saving)."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def acquire(self) -> None:
        """Take the lease, or raise SnapshotError naming the run that holds it."""
        holder = self._read()
        if holder is not None and not holder.same_run_as(self.me):
            gone = holder.gone(time.time())
            if gone is None:
                raise self._refusal(holder)
            log.info(f"Taking over the lease {self.url} of a run that is gone ({holder.describe()}: {gone})")
        self._write()
        time.sleep(SETTLE_S)
        holder = self._read()
        if holder is not None and holder.token != self.me.token:
            raise self._refusal(holder)  # another run wrote in the same moment, after this one
        self._thread = threading.Thread(target=self._keep_refreshed, name="mingpt-lease", daemon=True)
        self._thread.start()
        atexit.register(self.release)  # however the process ends, short of being killed

    def release(self) -> None:
        """Stop refreshing and remove the lease, if it is still this run's."""
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        try:
            holder = self._read()
            if holder is not None and holder.token == self.me.token:
                files.remove(self.url)
        except Exception:  # a store gone away: the lease goes stale, and is taken over then
            pass

    def lost(self) -> Optional[str]:
        """Why this run may no longer write its snapshots (another run took its lease), or None."""
        if self.lost_to is None:
            return None
        return (f"{TRAINING_KEY}: another run ({self.lost_to.describe()}) took over the lease {self.url} "
                "while this run could not refresh it; this run stops without writing over that run's "
                "snapshots")

    def _keep_refreshed(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                holder = self._read()
                if holder is not None and holder.token != self.me.token:
                    self.lost_to = holder
                    return
                self._write()
            except Exception:  # a store that fails now and then: refreshed next time, or stale
                continue

    def _refusal(self, holder: Holder) -> SnapshotError:
        ago = time.time() - holder.refreshed
        return SnapshotError(
            f"{TRAINING_KEY}: another run is using these snapshots ({holder.describe()}, its lease "
            f"{self.url} refreshed {ago:.0f} s ago); wait for it to end, or set {TRAINING_KEY} to "
            f"another location (a lease not refreshed for {STALE_AFTER_S:.0f} s is taken over)")

    def _read(self) -> Optional[Holder]:
        """The lease's holder; None when there is none, or when it cannot be parsed (a torn write of
        a run that died while writing it)."""
        try:
            return Holder(**json.loads(files.read_bytes(self.url)))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            return None
        except Exception as error:
            raise SnapshotError(f"cannot read {self.url} ({short_reason(error)}); check {TRAINING_KEY} "
                                "and its credentials") from None

    def _write(self) -> None:
        text = json.dumps(asdict(Holder(**{**asdict(self.me), "refreshed": time.time()}))).encode()
        try:
            files.write_atomically(self.url, lambda f: f.write(text))
        except Exception as error:
            raise SnapshotError(f"cannot write {self.url} ({short_reason(error)}); check {TRAINING_KEY}, "
                                "its credentials and free space") from None

    def __enter__(self) -> "SnapshotLease":
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
