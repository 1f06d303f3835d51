import glob
import json
import os
import signal
import socket
import struct
import sys
from pathlib import Path

import pytest
import torch
from helpers import MAIN, TORCHRUN, assert_ok, run, start_until, tiny_overrides

from mingpt.common.errors import ConfigError
from mingpt.reporting import trackers
from mingpt.reporting.metrics import MetricsLog, read_metrics
from mingpt.reporting.trackers import TrackedRun, TrackerConfig, Trackers


def tracked_run(folder: Path, run_ids: dict = None, **config) -> TrackedRun:
    return TrackedRun(TrackerConfig(**config), str(folder), run_ids or {}, {"trainer_config": {"seed": 7}},
                      ["Model: tiny"])


class Recording:
    """A tracker that keeps what it is sent; `fail_on` names a step whose log raises."""

    name, run_id, fail_on = "recording", "r1", None

    def __init__(self, run: TrackedRun):
        self.logged: list[tuple[int, dict]] = []
        self.outcome = None
        Recording.last = self

    def log(self, step, values):
        if step == self.fail_on:
            raise OSError("No space left on device")
        self.logged.append((step, values))

    def finish(self, outcome):
        self.outcome = outcome


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setitem(trackers.TRACKERS, "recording", Recording)
    monkeypatch.setattr(Recording, "fail_on", None)
    return Recording


def record_steps(metrics: MetricsLog, steps, kind="train") -> None:
    for step in steps:
        metrics.record(kind, torch.tensor(1.0 / step), epoch=1, step=step, lr=1e-3,
                       grad_norm=torch.tensor(2.0 * step), tokens_per_s=None)
    metrics.flush()


@pytest.mark.parametrize("setting, problem", [
    ({"trackers": ["comet"]}, "tracker_config.trackers: unknown tracker 'comet'; choose from tensorboard,"),
    ({"trackers": ["wandb", "wandb"]}, "tracker_config.trackers: names one twice"),
    ({"wandb_mode": "cloud"}, "tracker_config.wandb_mode"),
    ({"project": ""}, "tracker_config.project: must not be empty"),
])
def test_bad_tracker_settings_name_the_key(setting, problem):
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(")):
        TrackerConfig(**setting)


def test_a_tracker_gets_each_line_once_with_its_values_by_kind(tmp_path, recording):
    metrics = MetricsLog(str(tmp_path / "m.jsonl"), active=True)
    metrics.start(resumed_step=0)
    metrics.trackers = Trackers(tracked_run(tmp_path, trackers=["recording"]))
    record_steps(metrics, [1, 2])
    metrics.record("eval", torch.tensor(0.25), epoch=1, step=2)
    metrics.record("ranks", step=2, data_ms=[1.5, 9.0], compute_ms=[20.0, 21.0], slow="rank 1 ...")
    metrics.close()
    assert recording.last.logged == [
        (1, {"train/loss": 1.0, "train/lr": 1e-3, "train/grad_norm": 2.0}),
        (2, {"train/loss": 0.5, "train/lr": 1e-3, "train/grad_norm": 4.0}),
        (2, {"eval/loss": 0.25}),
        (2, {"ranks/0/data_ms": 1.5, "ranks/1/data_ms": 9.0, "ranks/0/compute_ms": 20.0,
             "ranks/1/compute_ms": 21.0}),
    ]
    assert read_metrics(str(tmp_path / "m.jsonl"), "ranks")[0]["slow"] == "rank 1 ..."
    assert recording.last.outcome == "finished"


def test_a_resumed_run_sends_only_the_steps_its_trackers_have_not_had(tmp_path, recording):
    """Killed at step 7 after its step-5 snapshot: the trackers had steps 1-7; resumed, they get 8 on."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"kind": "train", "step": step, "loss": 0.0}) + "\n"
                            for step in range(1, 8)))
    metrics = MetricsLog(str(path), active=True)
    metrics.start(resumed_step=5)
    run = tracked_run(tmp_path, {"recording": "r1"}, trackers=["recording"])
    metrics.trackers = Trackers(run)
    record_steps(metrics, range(6, 10))
    metrics.close()
    assert [step for step, _ in recording.last.logged] == [8, 9]
    assert [line["step"] for line in read_metrics(str(path))] == [1, 2, 3, 4, 5, 6, 7, 8, 9]


@pytest.mark.slow
def test_a_failing_tracker_is_said_once_and_dropped_while_the_others_and_the_file_go_on(
        tmp_path, recording, caplog):
    recording.fail_on = 2
    metrics = MetricsLog(str(tmp_path / "m.jsonl"), active=True)
    metrics.start(resumed_step=0)
    with socket.socket() as closed:  # a port nothing listens on: an unreachable MLflow server
        closed.bind(("127.0.0.1", 0))
        unreachable = f"http://127.0.0.1:{closed.getsockname()[1]}"
    metrics.trackers = Trackers(tracked_run(tmp_path, trackers=["mlflow", "recording", "tensorboard"],
                                            mlflow_tracking_uri=unreachable))
    for step in range(1, 5):
        record_steps(metrics, [step])
    metrics.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("tracker mlflow failed (") and "training goes on without it" in warnings[0]
    assert warnings[1].startswith("tracker recording failed (OSError: No space left on device)")
    assert [step for step, _ in recording.last.logged] == [1]
    assert [line["step"] for line in read_metrics(str(tmp_path / "m.jsonl"))] == [1, 2, 3, 4]
    expected = [(step, pytest.approx(1 / step)) for step in (1, 2, 3, 4)]
    assert tensorboard_scalars(tmp_path / "tensorboard", "train/loss") == expected


def tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


# W&B's offline runs are LevelDB-style logs of protobuf records (W&B's Python reader is gone from
# the package): a 7-byte file header, then 32 KiB blocks of records, each with a 7-byte header.
WANDB_BLOCK, RECORD_HEADER = 32 * 1024, 7


def wandb_records(path: str):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", path
    position, parts = 7, []
    while position + RECORD_HEADER <= len(data):
        left_in_block = WANDB_BLOCK - position % WANDB_BLOCK
        _, length, kind = struct.unpack("<IHB", data[position:position + RECORD_HEADER])
        if left_in_block < RECORD_HEADER or (kind == 0 and length == 0):  # the block's zero padding
            position += left_in_block
            continue
        parts.append(data[position + RECORD_HEADER:position + RECORD_HEADER + length])
        position += RECORD_HEADER + length
        if kind in (1, 4):  # a whole record, or a record's last part
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def wandb_offline_runs(folder: Path) -> list[tuple[str, dict[int, dict[str, float]]]]:
    """(run id, {step: values}) of each offline run in folder, oldest first."""
    runs = []
    for path in sorted(glob.glob(str(folder / "wandb" / "offline-run-*" / "run-*.wandb"))):
        run_id, history = None, {}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                step = record.history.step.num
                values = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                          for item in record.history.item}
                values = {key: value for key, value in values.items() if not key.startswith("_")}
                assert step not in history or not set(values) & set(history[step]), f"step {step} twice"
                history.setdefault(step, {}).update(values)
        runs.append((run_id, history))
    return runs


def mlflow_runs(folder: Path):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(folder / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("mingpt-ddp")
    return client, client.search_runs([experiment.experiment_id])


@pytest.mark.slow
def test_a_two_rank_run_stopped_and_resumed_is_one_tracked_run_with_every_step_once(text_file, tmp_path):
    """Rank 0 alone tracks; the SIGTERM stop ends the tracked runs at a step boundary and the resumed
    run (one process: an elastic restart at another world size) continues them (their ids are in
    the snapshot), each step once, with the file's values."""
    snapshot, text = tmp_path / "snap.pt", tmp_path / "half.txt"
    text.write_text(text_file.read_text()[:3000])  # an epoch of 42 steps
    overrides = tiny_overrides(text, snapshot, trainer_config__log_every=10,
                               tracker_config__trackers="[wandb,mlflow]")
    command = [*TORCHRUN, "--standalone", "--nproc_per_node=2", MAIN, *overrides]
    process, seen = start_until(command, "| Iter 20 |")
    process.send_signal(signal.SIGTERM)
    output = "".join(seen) + process.communicate(timeout=120)[0]
    assert "Stopping on SIGTERM: snapshot saved at step" in output, output
    resumed = run([sys.executable, MAIN, *overrides])
    assert_ok(resumed)
    assert "Resuming training from snapshot" in resumed.stdout

    metrics = read_metrics(str(tmp_path / "snap.metrics.jsonl"))
    train = {line["step"]: line for line in metrics if line["kind"] == "train"}
    assert sorted(train) == list(range(1, len(train) + 1)) and len(train) > 30
    (first_id, first), (second_id, second) = wandb_offline_runs(tmp_path / "trackers")  # one per segment
    assert first_id == second_id
    assert not first.keys() & second.keys()
    wandb_history = {**first, **second}
    assert sorted(wandb_history) == sorted(train)
    client, (mlflow_run,) = mlflow_runs(tmp_path / "trackers")
    mlflow_losses = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, "train/loss")}
    assert len(client.get_metric_history(mlflow_run.info.run_id, "train/loss")) == len(train)
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["trainer_config.batch_size"] == "32"
    for step, line in train.items():
        assert wandb_history[step]["train/loss"] == line["loss"]
        assert wandb_history[step]["train/grad_norm"] == line["grad_norm"] > 0
        assert mlflow_losses[step] == pytest.approx(line["loss"], rel=1e-6)  # its file store prints floats
    (evaluation,) = [line for line in metrics if line["kind"] == "eval"]
    assert wandb_history[evaluation["step"]]["eval/loss"] == evaluation["loss"]
