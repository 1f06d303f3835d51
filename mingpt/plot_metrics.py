"""Draw the loss curves of a training run from its metrics file into a PNG.

    python mingpt/plot_metrics.py gpt_snapshot.metrics.jsonl -o loss.png
    python plot_metrics.py s3://bucket/gpt_snapshot.metrics.jsonl        # inside mingpt/; any fsspec URL

Train loss per step (faint) with a smoothed line over it, and eval loss per epoch (markers), against
the number of training tokens seen, so that runs of different batch sizes or world sizes line up.
The metrics file is the one training writes beside the snapshot (see metrics.py). Runs headless.
"""
import argparse
import posixpath
import sys
from typing import Any, Optional

import matplotlib

matplotlib.use("Agg")  # no display needed, none opened: works over ssh, in CI and on clusters

import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)
from matplotlib.figure import Figure  # noqa: E402

from errors import MinGPTError  # noqa: E402
from metrics import read_metrics  # noqa: E402
from storage import short_reason  # noqa: E402

FIGURE_INCHES = (8.0, 4.5)
DPI = 100  # FIGURE_INCHES * DPI = 800 x 450 pixels
SMOOTHING_WINDOW = 51
"""Steps averaged by the smoothed train line, at most a tenth of the run's steps."""


def smooth(values: list[float], window: int) -> list[float]:
    """Centred moving average; near either end the window shrinks, staying centred.

    Centred rather than exponential: an EMA trails a falling loss by half its span and draws the
    curve above the points it summarises.
    """
    half = window // 2
    prefix = [0.0]
    for value in values:
        prefix.append(prefix[-1] + value)
    smoothed = []
    for i in range(len(values)):
        reach = min(half, i, len(values) - 1 - i)  # a lopsided window would bend the ends
        lo, hi = i - reach, i + reach + 1
        smoothed.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return smoothed


def smoothing_window(n_points: int) -> int:
    return max(1, min(SMOOTHING_WINDOW, n_points // 10))


def plot_losses(train: list[dict[str, Any]], evals: list[dict[str, Any]], title: str) -> Figure:
    """A figure of train (per step) and eval (per epoch) loss against tokens seen."""
    fig, ax = plt.subplots(figsize=FIGURE_INCHES, dpi=DPI, layout="constrained")
    if train:
        tokens = [line["tokens"] for line in train]
        losses = [line["loss"] for line in train]
        ax.plot(tokens, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="train loss (per step)")
        ax.plot(tokens, smooth(losses, smoothing_window(len(losses))), color="tab:blue", linewidth=2,
                label="train loss (smoothed)")
    if evals:
        ax.plot([line["tokens"] for line in evals], [line["loss"] for line in evals], color="tab:orange",
                marker="o", linewidth=1.5, label="eval loss (per epoch)")
    ax.set_xlabel("tokens seen in training")
    ax.set_ylabel("cross-entropy loss (nats per character)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def load_lines(path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and eval lines of the metrics file; MinGPTError when it is missing, unreadable or empty."""
    try:
        train, evals = read_metrics(path, "train"), read_metrics(path, "eval")
    except Exception as e:  # missing protocol, credentials, a file that is not JSON lines
        raise MinGPTError(f"metrics file {path} cannot be read ({short_reason(e)})") from None
    if not train and not evals:
        raise MinGPTError(f"no training metrics in {path}; give the *.metrics.jsonl file written beside "
                          "the snapshot (trainer_config.metrics_path)")
    return train, evals


def write_png(fig: Figure, output: str) -> None:
    try:
        fig.savefig(output, format="png")
    except OSError as e:
        raise MinGPTError(f"-o: cannot write {output} ({short_reason(e)})") from None
    finally:
        plt.close(fig)


def default_title(path: str) -> str:
    return f"minGPT-DDP training loss: {posixpath.basename(path.rstrip('/'))}"  # URLs too: '/'-separated


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Plot train and eval loss from a metrics file.")
    parser.add_argument("metrics", help="*.metrics.jsonl written beside the snapshot (local path or fsspec URL)")
    parser.add_argument("-o", "--output", default="loss.png", help="PNG to write (default loss.png)")
    parser.add_argument("--title", default=None, help="plot title (default: the metrics file's name)")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    try:
        train, evals = load_lines(args.metrics)
        write_png(plot_losses(train, evals, args.title or default_title(args.metrics)), args.output)
    except MinGPTError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"wrote {args.output} ({len(train)} train steps, {len(evals)} eval passes)")


if __name__ == "__main__":
    main()
