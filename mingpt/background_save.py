"""Snapshots written while training goes on (`trainer_config.async_snapshots=True`).

Training waits only while the state is copied, at the step the snapshot is of; a single background
thread then writes the copy. One save at a time: a new one first waits for the one before, and the
last one is finished before the process exits. A save that failed in the background stops the run
with its one-line error at the next step; the write itself stays atomic, so the previous snapshot
is still whole.
"""
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional


class BackgroundSaves:
    """At most one save in flight, on one worker thread; its error surfaces in the training thread."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-writer")
        self._in_flight: Optional[Future] = None

    def submit(self, write: Callable[[], None]) -> None:
        """Start write() once the previous save has finished (and raise if that one failed)."""
        self.wait()
        self._in_flight = self._executor.submit(write)

    def raise_if_failed(self) -> None:
        """Cheap enough for every step: raises a finished save's error, never waits."""
        if self._in_flight is not None and self._in_flight.done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight, if any, is written; raise its error."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def close(self) -> None:
        """Finish the last save (raising its error), then stop the thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
