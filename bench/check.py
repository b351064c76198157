"""`make bench-check`: a short run of the guarded benchmarks, each figure compared with the best
recorded one (bench/best.json). Fails when a figure is more than TOLERANCE worse, or a count
(queries per page) is any higher.

This VM's speed moves through the day (the CPU yardstick, sum(range(1000)), reads 8-37 µs), so
a figure that scales with the CPU is compared at the speed the best one was measured at: a rate
times yardstick-now / yardstick-then, a CPU cost times then / now. A figure measured against a
reference in the same run (a ratio, a hit rate) is compared as it is. Not part of `make test`:
timing in tests is banned; the closing note of a change to a hot path quotes this output.

Usage: python bench/check.py [--only heartbeat,billing,proxy,pool,catalog,routing]
       [--results FILE]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 0.30  # worse than the best by more than this fails
# Counts that do not move with the machine: one more than the best is a regression.
EXACT_UNITS = {"queries"}

# Each guarded benchmark, as the check runs it: short, every figure it guards still measured.
RUNS = {
    "heartbeat": ["bench/heartbeat.py", "--duration", "5", "--warmup", "1"],
    "billing": ["bench/billing.py", "--duration", "5", "--warmup", "1"],
    # One round of each load, direct, through Rigshare and through vllm-router (the ratio of
    # CPU per request against it, measured in the same run, is what the VM's speed moves least).
    "proxy": ["bench/proxy.py", "--rounds", "1"],
    # At the fleet size the goals are set for: the refresh every process makes each second,
    # a placement, the full read at start.
    "pool": ["bench/pool.py", "--sizes", "10000", "--refreshes", "100", "--placements", "2000",
             "--full-repeats", "1"],
    "catalog": ["bench/catalog.py", "--sizes", "10000"],
    # Capacity against the best static split driven directly, and follow-ups that find their
    # history cached, both measured against a reference in the same run.
    "routing": ["bench/routing.py", "--sections", "1,2", "--seconds", "4"],
}


def compare(best: dict, measured: dict) -> list[dict]:
    """One row per guarded figure: the best, the figure now, the figure at the best's CPU
    speed, and whether it is within TOLERANCE."""
    rows = []
    for bench, figures in best.items():
        if bench.startswith("_"):
            continue
        for name, then in figures.items():
            now = measured.get((bench, name))
            row = {"bench": bench, "figure": name, "best": then["value"],
                   "best_commit": then.get("commit", ""), "now": None, "at_best_speed": None,
                   "ok": False, "why": "not measured"}
            if now is not None:
                value = now["value"]
                speed = 1.0
                if now.get("scales", True) and now.get("yardstick_us") and then.get("yardstick_us"):
                    speed = now["yardstick_us"] / then["yardstick_us"]  # > 1: slower now
                adjusted = value * speed if now["better"] == "higher" else value / speed
                worse = (1 - adjusted / then["value"] if now["better"] == "higher"
                         else adjusted / then["value"] - 1)
                allowed = 0 if now["unit"] in EXACT_UNITS else TOLERANCE
                row.update(now=value, unit=now["unit"], at_best_speed=adjusted, worse=worse,
                           ok=worse <= allowed,
                           why=f"{worse:+.0%} against the best" if worse > 0 else "at or past the best")
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    width = max([len(r["figure"]) for r in rows] + [6])
    lines = [f"{'benchmark':<10} {'figure':<{width}} {'best':>10} {'now':>10} "
             f"{'at best speed':>14}  verdict"]
    for r in rows:
        now = f"{r['now']:,.2f}" if r["now"] is not None else "-"
        adjusted = f"{r['at_best_speed']:,.2f}" if r["at_best_speed"] is not None else "-"
        verdict = ("ok" if r["ok"] else "WORSE") + f" ({r['why']})"
        lines.append(f"{r['bench']:<10} {r['figure']:<{width}} {r['best']:>10,.2f} {now:>10} "
                     f"{adjusted:>14}  {verdict}")
    return "\n".join(lines)


def run(only: list[str], results: Path) -> None:
    env = dict(os.environ, BENCH_RESULTS=str(results))
    for bench in only:
        print(f"--- {bench}: {' '.join(RUNS[bench])}", flush=True)
        done = subprocess.run([sys.executable, *RUNS[bench]], cwd=REPO, env=env)
        if done.returncode:
            print(f"{bench}: the benchmark itself failed (exit {done.returncode})", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(RUNS), help="benchmarks to run")
    parser.add_argument("--results", type=Path,
                        help="compare the figures in this file (BENCH_RESULTS lines) instead "
                             "of running the benchmarks")
    args = parser.parse_args()
    best = json.loads((REPO / "bench" / "best.json").read_text())
    only = [name for name in args.only.split(",") if name]
    if args.results is None:
        results = Path(tempfile.mkstemp(prefix="bench-check-", suffix=".jsonl")[1])
        run(only, results)
    else:
        results = args.results
    measured = {}
    for line in results.read_text().splitlines():
        figure = json.loads(line)
        measured[(figure["bench"], figure["figure"])] = figure
    rows = [r for r in compare({k: v for k, v in best.items() if k in only}, measured)]
    print("\n" + table(rows))
    failed = [r for r in rows if not r["ok"]]
    print(f"\nbench-check: {len(rows) - len(failed)} of {len(rows)} figures within "
          f"{TOLERANCE:.0%} of the best recorded" + (": FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
