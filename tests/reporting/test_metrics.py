import json

import torch

from mingpt.reporting.metrics import MetricsLog, default_metrics_path, read_metrics


def test_default_path_is_beside_the_snapshot():
    assert default_metrics_path("runs/gpt_snapshot.pt") == "runs/gpt_snapshot.metrics.jsonl"
    assert default_metrics_path("s3://bucket/run/") == "s3://bucket/run/metrics.jsonl"


def test_records_are_written_at_flush_in_order(tmp_path):
    path = str(tmp_path / "m.jsonl")
    metrics = MetricsLog(path, active=True)
    metrics.start(resumed_step=0)
    for step in (1, 2, 3):
        metrics.record("train", torch.tensor(float(step)), epoch=1, step=step, tokens=10 * step)
    assert read_metrics(path) == []  # nothing before a flush: no device sync per step
    metrics.flush()
    lines = read_metrics(path, "train")
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert [line["loss"] for line in lines] == [1.0, 2.0, 3.0]


def test_a_resume_drops_the_lines_after_its_snapshot(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"kind": "train", "step": s, "epoch": 1, "loss": 0.0}) + "\n"
                            for s in range(1, 8)))
    MetricsLog(str(path), active=True).start(resumed_step=5)
    assert [line["step"] for line in read_metrics(str(path))] == [1, 2, 3, 4, 5]


def test_inactive_log_writes_nothing(tmp_path):
    metrics = MetricsLog(str(tmp_path / "m.jsonl"), active=False)
    metrics.start(resumed_step=0)
    metrics.record("train", torch.tensor(1.0), epoch=1, step=1)
    metrics.flush()
    assert not (tmp_path / "m.jsonl").exists()


def test_a_torn_or_garbled_file_is_resumed_with_a_warning(tmp_path, capsys):
    """A run killed while appending leaves half a line; garbled bytes anywhere: never a traceback at
    the next start, the readable lines kept (configure_logging: the warning is rank 0's)."""
    from mingpt.common.logger import configure_logging

    configure_logging(rank=0)
    path = tmp_path / "m.jsonl"
    lines = [json.dumps({"kind": "train", "step": s, "epoch": 1, "loss": 0.5}) + "\n" for s in range(1, 6)]
    path.write_bytes("".join(lines).encode()[:-20] + b"\n")  # the last line cut
    MetricsLog(str(path), active=True).start(resumed_step=5)
    assert [line["step"] for line in read_metrics(str(path))] == [1, 2, 3, 4]
    assert "dropped 1 unreadable line(s)" in capsys.readouterr().out

    path.write_bytes(lines[0].encode() + b"\xff\xfe garbled\n[1, 2]\n" + lines[1].encode())
    MetricsLog(str(path), active=True).start(resumed_step=5)
    assert [line["step"] for line in read_metrics(str(path))] == [1, 2]
    path.write_bytes(b"")
    MetricsLog(str(path), active=True).start(resumed_step=5)
    assert read_metrics(str(path)) == []
