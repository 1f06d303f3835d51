"""Muon against AdamW: wall-clock time to a fixed validation loss on tiny-shakespeare, the same model,
each optimizer at the learning rate a small sweep finds best.

    python bench/bench_muon.py [--target 2.0] [--max-steps 1000] [--phase sweep|time|both]
    python bench/bench_muon.py --phase end --recipe small|default [--runs LABEL ...] [--load-note TEXT]
    python bench/bench_muon.py --phase step [--nproc 2] [--batch-size 8] [--steps 5] [--rounds 2]

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
recorded but not compared), or, where a run's label asks for a shorter budget (steps=N), the recipe's
budget over the shortest one whose Muon run still ends at AdamW's loss: with a cooldown over the last
part of a run, a shorter run is how a user would spend fewer steps, not an early evaluation of a longer.

--phase step (issue 59, item 4's last figure): what a step costs with sharded Muon against sharded
AdamW and against DDP Muon, on --nproc ranks (torchrun, gloo, one thread each) and the default model's
shape (8 layers, 8 heads, 512 wide, block 128, bf16 autocast as the default run computes on a CPU).
Each rank times whole training steps and, within them, the optimizer's step (clipping included);
the three settings take turns, --rounds times, so that a machine's load falls on each alike, and each
keeps its fastest round. The default run's batch (216 per rank) would take minutes a step here, so a
smaller --batch-size is timed and the step at the default batch estimated as the forward and backward
passes scaled by the batch plus the optimizer's step, which does not depend on it (the passes are the
faster fsdp setting's for both: the same computation, told apart only by the load). Writes
bench/results/muon_step.json.
"""
import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from common import REPO, RESULTS, save_json, scratch_folder

EVAL_LINE = re.compile(r"\| Step (\d+) \| Eval Loss ([\d.]+)")
TARGET_SPEEDUP = 1.2
TARGET_SOONER = 1.3
"""Issue 59: Muon reaches the loss AdamW ends at at least this much sooner."""
TARGET_STEP_RATIO = 1.15
"""Issue 59: sharded Muon's step within 15% of sharded AdamW's, on the default model."""
STEP_SETTINGS = {"fsdp_adamw": ("fsdp", "adamw"), "fsdp_muon": ("fsdp", "muon"), "ddp_muon": ("ddp", "muon")}
DEFAULT_BATCH = 216
"""gpt2_train_cfg.yaml's trainer_config.batch_size (per rank)."""

RECIPES = {
    # nanoGPT's small character recipe: 4 layers, 4 heads, 128 wide, block 64, batch 32, AdamW at 1e-3
    # constant, dropout 0.1, weight decay 0.1, tiny-shakespeare's contiguous 90/10 split, 3,000 steps, fp32.
    "small": {"config": "laptop", "steps": 3000, "overrides": [
        "gpt_config.embd_pdrop=0.1", "gpt_config.resid_pdrop=0.1", "gpt_config.attn_pdrop=0.1",
        "trainer_config.use_amp=False", "optimizer_config.lr_schedule=constant", "optimizer_config.warmup_steps=0",
        "optimizer_config.learning_rate=0.001", "optimizer_config.weight_decay=0.1"], "eval_batches": 100},
    # The default model (8 layers, 8 heads, 512 wide, block 128: gpt2_train_cfg.yaml's, 25M parameters) on
    # the same held-out data and batch, bf16 as the default run computes on this CPU, for a budget a CPU can
    # sweep in a session: 300 steps (1.2M tokens, 1.3 passes over the training split) at about 5 s a step
    # on one thread; each evaluation 30 batches (960 windows, the held-out split about once).
    "default": {"config": "gpt2_train_cfg", "steps": 300, "overrides": [
        "data_config.truncate=1.0", "data_config.split=contiguous", "trainer_config.batch_size=32",
        "optimizer_config.lr_schedule=constant", "optimizer_config.warmup_steps=0"], "eval_batches": 30},
}
"""Each recipe: the config it starts from, its budget of steps and its overrides; a run adds its own."""


def time_to_target(overrides: list[str], target: float, max_steps: int, eval_every: int,
                   folder: Path, threads: Optional[int] = None) -> dict:
    """One run until an evaluation reaches target: seconds, step, and every evaluation seen."""
    snapshot = folder / f"run_{abs(hash(tuple(overrides)))}.pt"
    command = [sys.executable, str(REPO / "mingpt" / "main.py"), "--config-name", "laptop",
               f"trainer_config.snapshot_path={snapshot}", f"trainer_config.max_steps={max_steps}",
               f"trainer_config.eval_every_steps={eval_every}", "trainer_config.progress_interval_s=3600",
               "optimizer_config.cooldown=0", *overrides]  # as muon.json was measured, before Muon's cooldown
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
               f"trainer_config.eval_batches={recipe['eval_batches']}", "trainer_config.progress_interval_s=3600",
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
        mine = {label: run for label, run in runs.items()
                if label.split(":")[0] == name and budget_of(label, steps) == steps}
        if mine:
            label = min(mine, key=lambda key: mine[key]["final"])
            best[name] = {"label": label, "final": mine[label]["final"]}
    verdict = {"best": best}
    if len(best) == 2:
        adamw_end = best["adamw"]["final"]
        reached = first_step_at(runs[best["muon"]["label"]]["evaluations"], adamw_end)
        shorter = [budget_of(label, steps) for label, run in runs.items()
                   if label.startswith("muon:") and budget_of(label, steps) < steps and run["final"] <= adamw_end]
        sooner = max(steps / reached if reached else 0, steps / min(shorter) if shorter else 0) or None
        verdict.update(muon_over_adamw=best["muon"]["final"] / adamw_end, lower_met=best["muon"]["final"] < adamw_end,
                       muon_steps_to_adamw_end=reached, muon_shortest_budget_to_adamw_end=min(shorter, default=None),
                       sooner=sooner, target_sooner=TARGET_SOONER,
                       sooner_met=sooner is not None and sooner >= TARGET_SOONER)
    return verdict


def budget_of(label: str, steps: int) -> int:
    """A run's budget of steps: the recipe's, or its label's steps=N (a shorter run, its schedule's
    cooldown within it, as a user with that budget would train)."""
    settings = dict(setting.split("=") for setting in label.partition(":")[2].split(",") if setting)
    return int(settings.get("steps", steps))


def end_phase(args: argparse.Namespace) -> None:
    """Fixed-budget runs of one recipe, each kept in the JSON file by its label as soon as it ends."""
    recipe = RECIPES[args.recipe]
    path = args.json if args.json != RESULTS / "muon.json" else RESULTS / f"muon_end_{args.recipe}.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    runs = saved.get("runs", {})
    with scratch_folder("bench-muon-end-") as folder:
        for label in args.runs:
            if label in runs and not args.again:
                continue
            name, _, settings = label.partition(":")
            extra = [f"optimizer_config.name={name}",
                     *(f"trainer_config.max_{setting}" if setting.startswith("steps=")
                       else f"optimizer_config.{setting}" for setting in settings.split(",") if setting)]
            result = {**run_to_the_end(recipe, extra, args.eval_every, folder, args.threads),
                      "load_note": args.load_note}
            # Read again before writing: another sweep may share the file (each run is minutes to an hour).
            runs = json.loads(path.read_text()).get("runs", {}) if path.exists() else {}
            runs[label] = result
            save_json(path, {"recipe": {**recipe, "name": args.recipe}, "runs": runs,
                             "verdict": end_verdict(runs, recipe["steps"])})
    print(json.dumps(end_verdict(runs, recipe["steps"]), indent=1))


def step_worker(args: argparse.Namespace) -> None:
    """Under torchrun: one setting's steps timed on every rank; rank 0 emits the slowest rank's."""
    from common import benchmark_trainer, emit

    from mingpt.distributed.muon import optimizer_for
    from mingpt.distributed.process_group import all_gather_objects, distributed_session
    from mingpt.optimizer import OptimizerConfig

    method, name = STEP_SETTINGS[args.setting]
    with distributed_session() as env:
        with benchmark_trainer(env, 8, 8, 512, 128, batch_size=args.batch_size, use_amp=True,
                               amp_dtype="bfloat16", distributed_method=method) as trainer:
            # The Trainer was built with AdamW's defaults: the optimizer under test in its place, as
            # the Trainer builds it (after wrapping), and the schedule reading its config.
            trainer.optimizer_config = OptimizerConfig(name=name)
            trainer.optimizer = optimizer_for(trainer.model, trainer.optimizer_config)
            in_optimizer = []
            optimizer_step = trainer.optimizer_step

            def timed_optimizer_step():
                start = time.perf_counter()
                norm = optimizer_step()
                norm.item()
                in_optimizer.append(time.perf_counter() - start)
                return norm

            trainer.optimizer_step = timed_optimizer_step
            batches = iter(trainer.train_loader)
            steps = []
            for _ in range(args.warmup + args.steps):
                inputs, targets = trainer.to_device(next(batches))
                start = time.perf_counter()
                trainer._run_batch(inputs, targets)[0].item()
                steps.append(time.perf_counter() - start)
            mine = {"step_s": sum(steps[args.warmup:]) / args.steps,
                    "optimizer_s": sum(in_optimizer[args.warmup:]) / args.steps}
            everyone = all_gather_objects(mine)
        if env.is_main:
            emit({key: max(rank[key] for rank in everyone) for key in mine})


def step_verdict(rounds: dict, batch_size: int) -> tuple[dict, dict]:
    """Each setting's fastest round, and the ratios against the target. At the default batch the
    forward and backward passes (the step less the optimizer's) are fsdp's fastest of its two
    settings, the same computation in both: their difference here is the machine's load, which
    scaled by the batch would swamp the optimizers' difference."""
    best = {label: min(results, key=lambda result: result["step_s"]) for label, results in rounds.items()}
    passes = min(best[label]["step_s"] - best[label]["optimizer_s"] for label in ("fsdp_adamw", "fsdp_muon"))
    for result in best.values():
        result["default_batch_step_s_estimate"] = passes * DEFAULT_BATCH / batch_size + result["optimizer_s"]
    muon, adamw, ddp = best["fsdp_muon"], best["fsdp_adamw"], best["ddp_muon"]
    ratio = muon["step_s"] / adamw["step_s"]
    ratio_default = muon["default_batch_step_s_estimate"] / adamw["default_batch_step_s_estimate"]
    return best, {"fsdp_muon_over_fsdp_adamw": ratio, "fsdp_muon_over_ddp_muon": muon["step_s"] / ddp["step_s"],
                  "fsdp_muon_optimizer_over_ddp_muon_optimizer": muon["optimizer_s"] / ddp["optimizer_s"],
                  "fsdp_muon_over_fsdp_adamw_at_default_batch_estimate": ratio_default,
                  "target_ratio": TARGET_STEP_RATIO, "met_at_timed_batch": ratio <= TARGET_STEP_RATIO,
                  "met_at_default_batch_estimate": ratio_default <= TARGET_STEP_RATIO}


def step_phase(args: argparse.Namespace) -> None:
    """The three settings in turns, each round a torchrun of its own; each setting's fastest round."""
    from common import run_workers

    rounds = {label: [] for label in STEP_SETTINGS}
    for round_ in range(args.rounds):
        for label in STEP_SETTINGS:
            flags = ["--phase", "step", "--setting", label, "--batch-size", args.batch_size, "--steps", args.steps,
                     "--warmup", args.warmup]
            rounds[label].append(run_workers(__file__, args.nproc, 1, flags))
            print(f"round {round_ + 1} {label}: {rounds[label][-1]}", flush=True)
    best, verdict = step_verdict(rounds, args.batch_size)
    print(json.dumps(verdict, indent=1))
    save_json(args.json if args.json != RESULTS / "muon.json" else RESULTS / "muon_step.json",
              {"settings": {"nproc": args.nproc, "threads_per_rank": 1, "model": "8 layers, 8 heads, 512 wide, "
                            "block 128, bf16 autocast", "batch_size_per_rank": args.batch_size, "steps": args.steps,
                            "warmup": args.warmup, "rounds": args.rounds, "load_note": args.load_note},
               "rounds": rounds, "best": best, "verdict": verdict})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--target", type=float, default=2.0, help="validation loss to reach")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--adamw-rates", type=float, nargs="+", default=[1e-3, 3e-3, 6e-3])
    parser.add_argument("--muon-rates", type=float, nargs="+", default=[0.01, 0.02, 0.04])
    parser.add_argument("--phase", choices=["sweep", "time", "both", "end", "step"], default="both")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="small", help="--phase end: the recipe")
    parser.add_argument("--runs", nargs="+", default=["adamw:learning_rate=0.001", "muon:"],
                        help="--phase end: NAME:KEY=VALUE,... (optimizer_config's; steps=N: a budget of N steps), each a run")
    parser.add_argument("--again", action="store_true", help="--phase end: measure runs already in the file again")
    parser.add_argument("--load-note", default="", help="--phase end: what else the machine ran meanwhile")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the sweep's runs")
    parser.add_argument("--json", type=Path, default=RESULTS / "muon.json")
    parser.add_argument("--nproc", type=int, default=2, help="--phase step: ranks")
    parser.add_argument("--batch-size", type=int, default=8, help="--phase step: samples per rank")
    parser.add_argument("--steps", type=int, default=5, help="--phase step: timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="--phase step: untimed steps first")
    parser.add_argument("--rounds", type=int, default=2, help="--phase step: turns of the three settings")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setting", choices=sorted(STEP_SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        step_worker(args)
        return
    if args.phase == "step":
        step_phase(args)
        return
    if args.phase == "end":
        end_phase(args)
        return
    with scratch_folder("bench-muon-") as folder:
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
