"""Draw the loss curves of a training run from its metrics file into a PNG.

    python mingpt/plot_metrics.py gpt_snapshot.metrics.jsonl -o loss.png
    python plot_metrics.py s3://bucket/gpt_snapshot.metrics.jsonl -o s3://bucket/loss.png  # any fsspec URL
    python plot_metrics.py fp32.metrics.jsonl bf16.metrics.jsonl --label fp32 --label bf16 -o cmp.png

Train loss per step (faint) with a smoothed line over it, and eval loss per epoch (markers), against
the number of training tokens seen, so that runs of different batch sizes or world sizes line up.
Several metrics files draw several runs on one set of axes, one colour per run, to compare them.
The metrics file is the one training writes beside the snapshot (see metrics.py). Runs headless.
"""
import argparse
import posixpath
from dataclasses import dataclass
from typing import Any, Optional

import matplotlib
import numpy as np

matplotlib.use("Agg")  # no display needed, none opened: works over ssh, in CI and on clusters

import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import EngFormatter  # noqa: E402

from mingpt.common.errors import MinGPTError, OneLineArgumentParser, command, short_reason  # noqa: E402
from mingpt.common.files import open_file  # noqa: E402
from mingpt.reporting.metrics import read_metrics  # noqa: E402

FIGURE_INCHES = (8.0, 4.5)
DPI = 100  # FIGURE_INCHES * DPI = 800 x 450 pixels
EVAL_MARKERS = "oxs^v"
"""One per run, so that runs whose curves coincide still show each one's eval points."""
SMOOTHING_WINDOW = 51
"""Steps in each local fit of the smoothed train line, at most a tenth of the run's steps."""


def smooth(values: list[float], window: int) -> list[float]:
    """Each step's value on a straight line fitted to the `window` steps around it.

    The window is centred where it fits and shifted inward at either end. A line rather than a
    mean: a window that cannot be centred (at the ends) would make a mean lag a falling loss, and a
    window that shrinks instead would leave the ends as noisy as the raw steps.
    """
    if not values:
        return []
    y = np.asarray(values, dtype=np.float64)
    n, w = len(y), min(window, len(values))
    step = np.arange(n)
    lo = np.clip(step - w // 2, 0, n - w)  # first step of each window
    u = step - lo  # each step's position inside its window: 0 .. w-1

    def window_sum(a: np.ndarray) -> np.ndarray:
        prefix = np.concatenate([[0.0], np.cumsum(a)])
        return prefix[lo + w] - prefix[lo]

    sum_y = window_sum(y)
    sum_uy = window_sum(step * y) - lo * sum_y  # positions measured from each window's start
    sum_u, sum_uu = w * (w - 1) / 2, (w - 1) * w * (2 * w - 1) / 6
    spread = w * sum_uu - sum_u**2  # w^2 times the variance of 0 .. w-1; zero when w == 1
    slope = (w * sum_uy - sum_u * sum_y) / spread if spread else np.zeros(n)
    return (sum_y / w + slope * (u - sum_u / w)).tolist()


def smoothing_window(n_points: int) -> int:
    return max(1, min(SMOOTHING_WINDOW, n_points // 10))


@dataclass
class Run:
    """One metrics file's lines, and its name in the legend."""

    label: str
    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]


def plot_losses(train: list[dict[str, Any]], evals: list[dict[str, Any]], title: str) -> Figure:
    """A figure of one run's train (per step) and eval (per epoch) loss against tokens seen."""
    return plot_runs([Run("", train, evals)], title)


def plot_runs(runs: list[Run], title: str) -> Figure:
    """A figure of every run's loss curves; one run gets two colours (train, eval), several get one
    colour each, with the eval points dashed between markers of the run's own shape."""
    fig, ax = plt.subplots(figsize=FIGURE_INCHES, dpi=DPI, layout="constrained")
    for index, run in enumerate(runs):
        single = len(runs) == 1
        train_colour, eval_colour = ("tab:blue", "tab:orange") if single else (f"C{index}", f"C{index}")
        name = f"{run.label} " if run.label else ""
        if run.train:
            tokens = [line["tokens"] for line in run.train]
            losses = [line["loss"] for line in run.train]
            ax.plot(tokens, losses, color=train_colour, alpha=0.3 if single else 0.15, linewidth=0.8,
                    label=f"{name}train loss (per step)")
            ax.plot(tokens, smooth(losses, smoothing_window(len(losses))), color=train_colour, linewidth=2,
                    label=f"{name}train loss (smoothed)")
        if run.evals:
            ax.plot([line["tokens"] for line in run.evals], [line["loss"] for line in run.evals],
                    color=eval_colour, marker=EVAL_MARKERS[index % len(EVAL_MARKERS)], markerfacecolor="none"
                    if index else eval_colour, linewidth=1.5, linestyle="-" if single else "--",
                    label=f"{name}eval loss (per epoch)" if single else f"{name}eval loss")
    ax.set_xlabel("tokens seen in training")
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 500k, 1M, rather than an offset like 1e6
    ax.set_ylabel("cross-entropy loss (nats per character)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def load_lines(path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and eval lines of the metrics file; MinGPTError when it is missing, unreadable or empty."""
    try:
        lines = read_metrics(path)  # one read: on an object store each read is a request
    except Exception as e:  # missing protocol, credentials, a file that is not JSON lines
        raise MinGPTError(f"metrics file {path} cannot be read ({short_reason(e)})") from None
    train = [line for line in lines if line.get("kind") == "train"]
    evals = [line for line in lines if line.get("kind") == "eval"]
    if not train and not evals:
        raise MinGPTError(f"no train or eval lines in {path} (missing or empty); give the metrics file "
                          "training writes beside the snapshot (trainer_config.metrics_path)")
    return train, evals


def write_png(fig: Figure, output: str) -> None:
    """Save fig as PNG to a local path or any fsspec URL."""
    try:
        with open_file(output, "wb") as f:
            fig.savefig(f, format="png")
    except Exception as e:  # a missing folder, permissions, credentials
        raise MinGPTError(f"-o: cannot write {output} ({short_reason(e)})") from None
    finally:
        plt.close(fig)


def run_name(path: str) -> str:
    """A metrics file's name without its folder and suffix: `runs/bf16.metrics.jsonl` -> `bf16`."""
    name = posixpath.basename(path.rstrip("/"))  # URLs too: '/'-separated
    for suffix in (".jsonl", ".metrics"):
        name = name.removesuffix(suffix)
    return name


def default_title(paths: list[str]) -> str:
    return f"minGPT-DDP training loss: {', '.join(posixpath.basename(p.rstrip('/')) for p in paths)}"


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = OneLineArgumentParser(description="Plot train and eval loss from metrics files.")
    parser.add_argument("metrics", nargs="+",
                        help="metrics file(s) written beside the snapshot (local paths or fsspec URLs)")
    parser.add_argument("--label", action="append", default=None,
                        help="a run's name in the legend, once per metrics file (default: the file's name)")
    parser.add_argument("-o", "--output", default="loss.png",
                        help="PNG to write, a local path or fsspec URL (default loss.png)")
    parser.add_argument("--title", default=None, help="plot title (default: the metrics file's name)")
    return parser.parse_args(argv)


@command
def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    runs = load_runs(args.metrics, args.label)
    write_png(plot_runs(runs, args.title or default_title(args.metrics)), args.output)
    counts = "; ".join(f"{len(run.train)} train steps, {len(run.evals)} eval passes" for run in runs)
    print(f"wrote {args.output} ({counts})")


def load_runs(paths: list[str], labels: Optional[list[str]]) -> list[Run]:
    """Every metrics file's lines; a single file needs no label."""
    if labels is not None and len(labels) != len(paths):
        raise MinGPTError(f"--label: {len(labels)} label(s) for {len(paths)} metrics file(s); "
                          "give one per file or none")
    if labels is None:
        labels = [""] if len(paths) == 1 else [run_name(path) for path in paths]
    return [Run(label, *load_lines(path)) for label, path in zip(labels, paths)]


if __name__ == "__main__":
    main()
