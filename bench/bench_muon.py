"""Muon against AdamW: wall-clock time to a fixed validation loss on tiny-shakespeare, the same model,
each optimizer at the learning rate a small sweep finds best.

    python bench/bench_muon.py [--target 2.0] [--max-steps 1000] [--phase sweep|time|both]

Each run is `python mingpt/main.py --config-name laptop` (a 0.8M-parameter model, the whole text,
contiguous split, evaluated every --eval-every steps on 16 batches) with the optimizer and learning
rate under test, stopped once an evaluation reaches --target (or at --max-steps). The time counts from
the process's start to that evaluation's line, so start-up is in both alike. AdamW is swept over
--adamw-rates; Muon over --muon-rates (its hidden matrices; AdamW's part at the best AdamW rate).
Target of issue 49: Muon at least 1.2x faster to the same loss. Writes bench/results/muon.json.

Two phases, so that the long sweep can share a busy machine: the sweep picks each optimizer's rate by
the fewest steps to the target (a count that does not depend on the machine's load; --threads per
run), and the timing phase runs the two winners again, one after the other, on a machine left quiet,
for the wall-clock figures the verdict compares. --phase time reads the sweep from the JSON file.
"""
import argparse
import functools
import json
import os
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
                   folder: Path, threads: Optional[int] = None) -> dict:
    """One run until an evaluation reaches target: seconds, step, and every evaluation seen."""
    snapshot = folder / f"run_{abs(hash(tuple(overrides)))}.pt"
    command = [sys.executable, str(REPO / "mingpt" / "main.py"), "--config-name", "laptop",
               f"trainer_config.snapshot_path={snapshot}", f"trainer_config.max_steps={max_steps}",
               f"trainer_config.eval_every_steps={eval_every}", "trainer_config.progress_interval_s=3600",
               *overrides]
    start = time.monotonic()
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
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


def fewest_steps(rows: list[dict]) -> Optional[dict]:
    reached = [row for row in rows if row["step"] is not None]
    return min(reached, key=lambda row: (row["step"], row["seconds"])) if reached else None


def sweep(args: argparse.Namespace, run) -> dict:
    """Each optimizer at each rate, under load if need be: the rates that reach the target soonest."""
    adamw = [run([f"optimizer_config.learning_rate={rate}"], threads=args.threads) for rate in args.adamw_rates]
    best_adamw = fewest_steps(adamw)
    adamw_rate = best_adamw["overrides"][0].split("=")[1] if best_adamw else str(args.adamw_rates[0])
    muon = [run(["optimizer_config.name=muon", f"optimizer_config.learning_rate={adamw_rate}",
                 f"optimizer_config.muon_learning_rate={rate}"], threads=args.threads) for rate in args.muon_rates]
    return {"adamw": adamw, "muon": muon, "adamw_best": best_adamw, "muon_best": fewest_steps(muon)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--target", type=float, default=2.0, help="validation loss to reach")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--adamw-rates", type=float, nargs="+", default=[1e-3, 3e-3, 6e-3])
    parser.add_argument("--muon-rates", type=float, nargs="+", default=[0.01, 0.02, 0.04])
    parser.add_argument("--phase", choices=["sweep", "time", "both"], default="both")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the sweep's runs")
    parser.add_argument("--json", type=Path, default=RESULTS / "muon.json")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-muon-"))
    run = functools.partial(time_to_target, target=args.target, max_steps=args.max_steps,
                            eval_every=args.eval_every, folder=folder)
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    if args.phase == "time":
        swept = json.loads(args.json.read_text())["sweep"]
    else:
        swept = sweep(args, run)
        save_json(args.json, {"settings": settings, "sweep": swept})
    if args.phase == "sweep":
        return
    timed = {name: run(swept[f"{name}_best"]["overrides"]) if swept[f"{name}_best"] else None
             for name in ("adamw", "muon")}
    speedup = timed["adamw"]["seconds"] / timed["muon"]["seconds"] if all(
        row and row["seconds"] for row in timed.values()) else None
    verdict = {"target_loss": args.target, "adamw": timed["adamw"], "muon": timed["muon"], "speedup": speedup,
               "target_speedup": TARGET_SPEEDUP, "met": speedup is not None and speedup >= TARGET_SPEEDUP}
    seconds = {name: f"{row['seconds']:.1f} s (step {row['step']})" if row and row["seconds"] else "not reached"
               for name, row in timed.items()}
    outcome = (f"{speedup:.2f}x (target {TARGET_SPEEDUP}x: {'met' if verdict['met'] else 'not met'})" if speedup
               else "not comparable")
    print(f"time to validation loss {args.target}: AdamW {seconds['adamw']}, Muon {seconds['muon']}: {outcome}")
    save_json(args.json, {"settings": settings, "sweep": swept, "verdict": verdict})


if __name__ == "__main__":
    main()
