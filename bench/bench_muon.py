"""Muon against AdamW: wall-clock time to a fixed validation loss on tiny-shakespeare, the same model,
each optimizer at the learning rate a small sweep finds best.

    python bench/bench_muon.py [--target 2.0] [--max-steps 1000]

Each run is `python mingpt/main.py --config-name laptop` (a 0.8M-parameter model, the whole text,
contiguous split, evaluated every --eval-every steps on 16 batches) with the optimizer and learning
rate under test, stopped once an evaluation reaches --target (or at --max-steps). The time counts from
the process's start to that evaluation's line, so start-up is in both alike. AdamW is swept over
--adamw-rates; Muon over --muon-rates (its hidden matrices; AdamW's part at the best AdamW rate).
Target of issue 49: Muon at least 1.2x faster to the same loss. Writes bench/results/muon.json.
"""
import argparse
import functools
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from common import REPO, RESULTS, save_json

EVAL_LINE = re.compile(r"\| Step (\d+) \| Eval Loss ([\d.]+)")
TARGET_SPEEDUP = 1.2


def time_to_target(overrides: list[str], target: float, max_steps: int, eval_every: int,
                   folder: Path) -> dict:
    """One run until an evaluation reaches target: seconds, step, and every evaluation seen."""
    snapshot = folder / f"run_{abs(hash(tuple(overrides)))}.pt"
    command = [sys.executable, str(REPO / "mingpt" / "main.py"), "--config-name", "laptop",
               f"trainer_config.snapshot_path={snapshot}", f"trainer_config.max_steps={max_steps}",
               f"trainer_config.eval_every_steps={eval_every}", "trainer_config.progress_interval_s=3600",
               *overrides]
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    evaluations, reached = [], None
    for line in process.stdout:
        found = EVAL_LINE.search(line)
        if found:
            step, loss = int(found[1]), float(found[2])
            evaluations.append((step, loss, time.monotonic() - start))
            if loss <= target:
                reached = evaluations[-1]
                process.kill()
                break
    process.wait()
    for leftover in folder.glob(f"{snapshot.stem}*"):
        leftover.unlink()
    row = {"overrides": overrides, "evaluations": evaluations,
           "seconds": reached[2] if reached else None, "step": reached[0] if reached else None}
    lowest = min((loss for _, loss, _ in evaluations), default=float("nan"))
    said = (f"{target} at step {reached[0]} in {reached[2]:.1f} s" if reached
            else f"not reached in {max_steps} steps (lowest {lowest:.3f})")
    print(f"{' '.join(overrides)}: {said}", flush=True)
    return row


def best(rows: list[dict]) -> Optional[dict]:
    reached = [row for row in rows if row["seconds"] is not None]
    return min(reached, key=lambda row: row["seconds"]) if reached else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--target", type=float, default=2.0, help="validation loss to reach")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--adamw-rates", type=float, nargs="+", default=[1e-3, 3e-3, 6e-3])
    parser.add_argument("--muon-rates", type=float, nargs="+", default=[0.01, 0.02, 0.04])
    parser.add_argument("--json", type=Path, default=RESULTS / "muon.json")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-muon-"))
    run = functools.partial(time_to_target, target=args.target, max_steps=args.max_steps,
                            eval_every=args.eval_every, folder=folder)
    adamw = [run([f"optimizer_config.learning_rate={rate}"]) for rate in args.adamw_rates]
    best_adamw = best(adamw)
    adamw_rate = best_adamw["overrides"][0].split("=")[1] if best_adamw else str(args.adamw_rates[0])
    muon = [run(["optimizer_config.name=muon", f"optimizer_config.learning_rate={adamw_rate}",
                 f"optimizer_config.muon_learning_rate={rate}"]) for rate in args.muon_rates]
    best_muon = best(muon)
    speedup = best_adamw["seconds"] / best_muon["seconds"] if best_adamw and best_muon else None
    verdict = {"target_loss": args.target, "adamw_best": best_adamw, "muon_best": best_muon, "speedup": speedup,
               "target_speedup": TARGET_SPEEDUP, "met": speedup is not None and speedup >= TARGET_SPEEDUP}
    seconds = {name: f"{row['seconds']:.1f} s" if row else "not reached" for name, row in
               (("AdamW", best_adamw), ("Muon", best_muon))}
    outcome = (f"{speedup:.2f}x (target {TARGET_SPEEDUP}x: {'met' if verdict['met'] else 'not met'})" if speedup
               else "not comparable")
    print(f"time to validation loss {args.target}: AdamW {seconds['AdamW']}, Muon {seconds['Muon']}: {outcome}")
    save_json(args.json, {"settings": vars(args), "adamw": adamw, "muon": muon, "verdict": verdict})


if __name__ == "__main__":
    main()
