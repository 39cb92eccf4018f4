"""MTTR of a killed worker against when it dies: right after the start, early, and in steady state.

A warm standby that is not up yet cannot serve a fault, so what a recovery costs depends on when the
fault comes. The same job as bench/recovery.py (the example GPT, 2 simulated nodes x 2 workers, 60
steps, T1 every step) with recover-in-place and warm standbys, a SIGKILL of rank 1 at each of the
given steps, interleaved; recovery.py's measurement (``measure_undying``: detection, MTTR from the
kill to every rank's first step after it, restarted processes) and whether the replacement was
a warm standby (its rank log says so).

``--baseline-tree DIR`` runs an older checkout beside this one (its ``src`` first on PYTHONPATH).

    python bench/fault_time.py --steps 2 13 35 --repeats 3 --out bench/results/fault_time.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from interleave import interleaved, medians
from recovery import PROCESS, REPO, measure_undying


def row(records: list[dict]) -> dict:
    summary: dict = {"runs": len(records), "failed": sum(r["exit_code"] != 0 for r in records),
                     **medians(records, ("detect_seconds", "mttr_seconds", "steps_lost"))}
    summary["warm_replacements"] = sum(r.get("warm_replacements", 0) > 0 for r in records)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 13, 35], help="steps to kill rank 1 at")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-tree", type=Path, help="an older checkout to run beside this one")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"this tree": REPO}
    if args.baseline_tree is not None:
        trees = {"baseline": args.baseline_tree.resolve(), **trees}

    def kill_at(case: tuple[str, int]) -> dict:
        tree, step = case
        record = measure_undying([*PROCESS, "--inject", f"kill:rank=1:step={step}"], trees[tree])
        return {**record, "load_average": round(os.getloadavg()[0], 2)}

    records = interleaved(args.repeats, [(tree, step) for step in args.steps for tree in trees], kill_at)
    results = {f"{tree}, step {step}": row(runs) for (tree, step), runs in records.items()}
    print("| tree, kill at step | runs (failed) | replacement from a warm standby (runs) | detect s | MTTR s |")
    print("| --- | --- | --- | --- | --- |")
    for name, s in results.items():
        mttr = f"{s.get('mttr_seconds', '-')} ({', '.join(map(str, s.get('mttr_seconds_all', [])))})"
        print(f"| {name} | {s['runs']} ({s['failed']}) | {s['warm_replacements']} | {s.get('detect_seconds', '-')} "
              f"| {mttr} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"results": results, "trees": {k: str(v) for k, v in trees.items()},
                                        "runs": {f"{tree}, step {step}": v for (tree, step), v in records.items()}},
                                       indent=1))


if __name__ == "__main__":
    main()
