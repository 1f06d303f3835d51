"""plot_metrics.py: a PNG of train and eval loss from a metrics file, and clean refusals."""
import math
import struct
import sys

import pytest
import torch
from helpers import MINGPT, assert_ok, run

from mingpt import plot_metrics
from mingpt.reporting.metrics import MetricsLog

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BLUE, ORANGE = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's tab:blue and tab:orange
TOKENS_PER_STEP = 4096


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's header: the signature, then the IHDR chunk comes first."""
    assert data[:8] == PNG_SIGNATURE
    length, kind, width, height = struct.unpack(">I4sII", data[8:24])
    assert kind == b"IHDR" and length == 13
    return width, height


@pytest.fixture
def metrics_file(tmp_path):
    """Two epochs of 150 steps with a falling loss, written by the trainer's own MetricsLog."""
    log = MetricsLog(str(tmp_path / "gpt_snapshot.metrics.jsonl"), active=True)
    for step in range(1, 301):
        epoch, iteration = (step - 1) // 150 + 1, (step - 1) % 150
        loss = 1.5 + 2.5 * math.exp(-step / 60) + 0.1 * math.sin(step)  # noisy, falling
        log.record("train", torch.tensor(loss), epoch=epoch, iter=iteration, step=step,
                   tokens=step * TOKENS_PER_STEP, lr=3e-4)
        if iteration == 149:
            log.record("eval", torch.tensor(loss + 0.2), epoch=epoch, step=step,
                       tokens=step * TOKENS_PER_STEP, samples=900)
    log.flush()
    return tmp_path / "gpt_snapshot.metrics.jsonl"


def colour_pixels(rgba: torch.Tensor, colour: tuple[int, int, int], tolerance: int = 8) -> int:
    return int(((rgba[..., :3] - torch.tensor(colour)).abs() <= tolerance).all(dim=-1).sum())


@pytest.mark.slow
def test_the_command_writes_a_png_of_the_expected_size(metrics_file, tmp_path):
    output = tmp_path / "loss.png"
    result = run([sys.executable, MINGPT / "plot_metrics.py", metrics_file, "-o", output],
                 env={"DISPLAY": "", "MPLBACKEND": ""})  # headless, whatever the user's settings
    assert_ok(result)
    assert "wrote" in result.stdout and "300 train steps, 2 eval passes" in result.stdout
    data = output.read_bytes()
    width, height = (round(inches * plot_metrics.DPI) for inches in plot_metrics.FIGURE_INCHES)
    assert png_size(data) == (width, height) == (800, 450)
    assert 10_000 < len(data) < 200_000


def test_the_figure_has_both_curves_labelled(metrics_file):
    train, evals = plot_metrics.load_lines(str(metrics_file))
    fig = plot_metrics.plot_losses(train, evals, "a title")
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"train loss (per step)", "train loss (smoothed)", "eval loss (per epoch)"}
    assert list(lines["train loss (per step)"].get_xdata()) == [TOKENS_PER_STEP * s for s in range(1, 301)]
    assert list(lines["eval loss (per epoch)"].get_xdata()) == [150 * TOKENS_PER_STEP, 300 * TOKENS_PER_STEP]
    assert lines["eval loss (per epoch)"].get_marker() == "o"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(lines)
    assert "tokens" in ax.get_xlabel() and "loss" in ax.get_ylabel() and ax.get_title() == "a title"
    # Both curves are drawn inside the picture, not only listed: count their colours' pixels.
    fig.canvas.draw()
    rgba = torch.frombuffer(bytearray(fig.canvas.buffer_rgba()), dtype=torch.uint8).view(450, 800, 4).int()
    assert colour_pixels(rgba, BLUE) > 500
    assert colour_pixels(rgba, ORANGE) > 50


def test_smoothing_follows_a_trend_to_both_ends_and_removes_noise():
    line = [3.0 - 0.01 * step for step in range(200)]
    assert plot_metrics.smooth(line, 21) == pytest.approx(line)  # no lag, not even at the ends
    noise = [0.2 * (-1.0) ** step for step in range(200)]
    noisy_line = [a + b for a, b in zip(line, noise)]
    assert max(abs(s - t) for s, t in zip(plot_metrics.smooth(noisy_line, 21), line)) < 0.05
    assert plot_metrics.smooth([2.0], 21) == [2.0] and plot_metrics.smooth([], 21) == []


def test_eval_only_or_train_only_metrics_still_plot(metrics_file, tmp_path):
    lines = metrics_file.read_text().splitlines()
    train_only = tmp_path / "train_only.jsonl"
    train_only.write_text("\n".join(line for line in lines if '"train"' in line))
    plot_metrics.main([str(train_only), "-o", str(tmp_path / "train_only.png")])
    assert png_size((tmp_path / "train_only.png").read_bytes()) == (800, 450)


def run_and_fail(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exit_:
        plot_metrics.main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert exit_.value.code == 1 and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_a_missing_or_empty_metrics_file_is_one_line(tmp_path, capsys):
    line = run_and_fail(capsys, tmp_path / "none.jsonl", "-o", tmp_path / "x.png")
    assert "no train or eval lines" in line
    assert not (tmp_path / "x.png").exists()


def test_a_file_that_is_not_json_lines_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n{]\n")  # unreadable lines are dropped (a torn last line): none are left
    assert "no train or eval lines" in run_and_fail(capsys, bad)


def test_an_unwritable_output_is_one_line(metrics_file, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert "-o: cannot write" in run_and_fail(capsys, metrics_file, "-o", blocker / "loss.png")


def test_several_runs_share_the_axes_one_colour_each(metrics_file, tmp_path):
    other = tmp_path / "bf16.metrics.jsonl"
    other.write_text(metrics_file.read_text().replace('"loss": 1', '"loss": 2'))
    runs = plot_metrics.load_runs([str(metrics_file), str(other)], ["fp32", "bf16"])
    ax = plot_metrics.plot_runs(runs, "compare").axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    curves = ("train loss (smoothed)", "eval loss")
    expected = {f"{run} {curve}" for run in ("fp32", "bf16") for curve in curves}
    assert expected <= set(lines)
    assert lines["fp32 eval loss"].get_color() == lines["fp32 train loss (smoothed)"].get_color()
    assert lines["fp32 eval loss"].get_color() != lines["bf16 eval loss"].get_color()
    assert list(lines["bf16 eval loss"].get_xdata()) == [150 * TOKENS_PER_STEP, 300 * TOKENS_PER_STEP]
    # Without labels each run is named by its file.
    names = [run.label for run in plot_metrics.load_runs([str(metrics_file), str(other)], None)]
    assert names == ["gpt_snapshot", "bf16"]


def test_a_label_count_that_does_not_match_the_files_is_one_line(metrics_file, tmp_path, capsys):
    line = run_and_fail(capsys, metrics_file, metrics_file, "--label", "only-one", "-o", tmp_path / "x.png")
    assert line.startswith("error: --label: 1 label(s) for 2 metrics file(s)")
