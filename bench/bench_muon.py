"""Muon against AdamW: wall-clock time to a fixed validation loss on tiny-shakespeare, the same model,
each optimizer at the learning rate a small sweep finds best.

    python bench/bench_muon.py [--target 2.0] [--max-steps 1000] [--phase sweep|time|both]
    python bench/bench_muon.py --phase end --recipe small|default [--runs LABEL ...] [--load-note TEXT]

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

--phase end (issue 59, item 4): what a user gets at the end of a fixed budget of steps, not how soon a
loss is reached. Each run trains a recipe (RECIPES) to its last step, evaluating the whole held-out
split every --eval-every steps; the file (bench/results/muon_end_<recipe>.json) keeps every run by its
label, so the sweep resumes where it stopped and a run is measured once (--again to redo one). The
verdict: each optimizer's lowest final loss over its runs (its best learning rate; Muon's runs at its
defaults and at learning rates around them), the ratio of the two, and how much sooner Muon's
evaluations reach the loss AdamW ends at (in steps; the seconds of a run measured under load are
recorded but not compared).
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
TARGET_SOONER = 1.3
"""Issue 59: Muon reaches the loss AdamW ends at at least this much sooner."""

RECIPES = {
    # nanoGPT's small character recipe: 4 layers, 4 heads, 128 wide, block 64, batch 32, AdamW at 1e-3
    # constant, dropout 0.1, weight decay 0.1, tiny-shakespeare's contiguous 90/10 split, 3,000 steps, fp32.
    "small": {"config": "laptop", "steps": 3000, "overrides": [
        "gpt_config.embd_pdrop=0.1", "gpt_config.resid_pdrop=0.1", "gpt_config.attn_pdrop=0.1",
        "trainer_config.use_amp=False", "optimizer_config.lr_schedule=constant", "optimizer_config.warmup_steps=0",
        "optimizer_config.learning_rate=0.001", "optimizer_config.weight_decay=0.1"]},
    # The default model (8 layers, 8 heads, 512 wide, block 128: gpt2_train_cfg.yaml's) on the same held-out
    # data and batch, bf16 as the default run computes on this CPU, for a budget a CPU can sweep.
    "default": {"config": "gpt2_train_cfg", "steps": 1000, "overrides": [
        "data_config.truncate=1.0", "data_config.split=contiguous", "trainer_config.batch_size=32",
        "optimizer_config.lr_schedule=constant", "optimizer_config.warmup_steps=0"]},
}
"""Each recipe: the config it starts from, its budget of steps and its overrides; a run adds its own."""


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


def run_to_the_end(recipe: dict, extra: list[str], eval_every: int, folder: Path, threads: Optional[int]) -> dict:
    """One run of a recipe to its last step: every evaluation (step, loss, seconds since the start)."""
    snapshot = folder / f"end_{abs(hash(tuple(extra)))}.pt"
    command = [sys.executable, str(REPO / "mingpt" / "main.py"), "--config-name", recipe["config"],
               *recipe["overrides"], f"trainer_config.snapshot_path={snapshot}",
               f"trainer_config.max_steps={recipe['steps']}", f"trainer_config.eval_every_steps={eval_every}",
               "trainer_config.eval_batches=100", "trainer_config.progress_interval_s=3600",
               "trainer_config.data_loader_workers=0", *extra]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.monotonic()
    process = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    evaluations = []
    for line in process.stdout.splitlines():
        found = EVAL_LINE.search(line)
        if found:
            evaluations.append((int(found[1]), float(found[2])))
    for leftover in folder.glob(f"{snapshot.stem}*"):
        leftover.unlink()
    if process.returncode != 0 or not evaluations:
        raise SystemExit(f"{' '.join(extra)}: exit {process.returncode}\n{process.stdout[-3000:]}")
    final = evaluations[-1][1]
    print(f"{' '.join(extra) or '(recipe as it is)'}: final eval loss {final:.4f} "
          f"({time.monotonic() - start:.0f} s)", flush=True)
    return {"overrides": extra, "evaluations": evaluations, "final": final, "seconds": time.monotonic() - start}


def first_step_at(evaluations: list, loss: float) -> Optional[int]:
    return next((step for step, value in evaluations if value <= loss), None)


def end_verdict(runs: dict, steps: int) -> dict:
    """Each optimizer's best run (lowest final loss), their ratio, and Muon's steps to AdamW's end."""
    best = {}
    for name in ("adamw", "muon"):
        mine = {label: run for label, run in runs.items() if label.split(":")[0] == name}
        if mine:
            label = min(mine, key=lambda key: mine[key]["final"])
            best[name] = {"label": label, "final": mine[label]["final"]}
    verdict = {"best": best}
    if len(best) == 2:
        adamw_end = best["adamw"]["final"]
        reached = first_step_at(runs[best["muon"]["label"]]["evaluations"], adamw_end)
        verdict.update(muon_over_adamw=best["muon"]["final"] / adamw_end, lower_met=best["muon"]["final"] < adamw_end,
                       muon_steps_to_adamw_end=reached,
                       sooner=steps / reached if reached else None, target_sooner=TARGET_SOONER,
                       sooner_met=reached is not None and steps / reached >= TARGET_SOONER)
    return verdict


def end_phase(args: argparse.Namespace) -> None:
    """Fixed-budget runs of one recipe, each kept in the JSON file by its label as soon as it ends."""
    recipe = RECIPES[args.recipe]
    path = args.json if args.json != RESULTS / "muon.json" else RESULTS / f"muon_end_{args.recipe}.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    runs = saved.get("runs", {})
    folder = Path(tempfile.mkdtemp(prefix="bench-muon-end-"))
    for label in args.runs:
        if label in runs and not args.again:
            continue
        name, _, settings = label.partition(":")
        extra = [f"optimizer_config.name={name}",
                 *(f"optimizer_config.{setting}" for setting in settings.split(",") if setting)]
        runs[label] = {**run_to_the_end(recipe, extra, args.eval_every, folder, args.threads),
                       "load_note": args.load_note}
        save_json(path, {"recipe": {**recipe, "name": args.recipe}, "runs": runs,
                         "verdict": end_verdict(runs, recipe["steps"])})
    print(json.dumps(end_verdict(runs, recipe["steps"]), indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--target", type=float, default=2.0, help="validation loss to reach")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--adamw-rates", type=float, nargs="+", default=[1e-3, 3e-3, 6e-3])
    parser.add_argument("--muon-rates", type=float, nargs="+", default=[0.01, 0.02, 0.04])
    parser.add_argument("--phase", choices=["sweep", "time", "both", "end"], default="both")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="small", help="--phase end: the recipe")
    parser.add_argument("--runs", nargs="+", default=["adamw:learning_rate=0.001", "muon:"],
                        help="--phase end: NAME:KEY=VALUE,... (optimizer_config's), each a run")
    parser.add_argument("--again", action="store_true", help="--phase end: measure runs already in the file again")
    parser.add_argument("--load-note", default="", help="--phase end: what else the machine ran meanwhile")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the sweep's runs")
    parser.add_argument("--json", type=Path, default=RESULTS / "muon.json")
    args = parser.parse_args()
    if args.phase == "end":
        end_phase(args)
        return
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
