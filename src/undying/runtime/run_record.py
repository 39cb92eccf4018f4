"""What a worker leaves in the run directory for the user: the job's result and the sample log.

Runs in the worker. At ``finish()`` the first member writes RUN_DIR/result.json (the final step,
the sizes the job ended at, the script's own result), atomically: a reader sees the whole file or
none. With ``sample_log: true`` every rank appends, for each step it committed, the sample indices
it trained on to RUN_DIR/samples/rank<rank>.jsonl (the fault tests compare them across recoveries).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from undying.data import ResumableLoader

RESULT_FILE = "result.json"
SAMPLES_DIR = "samples"


def write_result(run_dir: Path, payload: dict[str, Any]) -> None:
    """RUN_DIR/result.json holding ``payload``, replaced in one rename."""
    path = run_dir / RESULT_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
    os.replace(tmp, path)


def append_samples(run_dir: Path, step: int, rank: int, group_rank: int, replicas: int, generation: int,
                   loss: float | None, loaders: list[ResumableLoader], decided_at: float | None) -> None:
    """Append the sample indices rank ``rank`` used in committed ``step`` to its sample log, with
    ``decided``: the wall time at which its vote and commit fence let it apply the step (None: the
    step had no update to apply)."""
    directory = run_dir / SAMPLES_DIR
    directory.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"step": step, "rank": rank, "group_rank": group_rank,
                       "replicas": replicas, "generation": generation, "time": time.time(),
                       "decided": decided_at,
                       "loss": loss,
                       "loaders": [{"epoch": loader.step_epoch, "indices": loader.step_indices,
                                    "slots": loader.slot_count} for loader in loaders]})
    with open(directory / f"rank{rank:05d}.jsonl", "a") as log:
        log.write(line + "\n")
