"""Snapshots written while training goes on (`trainer_config.async_snapshots=True`).

Training waits only while the state is copied, at the step the snapshot is of; a single background
thread then writes the copy. One save at a time: a new one first waits for the one before, and the
last one is finished before training ends. A save that failed in the background is noticed by the
training thread without waiting (failed()); the Trainer then stops every rank at the same step with
its one-line error. The write itself stays atomic, so the previous snapshot is still whole.

Why a copy: the state dicts a snapshot is made of are views of the live tensors wherever no gather
or device transfer stands between them (CPU DDP; every rank's shards; AdamW's step counts, updated
in place), and the next optimizer step changes them while the writer is still reading. Only those
are copied: a tensor a gather or a device transfer has just made (the full state of FSDP, or of a
GPU) is already the writer's alone, and a second host copy of it would only cost memory.
"""
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional

import torch

from mingpt.distributed.parallel import local_part


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
        self.copied_bytes = 0
        """Bytes the last copy() copied (what this rank stages)."""
        self._copied: Optional[torch.cuda.Event] = None
        """Recorded after the last copy's transfers from a GPU were queued; None without any."""

    def copy(self, state: Any, live: Iterable[torch.Tensor]) -> Any:
        """state (nested dicts and lists of tensors and plain values) in host memory that training
        does not touch: every tensor on a GPU or sharing memory with a tensor of live (the model's
        and optimizer's) is copied, the others are the caller's own already and kept as they are.
        Copies from a GPU are asynchronous; wait_until_copied() before reading them."""
        used: dict[tuple, torch.Tensor] = {}
        self.copied_bytes = 0
        live_memory = {local_part(tensor).untyped_storage().data_ptr() for tensor in live}
        copied = self._copy(state, (), used, live_memory)
        self._buffers = used  # tensors the state no longer has are let go
        self._copied = None
        if any(local_part(tensor).is_cuda for tensor in live):
            self._copied = torch.cuda.Event()
            self._copied.record()  # after every copy queued on the training thread's stream
        return copied

    def wait_until_copied(self) -> None:
        """Block until the last copy's transfers from a GPU have landed (for the writer thread)."""
        if self._copied is not None:
            self._copied.synchronize()

    def _copy(self, value: Any, path: tuple, used: dict, live_memory: set) -> Any:
        if isinstance(value, dict):
            return {key: self._copy(item, (*path, key), used, live_memory) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(item, (*path, index), used, live_memory)
                               for index, item in enumerate(value))
        if isinstance(value, torch.Tensor):
            local = local_part(value)
            if not local.is_cuda and local.untyped_storage().data_ptr() not in live_memory:
                return value  # made for this save: nothing else writes to it
            used[path] = self._copy_tensor(value.detach(), self._buffers.get(path))
            self.copied_bytes += local.numel() * local.element_size()
            return used[path]
        return value  # numbers, strings, None: immutable

    @staticmethod
    def _copy_tensor(tensor: torch.Tensor, buffer: Optional[torch.Tensor]) -> torch.Tensor:
        """Into buffer when it fits, else into new host memory: pinned for a plain tensor from a GPU,
        so that this copy and every later one into the same buffer is asynchronous. A DTensor (an
        FSDP shard) copies its local part and keeps its placement, which torch.distributed.checkpoint
        needs (its first copy is pageable: DTensor.from_local would move a host part back to the GPU)."""
        if buffer is not None and type(buffer) is type(tensor):
            target, source = local_part(buffer), local_part(tensor)
            if target.shape == source.shape and target.dtype == source.dtype:
                target.copy_(source, non_blocking=source.is_cuda)
                return buffer
        if tensor.is_cuda and local_part(tensor) is tensor:
            pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return pinned.copy_(tensor, non_blocking=True)
        return tensor.to("cpu", copy=True)


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
        """Run write() in the background, once the staging copies have landed. Call finish()
        first: one save at a time."""
        assert self._in_flight is None, "the previous save is not finished"

        def write_when_copied() -> None:
            self.staging.wait_until_copied()
            write()

        self._in_flight = self._executor.submit(write_when_copied)

    def failed(self) -> bool:
        """Whether the save in flight has ended with an error: cheap enough for every step, never
        waits, and leaves the error for finish() to return."""
        in_flight = self._in_flight
        return in_flight is not None and in_flight.done() and in_flight.exception() is not None

    def finish(self) -> Optional[BaseException]:
        """Block until the save in flight, if any, has ended; return its error (None if it worked)."""
        in_flight, self._in_flight = self._in_flight, None
        return in_flight.exception() if in_flight is not None else None
