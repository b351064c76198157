"""The figures a benchmark run measured, for `make bench-check` (bench/check.py) to compare
with the best recorded ones. A benchmark calls `record(...)` for each figure it measured; when
BENCH_RESULTS names a file, each figure is appended to it as one JSON line. Without it nothing is
written: the benchmark's printed table is its report."""

import json
import os
import subprocess
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_yardstick_us() -> float:
    """How long this machine takes for sum(range(1000)) now, in µs (the best of five): a VM's
    speed moves from hour to hour, and figures from different hours are compared through it."""
    return min(timeit.repeat("sum(range(1000))", number=10_000, repeat=5)) / 10_000 * 1e6


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def record(bench: str, figure: str, value: float, unit: str, *, better: str,
           yardstick_us: float | None = None, scales: bool = True) -> None:
    """One figure. `better`: "higher" or "lower". `scales`: whether the figure moves with the
    machine's CPU speed (rates and CPU costs do; a ratio against a reference measured in the
    same run, or a hit rate, does not)."""
    path = os.environ.get("BENCH_RESULTS")
    if not path:
        return
    if better not in ("higher", "lower"):
        raise ValueError(better)
    line = {"bench": bench, "figure": figure, "value": value, "unit": unit, "better": better,
            "scales": scales, "yardstick_us": yardstick_us, "commit": commit()}
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")
