"""Run trackers: TensorBoard, Weights & Biases and MLflow get the metrics file's lines as they are
flushed (metrics.py), beside the file, which stays the run's record.

One tracked run per training run. Global rank 0 alone opens the trackers, once the process group is
up (every other rank has none), and sends them the same values the file holds: train loss, learning
rate, tokens/s, MFU and gradient norm per step, eval loss, HellaSwag's accuracy, and at the start the
whole config and the run's summary lines. Their run ids travel in the snapshots
(Progress.tracked_runs), so a resumed, requeued or elastic-restarted run continues the same tracked
runs. A run stopped before its first snapshot starts again from step 0, as a new tracked run.

A tracker's history only moves forward: each step reaches a tracker once. A run killed between
snapshots has sent its trackers steps past its newest snapshot; resumed, it sends only the steps after
those. Meanwhile the metrics file gets the replayed steps' values, which equal the first ones at the same
world size (a resume replays exactly) and differ a little after an elastic change of world size.

Offline first: W&B writes offline runs into the tracker folder (`wandb sync` uploads them later),
MLflow writes a local store there unless given a tracking URI, TensorBoard its event files.

Trackers never hold training up or stop it. Their calls after opening run in one background thread,
and a tracker that fails (an unreachable server, a full disk) is said in one warning line and dropped;
the metrics file goes on. A new tracker is a class with `name`, `run_id`, `log` and `finish`, opened in
`TRACKERS`.
"""
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from mingpt.common import files
from mingpt.common.errors import check, check_choice, short_reason
from mingpt.common.logger import log

WANDB_MODES = ("offline", "online")
TRACKED_VALUES = ("loss", "lr", "tokens_per_s", "mfu", "grad_norm", "accuracy")
"""The fields of a metrics line a tracker gets, as `<kind>/<field>` (train/loss, eval/loss,
hellaswag/accuracy, ...)."""
FINISHED, STOPPED, FAILED = "finished", "stopped", "failed"


@dataclass
class TrackerConfig:
    trackers: list[str] = field(default_factory=list)
    """Run trackers that get the metrics too, beside the metrics file: any of tensorboard, wandb, mlflow."""
    folder: Optional[str] = None
    """A local folder for their files (TensorBoard events, W&B offline runs, MLflow's local store).
    Default: `trackers/` beside the snapshot, or in the cache folder when the snapshot is remote."""
    project: str = "mingpt-ddp"
    """The W&B project and the MLflow experiment."""
    run_name: Optional[str] = None
    """The tracked run's name (default: the tracker's own choice)."""
    wandb_mode: str = "offline"
    """offline (upload later with `wandb sync`) or online (needs network and `wandb login`)."""
    mlflow_tracking_uri: Optional[str] = None
    """An MLflow server (http://host:5000) or store. Default: $MLFLOW_TRACKING_URI if set, else a
    local store in the tracker folder. Unless set in the environment, MLflow retries a request twice
    and waits 20 s for an answer (MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT)."""

    def __post_init__(self) -> None:
        for name in self.trackers:
            check(name in TRACKERS, "tracker_config.trackers",
                  f"unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
        check(len(set(self.trackers)) == len(self.trackers), "tracker_config.trackers", "names one twice")
        check_choice(self, "tracker_config", "wandb_mode", WANDB_MODES)
        check(bool(self.project), "tracker_config.project", "must not be empty")


@dataclass
class TrackedRun:
    """What a tracker opens with: where its files go, the run to continue, what the run is."""

    config: TrackerConfig
    folder: str
    run_ids: dict[str, str]
    """The ids of the tracked runs to continue (from the snapshot resumed), by tracker name."""
    run_config: dict[str, Any]
    summary: list[str]

    def run_id(self, tracker: str) -> Optional[str]:
        return self.run_ids.get(tracker)


class Tracker(Protocol):
    name: str
    run_id: Optional[str]
    """None for a tracker without runs (TensorBoard: a folder is the run)."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def finish(self, outcome: str) -> None: ...


def tracker_folder(config: TrackerConfig, snapshot_folder: str) -> str:
    if config.folder:
        return config.folder
    if files.is_remote(snapshot_folder):
        return str(files.cache_folder(None) / "trackers")
    return os.path.join(snapshot_folder, "trackers")


RANK_VALUES = ("data_ms", "compute_ms")
"""The per-rank fields of a "ranks" line (distributed/stragglers.py), as ranks/<rank>/<field>."""


def tracked_values(line: dict[str, Any]) -> dict[str, float]:
    """A metrics line's values under the names trackers show: train/loss, train/lr, eval/loss, ...,
    and each rank's step times: ranks/1/data_ms, ..."""
    if line["kind"] == "ranks":
        return {f"ranks/{rank}/{key}": float(value) for key in RANK_VALUES
                for rank, value in enumerate(line.get(key, []))}
    return {f"{line['kind']}/{key}": float(line[key]) for key in TRACKED_VALUES if line.get(key) is not None}


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as `group.key: value` strings (MLflow's parameters are flat)."""
    params = {}
    for key, value in config.items():
        if isinstance(value, dict):
            params.update(flat_params(value, f"{prefix}{key}."))
        else:
            params[f"{prefix}{key}"] = str(value)
    return params


class TensorBoardTracker:
    name, run_id = "tensorboard", None

    def __init__(self, run: TrackedRun):
        from torch.utils.tensorboard import SummaryWriter  # only when chosen: pulls in tensorboard

        self.writer = SummaryWriter(os.path.join(run.folder, "tensorboard"))
        if not run.run_ids:  # a new run: a resumed one has them already
            self.writer.add_text("summary", "\n\n".join(run.summary))
            params = flat_params(run.run_config)
            self.writer.add_text("config", "\n\n".join(f"{key}: {value}" for key, value in params.items()))

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def finish(self, outcome: str) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, run: TrackedRun):
        import wandb  # only when chosen

        os.makedirs(run.folder, exist_ok=True)  # W&B looks for a git repository there
        self.run = wandb.init(
            project=run.config.project, name=run.config.run_name, mode=run.config.wandb_mode,
            id=run.run_id(self.name) or secrets.token_hex(4), resume="allow", dir=run.folder,
            config=run.run_config, notes="\n".join(run.summary),
            # Our own log lines already go to the job's output; W&B's would repeat them.
            settings=wandb.Settings(console="off", silent=True))
        self.run_id = self.run.id
        if run.config.wandb_mode == "offline":
            log.info(f"Tracking: W&B offline run {self.run_id} in {self.run.dir.rsplit('/files', 1)[0]}; "
                     f"upload it with: wandb sync {os.path.join(run.folder, 'wandb', 'offline-run-*')}")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def finish(self, outcome: str) -> None:
        self.run.finish(exit_code=1 if outcome == FAILED else 0)


def _not_an_mlflow_retry(record: logging.LogRecord) -> bool:
    """urllib3 warns of each retry of a request (to stderr, having no handler); for MLflow's API the
    tracker's own warning says what finally failed."""
    return "/api/2.0/mlflow/" not in record.getMessage()


class MlflowTracker:
    name = "mlflow"
    _STATUS = {FINISHED: "FINISHED", STOPPED: "KILLED", FAILED: "FAILED"}

    def __init__(self, run: TrackedRun):
        retries = logging.getLogger("urllib3.connectionpool")
        if _not_an_mlflow_retry not in retries.filters:
            retries.addFilter(_not_an_mlflow_retry)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # MLflow's own: 7, minutes of waiting
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        uri = (run.config.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
               or Path(run.folder, "mlruns").absolute().as_uri())
        if uri.startswith("file:"):
            # MLflow's file store needs no server nor database (the database store needs SQLAlchemy,
            # which the light client leaves out); MLflow asks for this opt-in to use it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient  # only when chosen

        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = run.run_id(self.name) or self._create_run(run)
        self.client.update_run(self.run_id, status="RUNNING")
        log.info(f"Tracking: MLflow run {self.run_id} at {uri}")

    def _create_run(self, run: TrackedRun) -> str:
        experiment = self.client.get_experiment_by_name(run.config.project)
        experiment_id = (experiment.experiment_id if experiment
                         else self.client.create_experiment(run.config.project))
        created = self.client.create_run(experiment_id, run_name=run.config.run_name,
                                          tags={"mlflow.note.content": "\n".join(run.summary)})
        from mlflow.entities import Param

        params = [Param(key, value[:6000]) for key, value in flat_params(run.run_config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters per call
            self.client.log_batch(created.info.run_id, params=params[start:start + 100])
        return created.info.run_id

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now_ms, step) for k, v in values.items()])

    def finish(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, status=self._STATUS[outcome])


TRACKERS: dict[str, Callable[[TrackedRun], Tracker]] = {
    "tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


class Trackers:
    """Rank 0's open trackers, and the one thread their calls run in after opening."""

    def __init__(self, run: TrackedRun):
        self._trackers: list[Tracker] = []
        for name in run.config.trackers:
            self._guarded(name, lambda: self._trackers.append(TRACKERS[name](run)))
        self.run_ids = {**run.run_ids, **{t.name: t.run_id for t in self._trackers if t.run_id}}
        """Every tracked run of this training run, for the snapshots (Progress.tracked_runs)."""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trackers")
        self._closed = False

    def send(self, lines: list[dict[str, Any]]) -> None:
        """Metrics lines to every tracker, in the background."""
        if self._trackers and lines and not self._closed:
            self._thread.submit(self._each, lambda tracker: [
                tracker.log(line["step"], tracked_values(line)) for line in lines])

    def close(self, outcome: str = FINISHED) -> None:
        """Wait for what was sent, then end each tracked run: finished, stopped (resumable) or failed."""
        if self._closed:
            return
        self._closed = True
        self._thread.submit(self._each, lambda t: t.finish(outcome))
        self._thread.shutdown(wait=True)
        self._trackers.clear()

    def _each(self, call: Callable[[Tracker], Any]) -> None:
        for tracker in list(self._trackers):
            if not self._guarded(tracker.name, lambda: call(tracker)):
                self._trackers.remove(tracker)

    @staticmethod
    def _guarded(name: str, call: Callable[[], Any]) -> bool:
        try:
            call()
            return True
        except Exception as error:  # an unreachable server, a full disk: training goes on without it
            log.warning(f"tracker {name} failed ({short_reason(error)}); training goes on without it "
                        "(the metrics file keeps every value)")
            return False


def open_trackers(config: TrackerConfig, snapshot_folder: str, run_ids: dict[str, str],
                  run_config: dict[str, Any], summary: list[str]) -> Trackers:
    """The configured trackers, continuing the tracked runs of run_ids (none: new runs)."""
    return Trackers(TrackedRun(config, tracker_folder(config, snapshot_folder), run_ids, run_config, summary))
