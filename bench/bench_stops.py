"""How long a stop signal takes to end a run with its snapshot, in each phase the signal can land in.

    python bench/bench_stops.py [--phases startup,first_step,...] [--threads 2] [--json FILE]

Each phase is a real run of the default model (the tutorial's 25M parameters, batch 216, block 128)
on the default data in one process, as `python mingpt/main.py` runs it, SIGTERM sent to every
process of the run a few seconds into the phase, as Slurm's scancel, a preemption or a time limit
send it. Per phase: the seconds from the signal to the process's end, the batch of that phase that
was under way (a training step, an evaluation batch, a HellaSwag pass: its time read from the run's
own lines), and the bound the project keeps: BOUND_S plus that batch (docs/snapshots.md). Results
in bench/results/stops.json (--json), merged with the phases already there.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import REPO, RESULTS, machine, save_json

BOUND_S = 15.0
"""Beyond the batch under way: what the project promises (a cluster gives 30 s: Slurm's KillWait)."""
MAIN = REPO / "mingpt" / "main.py"

# phase -> (overrides, the line after which the phase is under way, seconds to wait after it, the
# kind of line whose spacing times one batch of the phase, or None when the stop does not wait for one)
PHASES = {
    "startup": ([], "Data has", 0.5, None),
    "first_step": (["trainer_config.max_steps=3"], "Snapshots:", 5.0, None),
    "compile": (["trainer_config.max_steps=3", "trainer_config.compile=True"], "Snapshots:", 5.0, None),
    "training_step": (["trainer_config.max_steps=4"], "| Iter 1 | Train", 5.0, "Train"),
    "evaluation": (["trainer_config.max_steps=3", "trainer_config.eval_every_steps=1"], "| Iter 1 | Eval", 2.0,
                   "Eval"),
    "hellaswag": (["trainer_config.max_steps=3", "trainer_config.hellaswag_every_steps=1",
                   "trainer_config.hellaswag_items=2000"], "| Iter 0 | Train", 5.0, None),
    "background_write": (["trainer_config.max_steps=4", "trainer_config.save_every_steps=1",
                          "trainer_config.async_snapshots=True"], "| Iter 1 | Train", 1.0, None),
}


def hellaswag_file(folder: Path, items: int = 2000) -> Path:
    """Items in HellaSwag's format over Shakespeare's characters (the scoring costs what the real file's do)."""
    rng = random.Random(0)
    words = (REPO / "data" / "input.txt").read_text().split()[:20_000]
    path = folder / "hellaswag_val.jsonl"
    with path.open("w") as f:
        for _ in range(items):
            ctx = " ".join(rng.choices(words, k=rng.randint(20, 40)))
            endings = [" ".join(rng.choices(words, k=rng.randint(10, 25))) for _ in range(4)]
            f.write(json.dumps({"ctx": ctx, "endings": endings, "label": rng.randrange(4)}) + "\n")
    return path


def measure(phase: str, folder: Path, threads: int) -> dict:
    overrides, trigger, wait_s, batch_kind = PHASES[phase]
    snapshot = folder / f"{phase}.pt"
    extra = [f"trainer_config.hellaswag_path={hellaswag_file(folder)}"] if phase == "hellaswag" else []
    command = [sys.executable, str(MAIN), f"trainer_config.snapshot_path={snapshot}", "trainer_config.log_every=1",
               *overrides, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    lines = []  # (seconds since start, line)
    started = time.monotonic()
    for line in process.stdout:
        lines.append((time.monotonic() - started, line.rstrip("\n")))
        if trigger in line:
            break
    else:
        raise RuntimeError(f"{phase}: the run ended before {trigger!r}:\n" + "\n".join(text for _, text in lines))
    time.sleep(wait_s)
    tree = psutil.Process(process.pid)
    for member in [tree, *tree.children(recursive=True)]:
        member.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    for line in process.stdout:
        lines.append((time.monotonic() - started, line.rstrip("\n")))
    process.wait()
    took = time.monotonic() - signalled
    batch_s = batch_seconds(lines, batch_kind)
    said = [text for _, text in lines if text.startswith("Stopping on")]
    result = {"phase": phase, "signal_to_exit_s": round(took, 1), "exit_status": process.returncode,
              "stop_line": said[-1] if said else None, "batch_s": round(batch_s, 1) if batch_s else None,
              "bound_s": round(BOUND_S + (batch_s or 0.0), 1)}
    result["met"] = result["exit_status"] == 75 and took <= result["bound_s"]
    print(json.dumps(result), flush=True)
    return result


def batch_seconds(lines: list[tuple[float, str]], kind):
    """The longest batch of the phase, from the spacing of the run's own lines (None: a phase whose
    stop waits for no batch, or HellaSwag's, whose passes print no line: its bound is BOUND_S alone)."""
    times = [at for at, text in lines if kind and f"| {kind} Loss" in text]
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    return max(gaps) if gaps else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "stops.json")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for phase in args.phases.split(","):
            results.append(measure(phase, Path(scratch), args.threads))
    path = args.json
    previous = json.loads(path.read_text())["phases"] if path.exists() else []
    kept = [entry for entry in previous if entry["phase"] not in {r["phase"] for r in results}]
    save_json(path, {"machine": machine(), "bound_s": BOUND_S, "phases": kept + results})


if __name__ == "__main__":
    main()
