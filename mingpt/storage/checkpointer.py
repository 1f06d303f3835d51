"""A training run's snapshots: when one is due, taking it, and resuming from the newest.

The Trainer asks `due()` at every step and epoch boundary, the one place that decides whether a
snapshot is due (the epoch cadence, every N steps, rank 0's timer and the stop signals as every
rank agreed on them in control.py, and the end of the run, whatever its budget: the original never
saved the epochs after the last multiple of save_every), and calls `save()`; a progress already
saved is never saved twice. A snapshot holds the model and optimizer state (single file or
sharded, store.py and sharded_store.py), the GradScaler's state, every rank's RNG states, the
vocabulary and the model's config. With async_snapshots the state is copied and written by a
background thread (background_save.py): `finish()` waits for it and raises on every rank if it
failed on any. `resume()` restores the newest snapshot, and the RNG states are put back when the
epoch it was taken in starts again (`restore_rng()`), so that a run resumed at the same world size
replays the unbroken run exactly.
"""
import contextlib
import threading
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn

from mingpt.common import files
from mingpt.common.errors import (
    KeyGroup,
    MinGPTError,
    SnapshotError,
    TrainingDiverged,
    check_choice,
    check_not_negative,
    check_positive,
    short_reason,
)
from mingpt.common.files import check_writable
from mingpt.common.logger import log, warn_once
from mingpt.distributed.control import Decision
from mingpt.distributed.divergence import Health
from mingpt.distributed.parallel import local_part, unwrap
from mingpt.distributed.process_group import DistEnv, all_gather_objects, any_rank, first_said, side_group
from mingpt.storage.background_save import BackgroundSaves
from mingpt.storage.lease import SnapshotLease
from mingpt.storage.sharded_store import ShardedSnapshotStore
from mingpt.storage.snapshot import TRAINING_KEY, Progress, Snapshot, snapshot_folder
from mingpt.storage.store import FullStateStore, SnapshotStore
from mingpt.tokens.sample_order import SampleOrder
from mingpt.tokens.tokenizer import Vocabulary

SNAPSHOT_FORMATS = ("single", "sharded")
RELEASE_WAIT_S = 10.0
OTHER_DATA_KEY = "trainer_config.resume_on_other_data"
LOWER_LEARNING_RATE = "with a lower optimizer_config.learning_rate (or a warmup: optimizer_config.warmup_steps)"


@dataclass
class SnapshotKeys(KeyGroup):
    """TrainerConfig's snapshot keys beyond the original's snapshot_path and save_every (trainer.py)."""

    save_every_steps: int = 0
    """Also write one every this many optimizer steps (0: only at epochs)."""
    save_every_minutes: float = 0.0
    """Also write one when this many minutes have passed since the last (0: off); rank 0's clock
    decides, for every rank at the same step."""
    keep_last: int = 3
    """Snapshot folders only: how many of the newest snapshots to keep."""
    snapshot_format: str = "single"
    """single: one file, gathered on rank 0. sharded: a folder, each rank writing its own shard (DCP)."""
    async_snapshots: bool = False
    """Training waits only while the state is copied to host memory (kept: one more copy of the
    state); a background thread writes it. A failed write stops every rank with its error."""
    resume_on_other_data: bool = False
    """Resume a snapshot trained on other data (another text or share of it, split, block size or
    seed: its sample order), on purpose: its weights, optimizer and step count go on, and this data's
    order starts at a new epoch. Off: such a resume is refused in one line naming what changed."""

    def __post_init__(self) -> None:
        check_positive(self, "trainer_config", "keep_last")
        check_not_negative(self, "trainer_config", "save_every_steps", "save_every_minutes")
        check_choice(self, "trainer_config", "snapshot_format", SNAPSHOT_FORMATS)
        super().__post_init__()  # the next group's checks (TrainerConfig's bases)


@dataclass(frozen=True)
class SnapshotPolicy:
    """Where snapshots go and when (TrainerConfig's snapshot keys)."""

    path: str
    snapshot_format: str = "single"
    keep_last: int = 3
    async_snapshots: bool = False
    every_epochs: int = 1
    every_steps: int = 0
    every_minutes: float = 0.0
    """Kept by rank 0's timer in control.StepAgreement; here only to name the reason."""
    resume_on_other_data: bool = False
    """Resume a snapshot whose sample order is not this run's (TrainerConfig's key), from a new epoch."""
    leased: bool = True
    """Rank 0 holds the path's lease (lease.py). Under fault tolerance replica group 0 alone does:
    the groups are one run, and whichever leads the quorum writes (distributed/fault_tolerance.py)."""


def open_snapshot_store(policy: SnapshotPolicy, env: DistEnv) -> SnapshotStore:
    """Every rank calls this, at the same point: a background sharded save gets a gloo group of its
    own, so that its collectives (DCP's planning) never interleave with training's on one group."""
    if policy.snapshot_format == "sharded":
        group = side_group(env) if policy.async_snapshots else None
        return ShardedSnapshotStore(policy.path, policy.keep_last, process_group=group)
    return FullStateStore(policy.path, policy.keep_last)


def training_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor training changes in place: parameters, buffers and the optimizer's state."""
    optimizer_state = [value for state in optimizer.state.values() for value in state.values()
                       if isinstance(value, torch.Tensor)]
    return [*model.parameters(), *model.buffers(), *optimizer_state]


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of this rank's part of the tensors is finite (one wait for the device)."""
    flags = [torch.isfinite(local_part(t)).all() for t in tensors if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


def capture_rng(device: torch.device) -> dict[str, Optional[torch.Tensor]]:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_states(state: dict[str, Optional[torch.Tensor]], device: torch.device,
                   fallback_seed: int) -> None:
    """Put the generators back as captured. A snapshot made on the CPU has no CUDA state: then
    this rank's own seed, never one shared by all ranks (every rank would drop the same units)."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda":
        if state["cuda"] is not None:
            torch.cuda.set_rng_state(state["cuda"], device)
        else:
            torch.cuda.manual_seed(fallback_seed)


@contextlib.contextmanager
def holding_the_path(policy: SnapshotPolicy, env: DistEnv) -> Iterator[Optional[SnapshotLease]]:
    """A run's hold on its snapshot path, from its start to its end (main.py's `with`; every rank
    enters it): rank 0 checks that the folder can be written and takes the path's lease (lease.py: one
    run per path), and every rank raises what it found (said once), before any rank reads a snapshot
    another run may be writing. However the run ends, the lease goes on the way out, so that the next
    run takes the path at once (a store that has stopped answering gets RELEASE_WAIT_S: the lease then
    goes stale, and the process must end). Yields rank 0's lease (None on the other ranks)."""
    lease = SnapshotLease(policy.path) if env.is_main and policy.leased else None
    refusal = None
    if env.is_main:
        try:
            check_writable(snapshot_folder(policy.path), TRAINING_KEY)
            if lease is not None:
                lease.acquire()
        except MinGPTError as error:
            refusal = str(error)
    refusal = first_said(refusal)
    if refusal:
        raise SnapshotError(refusal)
    try:
        yield lease
    finally:
        if lease is not None:
            in_the_background(lease.release)


def in_the_background(work: Callable[[], None]) -> None:
    """work on a thread of its own, waited for RELEASE_WAIT_S at most; its failure unsaid (the run's
    own error, if any, is the one to say)."""
    def quietly() -> None:
        with contextlib.suppress(Exception):
            work()

    thread = threading.Thread(target=quietly, daemon=True)
    thread.start()
    thread.join(RELEASE_WAIT_S)


class Checkpointer:
    """Snapshots of one run, on every rank (each takes part in every save and restore)."""

    def __init__(self, policy: SnapshotPolicy, env: DistEnv, vocab: Sequence[str],
                 sample_order: Optional[SampleOrder] = None, lease: Optional[SnapshotLease] = None):
        self.policy = policy
        self.env = env
        self.sample_order = sample_order
        """What decides this run's samples and their order: kept in its snapshots, and checked against a
        resumed one's (None: neither)."""
        self.vocab = Vocabulary.of(vocab)
        """What the snapshots keep to decode the model's output (a Vocabulary; a list: characters)."""
        self.store = open_snapshot_store(policy, env)
        self.saves = BackgroundSaves(env.device)
        """The snapshot writer of async_snapshots."""
        self.last_saved: Optional[Progress] = None
        """The training position of the newest snapshot complete on the store, as this rank knows it:
        restored, or written (rank 0 once its write is done; the other ranks once every rank agreed
        it is, finish())."""
        self._taken: Optional[Progress] = None
        """The training position of the last snapshot taken, written or still being written."""
        self._under_way: Optional[Progress] = None
        """A save taken and not yet known to be complete (async_snapshots: written in the background)."""
        self.unconfirmed: list[int] = []
        """Steps of this run's snapshots the watch has not judged yet (note_health)."""
        self._rng_to_restore: Optional[dict] = None
        self.lease = lease
        """Global rank 0's hold on the snapshot path, which the run took as it started (holding_the_path):
        checked at every step, for another run may take it over."""

    def tidy(self) -> None:
        """The run is over (or failing): what was kept only for a divergence to go back to goes (rank 0
        of the run that holds the path). A store that has stopped answering gets RELEASE_WAIT_S."""
        if self.env.is_main and self.policy.leased:
            in_the_background(self.store.tidy)

    @property
    def folder(self) -> str:
        """Where the snapshots (and the metrics beside them) live."""
        return self.store.folder

    def describe(self, progress: Progress) -> str:
        """Where snapshots go, how often, and where this run starts."""
        policy = self.policy
        cadences = [f"{policy.every_epochs} epoch(s)"] + [f"{n:g} {unit}" for n, unit in (
            (policy.every_steps, "steps"), (policy.every_minutes, "minutes")) if n]
        start = (f"resuming after epoch {progress.finished_epoch}, step {progress.step}"
                 if progress.step else "starting from scratch")
        return f"{policy.path} every {' and '.join(cadences)}; {start}"

    def due(self, progress: Progress, decision: Decision = Decision(), epoch_ended: bool = False,
            run_ended: bool = False) -> Optional[str]:
        """Why a snapshot of progress is due now ("epoch 3", "step 40", ...), or None."""
        if progress in (self._taken, self.last_saved):
            return None
        policy, step, epoch = self.policy, progress.step, progress.finished_epoch
        if epoch_ended:
            return f"epoch {epoch}" if epoch % policy.every_epochs == 0 else None
        if run_ended:  # whatever the cadence, the work of a finished run is never lost
            return f"epoch {epoch} (the last)" if progress.epoch_samples == 0 else f"step {step} (the last)"
        if decision.stop_signal or (policy.every_steps and step % policy.every_steps == 0):
            return f"step {step}"
        if decision.save:
            return f"step {step} ({policy.every_minutes:g} minutes since the last)"
        return None

    def save(self, when: str, progress: Progress, model: nn.Module, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler) -> None:
        """Every rank takes part (state, shards and RNG states); global rank 0 writes the rest.

        With async_snapshots, once the previous save is finished, the state is copied and a
        background thread writes it; "Snapshot saved" is logged when it is written. A state that
        is not finite on any rank (the run diverged) is never written, whoever asked for it."""
        self.finish()
        if any_rank(not all_finite(training_tensors(model, optimizer))):
            raise TrainingDiverged(f"the weights are not finite at {when} (training diverged): not saved; "
                                   f"{self.go_back_to_healthy(LOWER_LEARNING_RATE)}")
        info = Snapshot(
            **asdict(progress),
            scaler_state=scaler.state_dict(),
            rng_states=all_gather_objects(capture_rng(self.env.device)),
            vocab=self.vocab.tokens,
            tokenizer=self.vocab.tokenizer,
            model_config=asdict(unwrap(model).config),
            sample_order=self.sample_order.as_dict() if self.sample_order else {},
        )
        taken = self._taken = self._under_way = replace(progress)
        saving = f"saving the snapshot of step {taken.step}"  # what a stalled write of it says it was
        if self.policy.async_snapshots:
            live = training_tensors(model, optimizer)
            write = self.store.capture(model, optimizer, info, self.env.is_main,
                                       copy=lambda state: self.saves.staging.copy(state, live))

            def write_in_background() -> None:
                with files.part_of(saving):
                    write()
                if self.env.is_main:  # its write is the one that completes the snapshot
                    self._written(taken, when)

            self.saves.submit(write_in_background)
        else:
            error = None
            with files.part_of(saving):
                try:
                    self.store.save(model, optimizer, info, self.env.is_main)
                except MinGPTError as failed:  # said by every rank below: none waits for it forever
                    error = failed
            if error is None and self.env.is_main:
                self._written(taken, when)
            agreed = first_said(str(error) if error is not None else None)
            if agreed is not None:
                raise error or SnapshotError(agreed)
            self._written(taken, when)
        self.unconfirmed.append(progress.step)

    def _written(self, progress: Progress, when: str) -> None:
        """The snapshot of progress is complete on the store: from now on it is the one kept."""
        if self.last_saved == progress:
            return  # said already (rank 0 knows before the other ranks agree)
        self.last_saved = progress
        if self._under_way == progress:
            self._under_way = None
        log.info(f"Snapshot saved at {when}")

    def note_health(self, health: Health) -> None:
        """The run's health as the DivergenceWatch last judged it (a step late, before this step's
        snapshot is taken): the newest snapshot that healthy steps followed becomes the one the store
        keeps for a diverged run to go back to, and those not judged yet (written since the judged
        step) are kept too, for they may become it. The rest were followed by an unhealthy step, or
        by a newer confirmed one: the store may let them go."""
        followed = [step for step in self.unconfirmed if health.followed_healthily(step)]
        if followed:
            self.store.confirm(followed[-1])
        self.unconfirmed = [step for step in self.unconfirmed if step >= health.as_of]
        self.store.keep_pending(self.unconfirmed)

    def go_back_to_healthy(self, advice: str) -> str:
        """After divergence (every rank calls it, rank 0 acts): the snapshots written since the newest
        one healthy steps followed are set aside, so that a resume picks that one; what to do, said
        as rank 0 found it."""
        said = None
        if self.env.is_main:
            try:
                said = self._set_aside(advice)
            except Exception as error:  # the store failed: the run stops all the same
                said = (f"the snapshots written since the last healthy one could not be set aside "
                        f"({short_reason(error)}): resume from the newest that healthy steps followed, "
                        f"{advice}")
        return first_said(said)

    def _set_aside(self, advice: str) -> str:
        set_aside = self.store.set_aside()
        aside = f"; set aside so that no run resumes from them: {', '.join(set_aside.moved)}" \
            if set_aside.moved else ""
        if set_aside.resume_from is None:
            return (f"no snapshot of this run was followed by healthy steps{aside}; the next run on "
                    f"{self.policy.path} starts afresh, {advice}")
        return (f"resume from {set_aside.resume_from} (step {self.store.confirmed}, the newest snapshot "
                f"healthy steps followed), {advice}{aside}")

    def kept(self) -> str:
        """What the run leaves to resume from, for the line of a run that fails (the watchdog's): the
        newest snapshot complete on the store as this rank knows it, never one still being written,
        and the save under way, if any ("the last snapshot (step 300) is kept as it was:
        s3://b/run/sharded_000000300; the save of step 400, in the background, was not finished")."""
        under_way, saved = self._under_way, self.last_saved  # the writer thread may change both
        said = (f"the last snapshot (step {saved.step}) is kept as it was: {self.store.location(saved.step)}"
                if saved is not None else "no snapshot was written before")
        if under_way is not None and under_way != saved:
            background = ", in the background," if self.policy.async_snapshots else ""
            said += f"; the save of step {under_way.step}{background} was not finished"
        return said

    def failed(self) -> bool:
        """Whether this rank can no longer write snapshots: its background save has failed, or
        another run took the lease (never waits; for every step)."""
        return self.saves.failed() or self._lease_lost() is not None

    def _lease_lost(self) -> Optional[str]:
        return self.lease.lost() if self.lease is not None else None

    def finish(self) -> None:
        """Wait for the background save in flight (async_snapshots). Every rank takes part: when
        the save failed on any rank, or the lease was lost, every rank raises here with that error
        (the writing rank its own)."""
        error = self.saves.finish() if self.policy.async_snapshots else None
        lost = self._lease_lost()
        if lost is not None and error is None:
            error = SnapshotError(lost)
        first = first_said(str(error) if error is not None else None)
        if first is not None:
            raise error or SnapshotError(first)
        if self._under_way is not None:  # every rank wrote its part: the snapshot is complete
            self._written(self._under_way, f"step {self._under_way.step}")

    def finish_alone(self) -> None:
        """finish() for this rank alone, without a collective (a stop at once, when the other ranks
        may be anywhere): its background save in flight is written, or raises."""
        error = self.saves.finish() if self.policy.async_snapshots else None
        if error is not None:
            raise error

    @contextlib.contextmanager
    def finished_on_error(self) -> Iterator[None]:
        """When training fails, the background save in flight is still finished (it is whole or not
        there: the write is atomic) before the process goes on to exit; the training error is the
        one reported, and one that failed is said as not finished, with the snapshot kept. However
        training ends, the store is tidied."""
        try:
            yield
        except BaseException:
            error = self.saves.finish()
            if error is not None and self._under_way is not None:
                log.info(f"A save in the background failed with the run ({short_reason(error)}): {self.kept()}")
            raise
        finally:
            self.tidy()

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler) -> Progress:
        """Restore the newest snapshot, if any, into the model, optimizer and scaler; return where
        training stands (the start, without one)."""
        snapshot, _ = self.store.restore(model, optimizer, asdict(unwrap(model).config), self.vocab.tokens,
                                         self.vocab.tokenizer)
        if snapshot is None:
            log.info("Snapshot not found. Training model from scratch")
            return Progress(world_size=self.env.world_size)
        other_data = self.sample_order.changes_from(snapshot.sample_order) if self.sample_order else []
        if other_data and not self.policy.resume_on_other_data:
            raise SnapshotError(f"snapshot {self.policy.path} was trained on other data ({'; '.join(other_data)}): "
                                f"its position, step {snapshot.step}, is a place in that data's sample order; set "
                                f"{OTHER_DATA_KEY}=true to go on from its weights with this data's order from a new "
                                f"epoch, or set {TRAINING_KEY} to a new location to start afresh")
        if snapshot.scaler_state and scaler.is_enabled():
            scaler.load_state_dict(snapshot.scaler_state)
        self.last_saved = snapshot.progress
        self.store.confirm(snapshot.step)  # where this run starts: the one to go back to
        where = ""
        if snapshot.epoch_samples:
            epoch = snapshot.finished_epoch + 1
            where = f" (step {snapshot.step}, sample {snapshot.epoch_samples} of epoch {epoch})"
        if other_data:
            return self._resume_on_other_data(snapshot, other_data)
        log.info(f"Resuming training from snapshot at Epoch {snapshot.finished_epoch}{where}")
        return self._resume_position(snapshot)

    def _resume_on_other_data(self, snapshot: Snapshot, changes: list[str]) -> Progress:
        """Asked for (OTHER_DATA_KEY): the weights, optimizer and step count go on, and this data's
        order starts at the next epoch (an epoch the snapshot was in counts as ended)."""
        finished = snapshot.finished_epoch + (1 if snapshot.epoch_samples else 0)
        log.info(f"Resuming training from snapshot at Epoch {snapshot.finished_epoch} (step {snapshot.step}) on other "
                 f"data ({'; '.join(changes)}; {OTHER_DATA_KEY}=true): epoch {finished + 1} starts this "
                 "data's sample order")
        return replace(snapshot.progress, finished_epoch=finished, epoch_step=0, epoch_samples=0,
                       world_size=self.env.world_size)

    def _resume_position(self, snapshot: Snapshot) -> Progress:
        """Mid-epoch, continue with the next unseen sample of the epoch's global order.

        At the world size that saved it, with each rank's RNG state of that moment: the unbroken
        run, replayed exactly. At another world size the RNG streams (one per rank) cannot carry
        over: each rank seeds its own, and the dropout masks differ from an unbroken run's.
        """
        progress = snapshot.progress
        if snapshot.epoch_samples == 0:
            return progress
        if snapshot.world_size == self.env.world_size:
            self._rng_to_restore = snapshot.rng_states[self.env.rank]
            return progress
        warn_once(f"snapshot taken mid-epoch by {snapshot.world_size} ranks, resumed by "
                  f"{self.env.world_size}: epoch {snapshot.finished_epoch + 1} continues at sample "
                  f"{snapshot.epoch_samples:,} of its order, with new dropout streams")
        return replace(progress, world_size=self.env.world_size)

    def restore_rng(self, fallback_seed: int) -> bool:
        """Put back the RNG states of a resumed mid-epoch snapshot, once; False when there are none."""
        if self._rng_to_restore is None:
            return False
        set_rng_states(self._rng_to_restore, self.env.device, fallback_seed)
        self._rng_to_restore = None
        return True
