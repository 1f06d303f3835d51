"""How long the test suite takes: its quick tier (`pytest -m "not slow"`) and, with --full, all of it.

    python bench/bench_suite.py [--runs 2] [--full] [--json bench/results/suite.json] [-- PYTEST_ARGS]

Each run is `python -m pytest` started afresh from the repository root, as docs/testing.md gives the
commands (two xdist workers, pyproject.toml's settings), its output kept out of sight. For each run:
the wall time, what pytest counted (passed, failed, skipped, deselected...), its exit status and the
machine's load average when it began (the machine may be shared: a run beside other work is slower).
The quick tier's test count against the whole suite's comes from one `pytest --collect-only` first.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, RESULTS, save_json

TIERS = {"quick": ["-m", "not slow"], "full": []}
COUNTED = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)\b")


def counts(summary: str) -> dict[str, int]:
    """pytest's last line ("531 passed, 120 deselected, 2 warnings in 150.31s") as numbers, by kind."""
    found = {kind.rstrip("s") if kind.startswith(("error", "warning")) else kind: int(number)
             for number, kind in COUNTED.findall(summary)}
    return dict(sorted(found.items()))


def collected(extra: list[str]) -> dict[str, int]:
    """How many tests the quick tier selects of the whole suite's, from pytest's own collection
    ("521/674 tests collected (153 deselected)"; the workers' runs do not say what they deselected)."""
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
                             *TIERS["quick"], *extra], cwd=REPO, capture_output=True, text=True, check=True)
    last = result.stdout.strip().splitlines()[-1]
    quick, suite = re.match(r"(\d+)(?:/(\d+))? tests? collected", last).groups()
    return {"quick_tests": int(quick), "suite_tests": int(suite or quick)}


def run_tier(tier: str, extra: list[str]) -> dict:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", *TIERS[tier], *extra], cwd=REPO,
                            capture_output=True, text=True)
    seconds = time.perf_counter() - start
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    found = counts(summary)
    run = {"tier": tier, "wall_s": round(seconds, 1), "exit_status": result.returncode, "counts": found,
           "load_at_start": round(load, 2), "summary": summary}
    print(f"{tier}: {seconds:.0f} s, {summary} (exit {result.returncode}, load {load:.1f})", flush=True)
    if result.returncode != 0:
        print(result.stdout[-3000:], file=sys.stderr)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of the quick tier")
    parser.add_argument("--full", action="store_true", help="and one run of the whole suite")
    parser.add_argument("--json", type=Path, default=RESULTS / "suite.json")
    parser.add_argument("pytest_args", nargs="*", help="after --: more for pytest")
    args = parser.parse_args()

    figures = collected(args.pytest_args)
    runs = [run_tier("quick", args.pytest_args) for _ in range(args.runs)]
    if args.full:
        runs.append(run_tier("full", args.pytest_args))
    figures["quick_wall_s"] = [run["wall_s"] for run in runs if run["tier"] == "quick"]
    figures["quick_wall_s_median"] = statistics.median(figures["quick_wall_s"])
    full = [run["wall_s"] for run in runs if run["tier"] == "full"]
    if full:
        figures["full_wall_s"] = full[0]
    print(", ".join(f"{key} {value}" for key, value in figures.items()))
    save_json(args.json, {"command": "python -m pytest -m 'not slow'", **figures, "runs": runs})
    if any(run["exit_status"] != 0 for run in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
