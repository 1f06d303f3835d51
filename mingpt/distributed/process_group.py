"""The process group: who this process is, which device it drives, and a clean exit.

Under torchrun (RANK, WORLD_SIZE, ... in the environment) every rank joins through the env://
rendezvous. Without it (`python main.py`) the process is a world of one, with an in-memory store,
so the rest of the code runs the same collectives either way.
"""
import contextlib
import gc
import hashlib
import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import psutil
import torch
import torch.distributed as dist

from mingpt.common import files
from mingpt.common.errors import MinGPTError, say_error, short_reason

DEFAULT_TIMEOUT_S = 1800.0
"""Collectives wait this long for the slowest rank (NCCL's own default is 10 minutes)."""

RANKS_SHARE_GPU = "MINGPT_RANKS_SHARE_GPU"
"""Set to 1, several ranks of a machine may drive one GPU, talking through gloo (NCCL refuses two
ranks on one device; gloo moves CUDA tensors through host memory). For checking the multi-rank CUDA
paths on a machine with one GPU (bench/multi_rank_cuda.py), not for training: it is slow."""


def ranks_share_gpu() -> bool:
    return os.environ.get(RANKS_SHARE_GPU) == "1"


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, computed once."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    timeout: timedelta = timedelta(seconds=DEFAULT_TIMEOUT_S)
    """How long a collective on any of the run's groups waits for the slowest rank."""

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only rank that logs progress and writes snapshots."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: does once-per-machine work such as fetching data."""
        return self.local_rank == 0

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    def describe(self) -> str:
        """The world in a few words: "2 process(es) on 1 node(s), gloo on cpu" (and, across nodes,
        the interface gloo uses)."""
        across_nodes = self.num_nodes > 1 and self.backend == "gloo"
        across = f", across nodes on {gloo_interface()}" if across_nodes else ""
        return (f"{self.world_size} process(es) on {self.num_nodes} node(s), {self.backend} on "
                f"{self.device.type}{across}")


FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
"""NCCL's flight recorder: each rank keeps its last 2,000 collectives in memory and dumps them when
one times out or fails (torch reads these when it makes an NCCL group)."""
FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"


def record_nccl_collectives(snapshot_folder: str) -> None:
    """On a machine with GPUs, turn NCCL's flight recorder on, dumping beside the snapshots into
    nccl_trace_rank_<N> (trace_folder; a user's own settings of these variables win). Read the dumps
    with torch's analyzer: `python -m torch.distributed.flight_recorder.fr_trace FOLDER --prefix
    nccl_trace_rank_`. Gloo runs are left as they are."""
    if not torch.cuda.is_available():
        return
    for key, value in FLIGHT_RECORDER.items():
        os.environ.setdefault(key, value)
    for key in ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE"):  # torch's older and newer name
        os.environ.setdefault(key, str(trace_folder(snapshot_folder) / FLIGHT_RECORDER_PREFIX))


def trace_folder(snapshot_folder: str) -> Path:
    """Where NCCL's flight recorder dumps: beside the snapshots, or in the cache folder when they are
    not on this machine (NCCL writes local files)."""
    return files.cache_folder(None) / "nccl_traces" if files.is_remote(snapshot_folder) else Path(snapshot_folder)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _pick_device(local_rank: int, local_world_size: int) -> torch.device:
    """This rank's GPU, found as upstream finds it since pytorch/examples 698a89e (torch.accelerator,
    then set_device_index), or the CPU on a machine without one. CUDA only: this project's mixed
    precision, NCCL collectives and step timing are CUDA's, so another accelerator (MPS, XPU) is left
    alone and the CPU trains (docs/distributed.md). Two ranks never share a GPU: NCCL refuses that
    ("Duplicate GPU detected"), and the error would surface as a lost peer."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != "cuda":
        return torch.device("cpu")
    gpus = torch.accelerator.device_count()
    if local_world_size > gpus and not ranks_share_gpu():
        raise MinGPTError(f"{local_world_size} processes on this machine but {gpus} GPU(s) visible; start "
                          f"one process per GPU (torchrun --nproc_per_node={gpus}, or python launch.py)")
    torch.accelerator.set_device_index(local_rank % gpus)
    return torch.device("cuda", local_rank % gpus)


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, and gloo beside it for CPU tensors: FSDP's CPU offload keeps gradient
    shards in host memory, and clipping all-reduces their norms, which a plain "nccl" group refuses
    ("No backend type associated with device type cpu"). On the CPU, the backend torch gives it
    (gloo), as upstream asks for it; gloo too for ranks that share a GPU (RANKS_SHARE_GPU)."""
    if device.type == "cuda" and not ranks_share_gpu():
        return f"cuda:{dist.get_default_backend_for_device(device)},cpu:gloo"
    return "gloo"


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> DistEnv:
    """Join the process group: NCCL (plus gloo) with CUDA, else gloo; one device per rank.

    timeout_s bounds how long a collective waits for the slowest rank, for example the other ranks
    waiting in the next collective while rank 0 alone writes a large snapshot to S3.
    """
    launched = launched_by_torchrun()
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
    device = _pick_device(local_rank, local_world_size)
    backend = backend_for(device)
    options = {"timeout": timedelta(seconds=timeout_s),
               "device_id": device if "nccl" in backend else None}  # binds NCCL to this GPU
    if launched:
        dist.init_process_group(backend, **options)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        device=device,
        backend="nccl" if "nccl" in backend else "gloo",
        timeout=options["timeout"],
    )


def gloo_interface() -> str:
    """The network interface gloo's groups use across machines, found the way gloo finds it: the one
    GLOO_SOCKET_IFNAME names, else the one holding the address this machine's hostname resolves to
    (loopback when it resolves to none, or to loopback: then other machines cannot reach it)."""
    named = os.environ.get("GLOO_SOCKET_IFNAME")
    if named:
        return f"{named} (GLOO_SOCKET_IFNAME)"
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = "127.0.0.1"
    interface = next((name for name, addresses in psutil.net_if_addrs().items()
                      if any(a.address == address for a in addresses)), "?")
    warning = (": other machines cannot reach it, set GLOO_SOCKET_IFNAME"
               if ipaddress.ip_address(address).is_loopback else "")
    return f"{interface} ({address}, the address of hostname {host}{warning})"


# torch gives a group made after init_process_group its own default timeout (30 minutes for gloo,
# 10 for NCCL), not the one the default group was given: every group the project makes comes from
# here, with the run's.

def side_group(env: DistEnv) -> dist.ProcessGroup:
    """A gloo group of every rank beside the default one, for collectives that must not queue
    behind (or interleave with) training's."""
    return dist.new_group(backend="gloo", timeout=env.timeout)


def grid_groups(env: DistEnv, rows: int, columns: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's row and column of the ranks laid out row by row in a rows x columns grid. Every
    rank takes part in making every group (torch requires it)."""
    grid = torch.arange(env.world_size).view(rows, columns)
    row, _ = dist.new_subgroups_by_enumeration(grid.tolist(), timeout=env.timeout)
    column, _ = dist.new_subgroups_by_enumeration(grid.t().tolist(), timeout=env.timeout)
    return row, column


@contextlib.contextmanager
def distributed_session(timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[DistEnv]:
    """Init the process group, and on the way out wait for every rank then tear it down.

    On an error the barrier is skipped (the other ranks may never reach it; torchrun stops them),
    so a failing rank exits at once instead of hanging. A user's error (MinGPTError) that every rank
    meets alike is said once (say_once).
    """
    env = init_distributed(timeout_s)
    try:
        yield env
        dist.barrier()
    except MinGPTError as error:
        say_once(error, origin=f"[rank {env.rank}] " if env.rank else "")
        raise
    except (dist.DistError, RuntimeError) as error:  # most often a lost peer: asked while the store is up
        error.said_elsewhere = an_error_was_said()
        raise
    finally:
        # Free what the session built (FSDP keeps tensors referenced by gloo's pending work) while
        # the process group and the interpreter are alive: freed later, at interpreter shutdown,
        # they can abort the process ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


SAY_TIMEOUT = timedelta(seconds=10)
"""How long a silent rank waits for the one saying an error before it exits anyway."""
SPEAKER_GRACE = timedelta(seconds=2)
"""How long a rank other than 0 leaves rank 0 to claim an error they both meet (the same data, the
same snapshot: met within milliseconds of each other) before it claims it itself."""
SAID_LATENCY = timedelta(seconds=1)
"""Beyond the speaker's grace, how long a rank that lost contact waits to hear that its peer said the
run's error (the peer claims it, then says it)."""
SAID = "mingpt/said/any"
"""Set in the store once a rank has said a user's error: the run's one line."""


def say_once(error: MinGPTError, origin: str) -> None:
    """Say a user's error that every rank may meet alike (bad data, a damaged snapshot) once.

    Rank 0 says it when it meets it too, as the README promises (and as a one-process run would);
    an error rank 0 does not meet is said by the first other rank to claim it (speaker_of). The
    speaker marks it said; the others wait for that mark before exiting, since a rank that exits
    first has torchrun stop the rest, the speaker perhaps before it has spoken. A rank that cannot
    reach the store says it itself: twice beats never."""
    error.origin = origin
    if dist.get_world_size() == 1:
        return  # the command's shell says it (errors.command)
    key = "mingpt/said/" + hashlib.sha256(str(error).encode()).hexdigest()[:16]
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(SAY_TIMEOUT)
        speaking = speaker_of(store, key, dist.get_rank()) == dist.get_rank()
    except Exception:  # the store's host is gone (it failed first): nothing to agree with
        return
    if speaking:
        say_error(error, origin)
    error.said = True
    with contextlib.suppress(Exception):  # a speaker that has gone has said it, or never will
        if speaking:
            store.set(f"{key}/said", "1")
            store.set(SAID, "1")
        else:
            store.wait([f"{key}/said"])


def speaker_of(store: dist.Store, key: str, rank: int) -> int:
    """The rank that says the error of key: rank 0 claims it at once; another rank first leaves
    rank 0 SPEAKER_GRACE to claim it (a wait only an error rank 0 does not meet runs to its end).
    One claim wins: compare_set's answer is the winner's number, never taken for a win by a loser."""
    claim = f"{key}/speaker"
    if rank != 0:
        with contextlib.suppress(Exception):  # not claimed in time: this rank claims it
            store.wait([claim], SPEAKER_GRACE)
    return int(store.compare_set(claim, "", str(rank)))


TIMEOUT_KEY = "trainer_config.process_group_timeout_s"
COLLECTIVE_TIMEOUTS = re.compile(
    r"Timed out waiting \d+ms for (recv|send) operation"  # gloo
    r"|Watchdog caught collective operation timeout|timed out in blocking wait")  # NCCL's two modes
"""How gloo and NCCL say that a collective waited its whole timeout for another rank."""
LOST_PEER_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def peer_failure(error: Exception, timeout_s: float) -> "str | None":
    """What a failed collective says of the other ranks, in one line, or None for an error of this
    rank's own: another rank stopped answering for the whole timeout (gloo's `Timed out waiting
    60000ms for recv operation`, NCCL's `Watchdog caught collective operation timeout`), or went away
    (NCCL's and gloo's plain errors)."""
    if COLLECTIVE_TIMEOUTS.search(str(error)):
        return (f"a collective timed out: another process stopped answering for {timeout_s:g} s "
                f"({TIMEOUT_KEY}={timeout_s:g}): it hung, was stopped or fell far behind; see the other "
                "processes' output and hosts (trainer_config.hang_timeout_s, when shorter, names the "
                f"rank), or raise {TIMEOUT_KEY} if a step can take that long (rank 0 writing a large "
                "snapshot alone, say)")
    if isinstance(error, dist.DistError) or any(sign in str(error) for sign in LOST_PEER_SIGNS):
        return f"lost contact with another process ({short_reason(error)}); see that process's output"
    return None


def mark_said() -> None:
    """Mark the run's one line said (by a rank that ends the run itself: the watchdog), so that the
    ranks that then lose contact with it keep quiet."""
    with contextlib.suppress(Exception):  # no process group, or its store gone: nobody to tell
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(SAY_TIMEOUT)
        store.set(SAID, "1")


def an_error_was_said() -> bool:
    """Whether a rank has said a user's error (say_once); asked by a rank whose collective failed,
    while its store is still up. That error ended the run: the rank only lost contact with the one
    that said it, and keeps quiet (said_elsewhere). The one that met it may still be giving rank 0
    its grace (speaker_of): it is waited for that long, and a little more."""
    if dist.get_world_size() == 1:
        return False
    with contextlib.suppress(Exception):  # the store's host is gone, or nobody said anything
        dist.distributed_c10d._get_default_store().wait([SAID], SPEAKER_GRACE + SAID_LATENCY)
        return True
    return False


def said_elsewhere(error: BaseException) -> bool:
    """A failed collective's error after another rank had said a user's error (distributed_session)."""
    return getattr(error, "said_elsewhere", False)


def said_by_local_rank_zero() -> bool:
    """For an error every process of a machine meets before any process group exists (the same
    command line everywhere): whether this process leaves it to local rank 0 of its launcher, and has
    waited for that process to end (exiting first, it would have the launcher stop the speaker before
    it has spoken). Local rank 0 itself, or a process no launcher started, says it (False). A local
    rank 0 that cannot be found has ended already: it met the same line first and said it."""
    if os.environ.get("LOCAL_RANK", "0") == "0" or not launched_by_torchrun():
        return False
    speaker = local_rank_zero()
    if speaker is not None:
        psutil.wait_procs([speaker], timeout=SAY_TIMEOUT.total_seconds())
    return True


def local_rank_zero() -> "psutil.Process | None":
    """The worker of this process's torchrun agent that has LOCAL_RANK=0, if there is one."""
    with contextlib.suppress(psutil.Error):
        for sibling in psutil.Process().parent().children():
            with contextlib.suppress(psutil.Error):
                if sibling.environ().get("LOCAL_RANK") == "0":
                    return sibling
    return None


def barrier() -> None:
    dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks, in place, and return it."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def any_rank(flag: bool) -> bool:
    """Whether flag holds on any rank; every rank gets the same answer."""
    return bool(all_reduce_sum(torch.tensor([int(flag)]))[0])


def rank_zeros(values: list[float]) -> list[float]:
    """Global rank 0's values, on every rank (what every rank says alike, rank 0's log says)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


def first_said(message: "str | None") -> "str | None":
    """The first rank's message that is not None (an error one rank met), on every rank; a world of
    one (or code run outside a process group) asks nobody."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return message
    return next((said for said in all_gather_objects(message) if said is not None), None)


def all_gather_objects(obj: object) -> list:
    """Every rank's obj, in rank order, on every rank."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
