"""Helpers shared by the benchmark scripts: interleaved repeats of several cases, and medians.

Runs in the benchmark's own process (python bench/<name>.py), never in a job.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Hashable, Iterable
from typing import Any


def interleaved(repeats: int, cases: Iterable[Hashable], measure: Callable[[Any], dict]) -> dict[Any, list[dict]]:
    """``measure(case)`` for every case, ``repeats`` rounds of all cases in turn (so that drift of the
    machine's load falls on every case alike); prints each record as it comes."""
    cases = list(cases)
    records: dict[Any, list[dict]] = {case: [] for case in cases}
    for repeat in range(repeats):
        for case in cases:
            record = measure(case)
            records[case].append(record)
            print(f"repeat {repeat + 1}/{repeats} {case}: {json.dumps(record)[:300]}", flush=True)
    return records


def medians(records: list[dict], keys: Iterable[str], digits: int = 3) -> dict:
    """For each of ``keys`` that some records hold: its median (rounded) and every value (``<key>_all``)."""
    summary: dict = {}
    for key in keys:
        values = [record[key] for record in records if key in record]
        if values:
            summary[key] = round(statistics.median(values), digits)
            summary[key + "_all"] = values
    return summary
