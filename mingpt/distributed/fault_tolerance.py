"""Keep training through a lost replica group: step-level fault tolerance on torchft.

A fault-tolerant run (fault_tolerance_config.enabled=true) is several replica groups, each one
torchrun of one or more ranks (DDP among them on the usual process group, or HSDP: the model sharded
within the group, and within each of its nodes if it spans several), which torchft's Manager joins
into one data-parallel run:

- torchft's lighthouse (one process the user starts, or launch.py --replica-groups) forms a quorum of
  the live groups at every step. Rank r of each group averages its gradients with rank r of every
  other group in the quorum on a torchft process group, remade whenever the quorum changes: DDP's
  communication hook (average_gradients) reduces within the group, then across groups; under HSDP,
  FSDP's all-reduce hook (Replicas.average_shard) averages each reduced shard across groups, rank r
  of every group holding the same shard.
- A step's update is applied only when its group commits it (Manager.should_commit, behind the
  optimizer: CommittingOptimizer). A group lost in the middle of a step fails that step's collective
  in the survivors, who drop the update (as a GradScaler drops an overflowing step: the step counts,
  its weights do not change) and go on without the group from the next quorum. A dead group is given
  up when the lighthouse stops hearing its heartbeat (5 s by default), a silent one after
  timeout_s.
- A group that (re)joins heals at its first step boundary from a live group's state (model,
  optimizer, grad scaler, Progress), fetched over HTTP from that group through the Manager's
  state_dict/load_state_dict callbacks, rather than going back to the last snapshot.

The global sample order stays the one of a whole run: each epoch's order is dealt to replica groups x
ranks per group slots (data_env), rank r of group g reading slot g x ranks + r, whether or not every
group is there. A missing group's slots are skipped, not handed to the others, so a group that
rejoins continues at the run's position; the samples a missing group would have trained (and a whole
step's, when it is not committed) are counted into the metrics ("missed" lines). Snapshots are
written by the lowest-numbered group in the quorum (its rank 0), so that they go on when any group is
lost, and a run that loses every group resumes from them as any run does.

One voice: the lowest-numbered group of the quorum (the snapshot writer) says the run's lines, as
global rank 0 does in a run without the mode; the others say only their warnings and errors and what
happens to them alone (healing). A group that comes back after a failure stays quiet until its first
quorum, so its start-up ("Training model from scratch", the summary) is not said before it heals.

The lighthouse is part of the run: a group waiting for a quorum watches it, and one that is gone (its
port refuses connections, or stays silent for timeout_s) ends the wait at once, since a quorum
request in flight would otherwise wait out the whole quorum_timeout_s: the group then stops with
a snapshot as on a stop signal (the step under way is not committed), and says why.

torchft is an optional dependency (the `ft` extra, which pins the torchft this module is written
against); nothing here imports it until the mode is on. Its optimizer wrapper is subclassed
(CommittingOptimizer); the few internals of torchft the mode reaches into are checked as each group
starts (COUPLINGS, check_torchft).
"""
import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import signal
import socket
import sys
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from mingpt.common.errors import ConfigError, MinGPTError, check
from mingpt.common.logger import log
from mingpt.distributed.process_group import DistEnv

FT_EXTRA = "pip install -e '.[ft]' (torchft)"
TORCHFT_VERSION = "0.2.0"
"""The torchft this module is written against (pyproject.toml's ft extra pins it): besides its public
API, the mode reaches into a few of its internals (COUPLINGS), which each group checks at its start."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's own variable for the lighthouse's address, read when fault_tolerance_config.lighthouse is empty."""
SECTION = "fault_tolerance_config"
KEY = f"{SECTION}.enabled"
RESTART_ENV = "MINGPT_RESTART"
"""How many times launch.py has started this process's workers again after a failure (torchrun's own
restarts count in TORCHELASTIC_RESTART_COUNT)."""

def torchft_installed() -> bool:
    return importlib.util.find_spec("torchft") is not None


def speaks_at_start(settings: "FaultToleranceConfig") -> bool:
    """Whether this group is the run's voice from its start, until the first quorum says which group it
    is: group 0 on a fresh start. A group that comes back after a failure is quiet until then: it heals
    from a live group (and says so), or says how it goes on."""
    return settings.replica_group == 0 and not restarted()


def speak(voice: bool, env: DistEnv) -> None:
    """This group's rank 0 says the run's lines (the logger's INFO) only while the group is its voice;
    the other ranks never do, and every rank says its warnings and errors. Set first where the logger
    is (main.ddp_setup), before the start-up: every group prepares the same data and model and would
    say the same lines, which launch.py prints once, under whichever group said them first."""
    level = logging.INFO if voice else logging.WARNING
    if env.rank == 0 and log.level != level:  # at every quorum: setLevel clears every logger's cache
        log.setLevel(level)


def restarted() -> bool:
    """Whether this process's group was started again after a failure (by launch.py, or by torchrun)."""
    return any(int(os.environ.get(name) or 0) > 0 for name in (RESTART_ENV, "TORCHELASTIC_RESTART_COUNT"))


@dataclass
class FaultToleranceConfig:
    """fault_tolerance_config: training through a lost replica group (docs/distributed.md#fault-tolerance)."""

    enabled: bool = False
    """Keep training through a lost replica group (torchft): each torchrun is one replica group (ddp or
    hsdp among its ranks), the groups meet at torchft's lighthouse at every step, survivors go on without
    a lost group, and a group that comes back heals from a live one. Needs torchft (the ft extra);
    python launch.py --replica-groups N starts it all."""
    lighthouse: str = ""
    """The lighthouse's address, http://host:29510 (empty: $TORCHFT_LIGHTHOUSE)."""
    replica_group: int = 0
    """This replica group's number, 0 to replica_groups - 1."""
    replica_groups: int = 1
    """Replica groups in the run; each epoch's sample order is dealt to all of them, and a missing group's
    share is skipped (counted in the metrics), not given to the others."""
    min_replica_groups: int = 1
    """Train only while at least this many groups are live (the others wait)."""
    timeout_s: float = 30.0
    """How long a collective across groups waits for a silent group before its step is dropped (a killed
    group is noticed at once, a dead one within the lighthouse's heartbeat timeout), and how long a group
    waits for the lighthouse to answer before it says it cannot reach it; it must cover a joining group's
    healing, which the others wait for."""
    quorum_timeout_s: float = 300.0
    """How long a group waits at a step boundary for the quorum: the others' snapshot or evaluation, enough
    groups, the lighthouse (a lost lighthouse is said after it)."""

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        check(torchft_installed(), KEY, f"needs torchft, which is not installed: {FT_EXTRA}")
        check(self.replica_groups >= 1, f"{SECTION}.replica_groups", f"must be positive, got {self.replica_groups}")
        check(0 <= self.replica_group < self.replica_groups, f"{SECTION}.replica_group",
              f"must be 0 to {self.replica_groups - 1} (replica_groups={self.replica_groups}), got {self.replica_group}")
        check(1 <= self.min_replica_groups <= self.replica_groups, f"{SECTION}.min_replica_groups",
              f"must be 1 to replica_groups={self.replica_groups}, got {self.min_replica_groups}")
        check(self.timeout_s > 0, f"{SECTION}.timeout_s", f"must be positive, got {self.timeout_s}")
        check(self.quorum_timeout_s > 0, f"{SECTION}.quorum_timeout_s", f"must be positive, got {self.quorum_timeout_s}")

    def check_method(self, method: str) -> None:
        """fsdp leaves no replica to heal a lost rank's shards from (TrainConfig checks it)."""
        check(not self.enabled or method != "fsdp", "trainer_config.distributed_method",
              "fsdp shards every parameter over every rank, so no other replica holds a lost rank's shards "
              f"to heal it from; {KEY} needs replicas: use ddp, or hsdp (sharded within each replica "
              "group, the groups its replicas)")

    @property
    def follows(self) -> bool:
        """A replica group other than the first: group 0 holds the snapshot path's lease and the tracked
        runs, for the run as a whole."""
        return self.enabled and self.replica_group != 0

    def lighthouse_address(self) -> str:
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        check(bool(address), f"{SECTION}.lighthouse",
              f"needs the lighthouse's address (http://host:29510), or ${LIGHTHOUSE_ENV}; start one with "
              "torchft_lighthouse --min_replicas 1, or train with python launch.py --replica-groups N")
        return address if "://" in address else f"http://{address}"


class Replicas:
    """This replica group's part in a fault-tolerant run, or (`alone`) a run of one group: the
    Trainer calls the same methods either way, and alone they change nothing."""

    def __init__(self, settings: FaultToleranceConfig, env: DistEnv):
        self.settings, self.env = settings, env
        self.manager = None
        self.members: tuple[int, ...] = (settings.replica_group,)
        """The groups of the latest quorum."""
        self.committed = True
        """Whether the latest step's update was applied."""
        self._pending_quorum = False
        self._progress = None
        self._quorum_done_at = time.monotonic()
        self._first_quorum = True
        self._healed = False
        self._abandoned = False
        """The lighthouse went away during this step's quorum: the step is not committed, and no further
        quorum is asked for (torchft would wait for the one still in flight)."""

    @classmethod
    def open(cls, settings: FaultToleranceConfig, env: DistEnv) -> "Replicas":
        """This group's Manager, joined to the lighthouse (no quorum yet: join() forms the first)."""
        replicas = cls(settings, env)
        if settings.enabled:
            speak(speaks_at_start(settings), env)
            replicas._start_manager()
        return replicas

    @property
    def active(self) -> bool:
        return self.manager is not None

    @property
    def data_env(self) -> DistEnv:
        """This rank's place in the global sample order: its slot among every group's ranks."""
        if not self.active:
            return self.env
        size = self.env.world_size
        return dataclasses.replace(self.env, rank=self.settings.replica_group * size + self.env.rank,
                                   world_size=self.settings.replica_groups * size)

    @property
    def comm_hook(self) -> Optional[Callable[[nn.Module], None]]:
        """What makes the wrapped model average its gradients across groups too (parallel.parallelize
        calls it; None alone): DDP's communication hook, or under hsdp FSDP's all-reduce hook."""
        return self._average_gradients if self.active else None

    def _average_gradients(self, model: nn.Module) -> None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model.register_comm_hook(GradientAverage(self, model.module), average_gradients)
            return
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(self.average_shard)

    def average_shard(self, shard: torch.Tensor) -> None:
        """FSDP's all-reduce hook under hsdp: each FSDP unit's gradient shard, reduced within the group
        (and across its nodes), averaged with the same shard of every group in the quorum as the
        backward pass goes (rank r of each group holds the same shard); zeroed when that fails."""
        self.manager.allreduce(shard).wait()
        if self.manager.errored():
            shard.zero_()

    def method_within_group(self, method: str) -> str:
        """How the group's own ranks hold the model: under hsdp the groups are the replicas, so a
        group on one machine shards over all its ranks (fsdp's layout), one on several machines is an
        HSDP of its own (sharded within each machine, replicated across them)."""
        if self.active and method == "hsdp" and self.env.world_size == self.env.local_world_size:
            return "fsdp"
        return method

    def committing(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return committing_optimizer(optimizer, self) if self.active else optimizer

    def _start_manager(self) -> None:
        quiet_torchft()  # before torchft is imported: its Rust core reads RUST_LOG then
        settings, env = self.settings, self.env
        self.lighthouse = settings.lighthouse_address()
        self._await_lighthouse()
        host, port, self._store = group_store(env)
        self.process_group = replica_process_group(env.device, timedelta(seconds=settings.timeout_s))
        try:
            # connect_timeout: a lighthouse that does not answer is said after timeout_s, not after
            # the quorum's timeout (which a restarted group would otherwise wait out with nothing there).
            self.manager = watched_manager(self)(
                pg=self.process_group, load_state_dict=None, state_dict=None, min_replica_size=settings.min_replica_groups,
                use_async_quorum=False, init_sync=False, replica_id=f"replica_{settings.replica_group}",
                timeout=timedelta(seconds=settings.timeout_s),
                quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
                connect_timeout=timedelta(seconds=settings.timeout_s),
                store_addr=host, store_port=port, rank=env.rank, world_size=env.world_size,
                lighthouse_addr=self.lighthouse, hostname=host)
        except TypeError as error:  # a torchft whose Manager takes other arguments, not a lost lighthouse
            raise ConfigError(KEY, needs_torchft(f"Manager's arguments ({error})")) from None
        except Exception as error:  # the lighthouse cannot be reached (torchft says it in many words)
            raise MinGPTError(lighthouse_lost(self.lighthouse, error, "start")) from None
        check_torchft(self.manager)  # before the first quorum, which the couplings take part in
        quiet_checkpoint_server(self.manager)
        log.info(f"Replicas: replica group {settings.replica_group} of {settings.replica_groups} ({env.world_size} rank(s) each), "
                 f"lighthouse {self.lighthouse}, training while {settings.min_replica_groups} or more are live; a group "
                 f"lost in a step costs that step, a silent one is given up after {settings.timeout_s:g} s "
                 "(fault_tolerance_config.timeout_s)")

    def keep(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler, progress) -> None:
        """What a joining group heals from a live one: the model, the optimizer (the plain one), the
        grad scaler and the Progress (updated in place: the Trainer holds it)."""
        self._progress = progress
        if not self.active:
            return
        optimizer = plain(optimizer)

        def state() -> dict[str, Any]:
            return {"model": local_shards(model.state_dict()), "optimizer": local_shards(optimizer.state_dict()),
                    "scaler": scaler.state_dict(), "progress": progress_fields(progress),
                    "group": self.settings.replica_group, "group_size": self.env.world_size}

        def heal(received: dict[str, Any]) -> None:
            check(received["group_size"] == self.env.world_size, KEY,
                  f"replica group {received['group']} has {received['group_size']} rank(s) and this one "
                  f"{self.env.world_size}; start every replica group with as many ranks")
            model.load_state_dict(as_sharded(received["model"], model.state_dict()))
            optimizer.load_state_dict(optimizer_state_sharded(received["optimizer"], optimizer))
            scaler.load_state_dict(received["scaler"])
            for name, value in received["progress"].items():
                setattr(progress, name, value)
            self._healed = True
            self._say(f"Healed from replica group {received['group']} at step {progress.step}: its model, "
                      "optimizer and position, fetched live, not the last snapshot", always=True)

        self.manager.register_state_dict_fn("training", heal, state)

    # A context around training (Trainer.train): the first quorum, in which this group heals if it
    # (re)joins a run under way, and the Manager's end.

    def __enter__(self) -> "Replicas":
        if self.active:
            self._quorum(say=False)
            self._gather_every_group()
            if restarted() and not self._healed and self.speaks:
                step = self._progress.step if self._progress is not None else 0
                where = f"the snapshot of step {step}" if step else "scratch"
                self._say(f"Replica group {self.settings.replica_group} came back with no live group to heal from: "
                          f"training goes on from {where}")
            self._say_membership(before=())
            self._pending_quorum = True  # the first step's: zero_grad starts none
        return self

    GATHER_POLL_S = 0.5

    def _gather_every_group(self) -> None:
        """At the run's start, wait (up to quorum_timeout_s) until every group is in the quorum:
        groups start at different speeds, and one ready first would otherwise train alone while the
        others import torch, their share of those steps skipped. A group that healed joins a run
        under way and goes on at once."""
        missing = set(range(self.settings.replica_groups)) - set(self.members)
        if self._healed or self._abandoned or not missing:
            return
        log.info(f"Waiting for replica group(s) {names(sorted(missing))} to start (at most "
                 f"{self.settings.quorum_timeout_s:g} s: fault_tolerance_config.quorum_timeout_s)")
        deadline = time.monotonic() + self.settings.quorum_timeout_s
        while (len(self.members) < self.settings.replica_groups and not self._healed and not self._abandoned
               and time.monotonic() < deadline):
            time.sleep(self.GATHER_POLL_S)
            self._quorum(say=False)

    def __exit__(self, *exc_info) -> None:
        if self.active:
            if self._abandoned:
                end_quorum_request(self.manager)
            self.manager.shutdown(wait=False)

    def start_step(self) -> None:
        """A step begins (the optimizer's zero_grad): the quorum of the groups that take it."""
        if self._pending_quorum:
            self._pending_quorum = False
            return
        self._quorum()

    def _quorum(self, say: bool = True) -> None:
        if self._abandoned:  # the stop the lost lighthouse asked for did not end the run
            raise MinGPTError(lighthouse_lost(self.lighthouse, LighthouseGone(), f"step {self._next_step()}"))
        try:
            self.manager.start_quorum()
        except LighthouseGone as gone:
            self._lighthouse_gone(gone)
            return
        except Exception as error:
            raise MinGPTError(self._no_quorum(error)) from None
        before, self.members = self.members, self.process_group.members or self.members
        speak(self.speaks, self.env)
        if say:
            self._say_membership(before)
        self._quorum_done_at = time.monotonic()

    WATCH_S = 0.5
    """How often a group waiting for its quorum looks at the lighthouse."""

    def _await_lighthouse(self) -> None:
        """At the start, the lighthouse answering within timeout_s, or the group says so (torchft's own
        connection, with its backoff, would take up to twice as long to give up)."""
        deadline = time.monotonic() + self.settings.timeout_s
        while (answer := lighthouse_answer(self.lighthouse)) != "up":
            if time.monotonic() >= deadline:
                raise MinGPTError(lighthouse_lost(self.lighthouse, LighthouseGone(answer), "start"))
            time.sleep(self.WATCH_S)
    REFUSALS = 2
    """Refused connections in a row that make a lighthouse gone (nothing listens at its port)."""

    def wait_for_quorum(self, quorum: concurrent.futures.Future) -> None:
        """The Manager's wait for a quorum (WatchedManager), watching the lighthouse meanwhile: a request
        in flight when it dies is never answered (nor by a lighthouse started again), and torchft would
        wait out quorum_timeout_s. Gone: its port refuses twice in a row, or is silent (a machine
        gone) for timeout_s."""
        refusals, silent_since = 0, None
        while not concurrent.futures.wait([quorum], timeout=self.WATCH_S).done:
            answer = lighthouse_answer(self.lighthouse)
            if answer == "up":
                refusals, silent_since = 0, None
                continue
            refusals = refusals + 1 if answer == "refused" else 0
            silent_since = (silent_since or time.monotonic()) if answer == "silent" else None
            if refusals >= self.REFUSALS or (silent_since and time.monotonic() - silent_since >= self.settings.timeout_s):
                raise LighthouseGone(answer)
        quorum.result()  # its own error, if it failed

    def _lighthouse_gone(self, gone: "LighthouseGone") -> None:
        """No quorum can form: this step is not committed (its collectives are skipped), and the group
        stops at its end with a snapshot, through the stop signal's own path, as every other group does."""
        self._abandoned = True
        self.manager.report_error(gone)
        number = handled_stop_signal()
        where = f"step {self._next_step()}"
        if number is None:  # no stop signal to take (trainer_config.stop_signals=[]): the last snapshot stays
            raise MinGPTError(lighthouse_lost(self.lighthouse, gone, where))
        self._say(f"The lighthouse at {self.lighthouse} is gone ({gone.how}, {where}): no quorum forms without it, "
                  f"so every replica group stops with a snapshot (as on {signal.Signals(number).name}); start it "
                  "again (torchft_lighthouse --bind ... --min_replicas N, as launch.py printed it), then the "
                  "replica groups: they resume from the snapshot", always=True)  # each group's own stop
        os.kill(os.getpid(), number)

    @property
    def speaks(self) -> bool:
        """Whether this group is the run's voice: the lowest-numbered of the latest quorum, the one that
        writes the snapshots (before any quorum, see open)."""
        return self.snapshot_writer() == self.settings.replica_group

    def _say(self, line: str, always: bool = False) -> None:
        """A line of the run (its voice says it), or `always`: one about this group alone."""
        if always and self.env.rank == 0 and not log.isEnabledFor(logging.INFO):
            log.setLevel(logging.INFO)
            try:
                log.info(line)
            finally:
                log.setLevel(logging.WARNING)
        else:
            log.info(line)

    def _no_quorum(self, error: Exception) -> str:
        address = self.settings.lighthouse_address()
        if not reachable(address):
            return lighthouse_lost(address, error, f"step {self._next_step()}")
        return (f"no quorum of {self.settings.min_replica_groups} or more replica groups within "
                f"{self.settings.quorum_timeout_s:g} s at step {self._next_step()} "
                "(fault_tolerance_config.quorum_timeout_s, min_replica_groups); start the missing groups, "
                f"or raise the timeout if a step boundary (an evaluation, a snapshot) takes longer ({error})")

    def _say_membership(self, before: tuple[int, ...]) -> None:
        """A line when groups leave or join (the first quorum: which groups train), said by the voice of
        the run before the change and by the one after it (a voice lost, or one handing over)."""
        step, groups, now = self._next_step(), self.settings.replica_groups, self.members
        training = f"{names(now)} ({len(now)} of {groups})"
        if self._first_quorum:
            self._first_quorum = False
            if not self._healed and not self._abandoned:  # a healed group said so; the others that it joined
                self._say(f"Replica groups {training} train from step {step}")
            return
        was_voice = bool(before) and min(before) == self.settings.replica_group
        left, joined = sorted(set(before) - set(now)), sorted(set(now) - set(before))
        if left:
            stall = time.monotonic() - self._quorum_done_at
            self._say(f"Replica group(s) {names(left)} left at step {step}: going on with {training} after a stall "
                      f"of {stall:.1f} s (the lost step and the wait for a quorum without them); their share of "
                      "each step is skipped until they are back, and counted (metrics: missed)", always=was_voice)
        if joined:
            self._say(f"Replica group(s) {names(joined)} joined at step {step}, healed from a live group: "
                      f"training with {training}", always=was_voice)

    def commit(self) -> bool:
        """Whether this step's update is applied: every rank of the group agrees the step was sound
        (no collective failed), with enough groups (Manager.should_commit)."""
        if self._abandoned:  # no quorum, nothing to agree on: the lighthouse's loss is said already
            self.committed = False
            return False
        self.committed = self.manager.should_commit()
        if not self.committed:
            log.info(f"Step {self._next_step()} not committed: a replica group was lost during it (or too "
                     "few are live); its update is dropped and training goes on")
        return self.committed

    def step_taken(self, samples_per_slot: int) -> int:
        """The samples of this step's global order nobody trained: a missing group's slots, or all of
        them when the step was not committed."""
        if not self.active:
            return 0
        slots = self.settings.replica_groups * self.env.world_size
        if not self.committed:
            return slots * samples_per_slot
        return (self.settings.replica_groups - len(self.members)) * self.env.world_size * samples_per_slot

    def snapshot_writer(self) -> int:
        """The group that writes the snapshots: the lowest-numbered of the quorum (one writer; any group
        may be lost); alone, this group."""
        return min(self.members) if self.active else self.settings.replica_group

    def writes_snapshots(self) -> bool:
        return self.snapshot_writer() == self.settings.replica_group

    def _next_step(self) -> int:
        return (self._progress.step if self._progress is not None else 0) + 1


class LighthouseGone(Exception):
    """The lighthouse went away while this group waited for a quorum."""

    def __init__(self, answer: str = "refused"):
        super().__init__(answer)
        self.how = "its port refuses connections" if answer == "refused" else "it does not answer"


def watched_manager(replicas: Replicas) -> type:
    """torchft's Manager, its wait for a quorum replicas' own (Replicas.wait_for_quorum): a subclass made
    once torchft is imported, which the mode alone does. A coupling (COUPLINGS): torchft's start_quorum
    waits through wait_quorum, on the future it keeps in _quorum_future."""
    from torchft import Manager

    class WatchedManager(Manager):
        def wait_quorum(self) -> None:
            replicas.wait_for_quorum(self._quorum_future)

    return WatchedManager


def end_quorum_request(manager) -> None:
    """End the quorum request that torchft's thread still waits on after the lighthouse went away: its
    group's manager server never answers a request whose lighthouse call failed (it waits out
    quorum_timeout_s), and Python's exit would wait for that thread. Shut down, this process's
    connections to the manager server fail the request at once. A coupling (COUPLINGS): the server's
    address is read where the Manager keeps it, under MANAGER_ADDR_KEY in its _store."""
    import psutil
    from torchft.manager import MANAGER_ADDR_KEY

    port = urllib.parse.urlparse(manager._store.get(MANAGER_ADDR_KEY).decode()).port
    for connection in psutil.Process().net_connections(kind="tcp"):
        if connection.raddr and connection.raddr.port == port and connection.fd >= 0:
            with contextlib.suppress(OSError), socket.fromfd(connection.fd, connection.family, socket.SOCK_STREAM) as end:
                end.shutdown(socket.SHUT_RDWR)  # on a copy of the descriptor: the socket is torchft's


def handled_stop_signal() -> Optional[int]:
    """A stop signal this process handles (the training's own handler: a snapshot, then a clean stop),
    SIGTERM first; None when none is (trainer_config.stop_signals=[]). Ctrl-C's is left out: a second
    one quits without a snapshot."""
    for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        if callable(signal.getsignal(number)):
            return int(number)
    return None


def committing_optimizer(optimizer: torch.optim.Optimizer, replicas: "Replicas") -> torch.optim.Optimizer:
    """The run's optimizer, stepping only the updates the replica groups commit (Replicas.committing)."""
    return committing_optimizer_class()(optimizer, replicas)


def _the_optimizers(name: str) -> property:
    """An attribute of the wrapped optimizer, read, written and deleted through the wrapper."""
    return property(lambda wrapper: getattr(wrapper.optim, name),
                    lambda wrapper, value: setattr(wrapper.optim, name, value),
                    lambda wrapper: delattr(wrapper.optim, name))


@functools.cache
def committing_optimizer_class() -> type:
    """CommittingOptimizer, made once torchft is imported (which the mode alone does)."""
    from torchft import Optimizer

    class CommittingOptimizer(Optimizer):
        """torchft's optimizer wrapper (torchft.Optimizer, torchtitan's): zero_grad starts a step's
        quorum, step applies the update only if it is committed; the optimizer's param_groups, state and
        state_dict are its own, so the learning rates and the grad scaler see it as it is. Snapshots are
        taken of the plain optimizer (plain()), since torch's state-dict API may step an optimizer to
        initialise its state. Three things more than torchft's:

        - the quorum and the commit are Replicas' (start_step, commit), not the Manager's alone: the
          first step's quorum is the one formed on entering training (a joining group heals in it), a
          lighthouse gone during a quorum stops the group with a snapshot and leaves its step
          uncommitted, groups that leave or join are said, and a dropped step is counted as missed;
        - step passes its arguments to the optimizer's step and returns its result (torchft's takes
          none and asserts there is no closure);
        - what GradScaler reads of a fused optimizer (whether it unscales in its own kernel) is read
          from the optimizer, and what it writes for it (grad_scale, found_inf) is written to it: on
          torchft's wrapper they stay on the wrapper, and a fused step then applies an overflowing
          fp16 update, infinities and all, where a plain run skips it."""

        def __init__(self, optimizer: torch.optim.Optimizer, replicas: "Replicas"):
            super().__init__(replicas.manager, optimizer)  # a view: Optimizer.__init__ is not called
            self.replicas = replicas

        def zero_grad(self, set_to_none: bool = True) -> None:
            self.replicas.start_step()
            self.optim.zero_grad(set_to_none=set_to_none)

        def step(self, closure=None, **kwargs):
            if self.replicas.commit():
                return self.optim.step(closure, **kwargs)
            return None

        grad_scale = _the_optimizers("grad_scale")
        found_inf = _the_optimizers("found_inf")

        def __getattr__(self, name: str) -> Any:  # what GradScaler asks of a fused optimizer, say
            try:
                optimizer = self.__dict__["optim"]
            except KeyError:  # being made or copied: nothing to read through yet
                raise AttributeError(name) from None
            return getattr(optimizer, name)

    return CommittingOptimizer


def plain(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer inside a CommittingOptimizer (any torchft optimizer wrapper), or itself. torchft is
    not imported for this: before the mode imports it, no wrapper exists."""
    torchft = sys.modules.get("torchft")
    if torchft is not None and isinstance(optimizer, torchft.Optimizer):
        return optimizer.optim
    return optimizer


class GradientAverage:
    """DDP's communication hook under fault tolerance: the step's gradients averaged over this
    group's ranks (the usual process group), then over the groups of the quorum (torchft's process
    group, whose all-reduce divides by the groups taking part).

    Once per step, over every gradient at once, in the model's parameter order: DDP's buckets hold
    the gradients in the order they were ready in its first step (it rebuilds them then), which a
    group that joins later has not yet done, so buckets cannot be matched across groups. Each bucket
    is copied into one flat buffer as DDP hands it over; the last one (DDP hands them over in order)
    reduces the buffer and answers every bucket. A collective that fails across groups is not raised:
    the Manager notes it, the gradients are zeroed (torchft leaves them half-reduced) and the step is
    not committed."""

    def __init__(self, replicas: "Replicas", model: nn.Module):
        self.replicas = replicas
        self.slices: dict[torch.Tensor, slice] = {}
        offset = 0
        for param in model.parameters():
            if param.requires_grad:
                self.slices[param] = slice(offset, offset + param.numel())
                offset += param.numel()
        first = next(iter(self.slices))
        self.flat = torch.empty(offset, dtype=first.dtype, device=first.device)
        self.waiting: list[tuple[dist.GradBucket, torch.futures.Future]] = []

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future:
        for param, gradient in zip(bucket.parameters(), bucket.gradients()):
            self.flat[self.slices[param]].copy_(gradient.view(-1))
        future = torch.futures.Future(devices=[self.flat.device] if self.flat.is_cuda else None)
        self.waiting.append((bucket, future))
        if bucket.is_last():
            self._reduce()
        return future

    def _reduce(self) -> None:
        group_size = self.replicas.env.world_size
        if group_size > 1:
            dist.all_reduce(self.flat.div_(group_size))
        manager = self.replicas.manager
        manager.allreduce(self.flat).wait()
        if manager.errored():
            self.flat.zero_()
        waiting, self.waiting = self.waiting, []
        for bucket, future in waiting:
            for param, gradient in zip(bucket.parameters(), bucket.gradients()):
                gradient.view(-1).copy_(self.flat[self.slices[param]])
            future.set_result(bucket.buffer())


def average_gradients(average: GradientAverage, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The hook DDP calls (it asks for a function of this signature): GradientAverage does the work."""
    return average(bucket)


def replica_process_group(device: torch.device, timeout: timedelta):
    """torchft's process group across groups (NCCL for GPUs, gloo for CPUs), noting each quorum's
    groups as the Manager remakes it (configure's global ranks: group x ranks per group + rank). A
    coupling (COUPLINGS): the override takes configure's parameters as torchft's Manager passes them."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    base = ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo

    class AcrossGroups(base):
        members: tuple[int, ...] = ()

        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None,
                      group_world_size=None, global_ranks=None) -> None:
            if global_ranks is not None and group_world_size:
                self.members = tuple(sorted({global_rank // group_world_size for global_rank in global_ranks}))
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
                              group_world_size, global_ranks)

    return AcrossGroups(timeout=timeout)


def group_store(env: DistEnv) -> tuple[str, int, Optional[dist.TCPStore]]:
    """A TCPStore of this group's own for its Manager, served by its rank 0 (a fresh one each
    attempt: torchrun's store outlives a restart, and a stale Manager address in it would be read);
    its host and port, shared over the group."""
    host = socket.gethostname()
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if env.rank == 0 else None
    where = [host, store.port if store is not None else 0]
    if env.world_size > 1:
        dist.broadcast_object_list(where, src=0)
    return where[0], int(where[1]), store


def lighthouse_answer(address: str, timeout_s: float = 2.0) -> str:
    """"up" when something listens at the lighthouse's port, "refused" when nothing does (the process is
    gone, its machine is not), "silent" when the connection does not come (a machine or network gone)."""
    parsed = urllib.parse.urlparse(address)
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=timeout_s).close()
        return "up"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"


def reachable(address: str) -> bool:
    return lighthouse_answer(address) == "up"


def lighthouse_lost(address: str, error: Exception, when: str) -> str:
    return (f"cannot reach the lighthouse at {address} ({when}); start it again (torchft_lighthouse "
            "--bind ... --min_replicas N, as launch.py printed it) and restart the replica groups: they resume "
            f"from the newest snapshot ({type(error).__name__})")


def local_shards(state: Any) -> Any:
    """A state dict as it travels to a healing group: under hsdp each DTensor as this rank's shard
    (rank r of the other group holds the same one), plain tensors as they are."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {key: local_shards(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_shards(value) for value in state)
    return state


def as_sharded(received: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """Received local shards as DTensors laid out as the live state's (which load_state_dict expects
    under hsdp); plain tensors as they came."""
    from torch.distributed.tensor import DTensor

    def like(value: Any, model: Any) -> Any:
        if isinstance(model, DTensor) and not isinstance(value, DTensor):
            return DTensor.from_local(value.to(model.device), model.device_mesh, model.placements,
                                      run_check=False, shape=model.shape, stride=model.stride())
        return value

    return {key: like(value, live.get(key)) for key, value in received.items()}


def optimizer_state_sharded(received: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's received state, each parameter's tensors laid out as the parameter (a joining
    group's optimizer may hold no state yet to copy the layout from); its step counters as they came."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    state = {index: as_sharded(values, {name: params[index] for name, value in values.items()
                                        if torch.is_tensor(value) and value.dim() > 0})
             for index, values in received["state"].items()}
    return {**received, "state": state}


def names(groups) -> str:
    return ", ".join(str(group) for group in groups)


def progress_fields(progress) -> dict[str, Any]:
    """Progress's position, a copy (the live object moves on while the state is sent)."""
    return {field.name: getattr(progress, field.name) for field in dataclasses.fields(progress)
            if field.name != "tracked_runs"}


def quiet_checkpoint_server(manager) -> None:
    """torchft serves a healing group the state over HTTP with http.server's handler, which prints
    an access line on stderr for every request; this module says the healing in its own line. (The
    handler is reached through the transport's server, a coupling: a torchft that keeps it elsewhere
    was warned of at the start, and keeps the access line, nothing worse.)"""
    with contextlib.suppress(AttributeError):
        _checkpoint_handler(manager).log_message = lambda *args: None


def quiet_torchft() -> None:
    """torchft speaks for itself at every quorum (Python's logging and its Rust core's): this module
    says what a user needs in its own lines, so only torchft's errors that end a run are let through."""
    os.environ.setdefault("RUST_LOG", "error")
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    # A healing group reads tensors out of the received bytes, which torch warns are not writable.
    warnings.filterwarnings("ignore", message="The given buffer is not writable",
                            module=r"torch\.distributed\._serialization")


# -- torchft's internals -------------------------------------------------------------------------------
# What the mode needs beyond torchft's public API (the Manager's methods, its process groups and
# optimizer wrapper): each place it reaches into torchft is a Coupling, checked when a group starts, so
# that a torchft that moved one is refused in one line naming the version the mode needs, rather than
# training on without what the coupling gave (tests/distributed/test_fault_tolerance_ft.py runs each
# against the installed torchft).

CONFIGURE_PARAMETERS = ("self", "store_addr", "replica_id", "rank", "world_size", "quorum_id", "group_rank",
                        "group_world_size", "global_ranks")
"""ProcessGroupGloo's and ProcessGroupNCCL's configure, as replica_process_group's override takes it and
as the Manager calls it (positionally, at every new quorum)."""


@dataclass(frozen=True)
class Coupling:
    """A place where this module reaches past torchft's public API."""

    reaches: str
    """What of torchft it reaches, as torchft's source names it."""
    gives: str
    """What it gives the run, which a torchft without it would take away."""
    holds: Callable[[Any], bool]
    """Whether the installed torchft has it, given a Manager just made."""
    needed: bool = True
    """Without it the mode is refused; one that only keeps torchft quiet is warned of instead."""


def _parameters(function: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


def _waits_through_wait_quorum(manager) -> bool:
    from torchft import Manager

    return _parameters(Manager.wait_quorum) == ("self",) and "_quorum_future" in vars(manager)


def _configure_takes_global_ranks(manager) -> bool:
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    return all(_parameters(base.configure) == CONFIGURE_PARAMETERS
               for base in (ProcessGroupGloo, ProcessGroupNCCL))


def _manager_address_in_store(manager) -> bool:
    import torchft.manager

    return (isinstance(getattr(torchft.manager, "MANAGER_ADDR_KEY", None), str)
            and callable(getattr(vars(manager).get("_store"), "get", None)))


def _checkpoint_handler(manager) -> type:
    return manager._checkpoint_transport._server.RequestHandlerClass


COUPLINGS = (
    Coupling("Manager.wait_quorum() over Manager._quorum_future",
             "the lighthouse watched while a quorum is awaited, so that a lost one is said within a second, "
             "not after quorum_timeout_s", _waits_through_wait_quorum),
    Coupling("ProcessGroupGloo.configure's and ProcessGroupNCCL.configure's parameters "
             f"({', '.join(CONFIGURE_PARAMETERS[1:])})", "which groups are in each quorum",
             _configure_takes_global_ranks),
    Coupling("Manager._store and torchft.manager.MANAGER_ADDR_KEY",
             "the quorum request still in flight when the lighthouse went away ended at once, not after "
             "quorum_timeout_s", _manager_address_in_store),
    Coupling("Manager._checkpoint_transport._server.RequestHandlerClass.log_message",
             "a healing group's transfers said in one line, without http.server's access lines",
             lambda manager: callable(_checkpoint_handler(manager).log_message), needed=False),
)


def check_torchft(manager) -> None:
    """At a group's start, once its Manager is made: a torchft that lacks a coupling the mode needs is
    refused in one line naming the torchft it needs (the Manager shut down first); one that lacks a
    coupling for quiet alone is warned of, and the run goes on."""
    broken = [coupling for coupling in COUPLINGS if not _holds(coupling, manager)]
    if not broken:
        return
    installed = torchft_version()
    needed = [coupling for coupling in broken if coupling.needed]
    if needed:
        manager.shutdown(wait=False)
        raise ConfigError(KEY, needs_torchft("; ".join(f"{coupling.reaches} (for {coupling.gives})"
                                                       for coupling in needed)))
    for coupling in broken:
        log.warning(f"torchft {installed} is not torchft {TORCHFT_VERSION}: it lacks {coupling.reaches}, "
                    f"so the run goes on without {coupling.gives}")


def needs_torchft(changed: str) -> str:
    return (f"needs torchft {TORCHFT_VERSION}, and torchft {torchft_version()} is installed, whose {changed} "
            f"changed: pip install torchft=={TORCHFT_VERSION} (the ft extra pins it)")


def torchft_version() -> str:
    try:
        return importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:  # a source tree on the path, not an installed package
        return "of unknown version"


def _holds(coupling: Coupling, manager) -> bool:
    try:
        return bool(coupling.holds(manager))
    except (AttributeError, ImportError, TypeError, ValueError):  # moved, renamed, or not a function any more
        return False
