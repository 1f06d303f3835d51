"""Snapshots written while training goes on (`trainer_config.async_snapshots=True`).

Training waits only while the state is copied, at the step the snapshot is of; a single background
thread then writes the copy. One save at a time: a new one first waits for the one before, and the
last one is finished before training ends. A save that failed in the background is noticed by the
training thread without waiting (failed()); the Trainer then stops every rank at the same step with
its one-line error. The write itself stays atomic, so the previous snapshot is still whole.

Why a copy: the state dicts a snapshot is made of are views of the live tensors wherever no gather
or device transfer stands between them (CPU DDP; every rank's shards; AdamW's step counts, updated
in place), and the next optimizer step changes them while the writer is still reading.
"""
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch


class StagingBuffer:
    """Host copies of a state's tensors, reused from save to save.

    The first copy allocates (as a clone would); later ones copy into the same memory, which saves
    the page faults of fresh memory: for the default model's 300 MB, 0.03 s against 0.6 s for fresh
    clones on this machine (best of 8, under load; bench/bench_snapshot.py reports the first async
    pause apart from the later ones). The cost: one copy of the state stays in host memory. Reuse is
    safe because a copy is only made once the save that read the previous one is finished.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def copy(self, state: Any) -> Any:
        """state (nested dicts and lists of tensors and plain values) with every tensor copied to
        host memory; the result shares nothing with state."""
        used: dict[tuple, torch.Tensor] = {}
        copied = self._copy(state, (), used)
        self._buffers = used  # tensors the state no longer has are let go
        return copied

    def _copy(self, value: Any, path: tuple, used: dict) -> Any:
        if isinstance(value, dict):
            return {key: self._copy(item, (*path, key), used) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(item, (*path, index), used) for index, item in enumerate(value))
        if isinstance(value, torch.Tensor):
            used[path] = self._copy_tensor(value.detach(), self._buffers.get(path))
            return used[path]
        return value  # numbers, strings, None: immutable

    @staticmethod
    def _copy_tensor(tensor: torch.Tensor, buffer: Optional[torch.Tensor]) -> torch.Tensor:
        """Into buffer when it fits, else into new host memory. A DTensor (an FSDP shard) copies
        its local part and keeps its placement, which torch.distributed.checkpoint needs."""
        if buffer is not None and type(buffer) is type(tensor):
            target, source = _local(buffer), _local(tensor)
            if target.shape == source.shape and target.dtype == source.dtype:
                target.copy_(source)
                return buffer
        return tensor.to("cpu", copy=True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view of its memory), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class BackgroundSaves:
    """At most one save in flight, on one worker thread; its error is handed to the training thread."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        # A new thread's current CUDA device is GPU 0, whatever the training thread's: a writer
        # left there would open a CUDA context on GPU 0 from every rank (about 0.5 GB each; in
        # exclusive-process mode the save fails) when DCP synchronises a stream.
        on_device = (torch.cuda.set_device, (device,)) if device.type == "cuda" else (None, ())
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-writer",
                                            initializer=on_device[0], initargs=on_device[1])
        self._in_flight: Optional[Future] = None
        self.staging = StagingBuffer()
        """Where the state is copied for the writer; call finish() first (the writer reads it)."""

    def submit(self, write: Callable[[], None]) -> None:
        """Run write() in the background. Call finish() first: one save at a time."""
        assert self._in_flight is None, "the previous save is not finished"
        self._in_flight = self._executor.submit(write)

    def failed(self) -> bool:
        """Whether the save in flight has ended with an error: cheap enough for every step, never
        waits, and leaves the error for finish() to return."""
        in_flight = self._in_flight
        return in_flight is not None and in_flight.done() and in_flight.exception() is not None

    def finish(self) -> Optional[BaseException]:
        """Block until the save in flight, if any, has ended; return its error (None if it worked)."""
        in_flight, self._in_flight = self._in_flight, None
        return in_flight.exception() if in_flight is not None else None
