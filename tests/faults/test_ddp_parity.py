"""A loop keeps its meaning under undying: examples/loop/train.py (warmup + cosine schedule, active
clipping, two micro-batches with ``no_sync``, bf16 autocast, dropout, AdamW, a DataLoader with 2
worker processes, the loss all-reduced with ``torch.distributed``) on 2 simulated nodes x 2
workers ends with the parameters examples/loop/train_ddp.py ends with under torchrun + stock DDP
on 4 processes, bit for bit: both average gradients during backward, in one bucket, in the same
order, and clip the average. The same DDP script clipping each rank's own gradients before
averaging them (what a loop whose gradients are averaged at ``opt.step()`` computes) ends visibly
elsewhere: the comparison can tell the two apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_job

pytestmark = pytest.mark.faults

LOOP = REPO / "examples" / "loop"
STEPS = 16
ARGS = ["--warmup", "4", "--num-workers", "2"]
# Clipping the local gradients moves the parameters by ~7e-3 after 16 steps (measured); the
# comparison must see far more than float noise between the two.
VISIBLE = 1e-3


def torchrun_loop(final_state: Path, extra: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               str(LOOP / "train_ddp.py"), "--steps", str(STEPS), *ARGS, "--final-state", str(final_state), *extra]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def max_difference(a: Path, b: Path) -> float:
    left, right = torch.load(a), torch.load(b)
    assert left.keys() == right.keys()
    return max((left[key].float() - right[key].float()).abs().max().item() for key in left)


def test_the_loop_ends_where_torchrun_ddp_ends(tmp_path: Path) -> None:
    run = run_job(tmp_path / "undying", steps=STEPS, script=LOOP / "train.py", timeout=200,
                  script_args=[*ARGS, "--final-state", str(tmp_path / "undying.pt")])
    assert run.returncode == 0, run.output + run.logs()
    ddp = torchrun_loop(tmp_path / "ddp.pt", [])
    torchrun_loop(tmp_path / "local-clip.pt", ["--clip-before-average"])

    undying_state, ddp_state = torch.load(tmp_path / "undying.pt"), torch.load(tmp_path / "ddp.pt")
    unequal = [key for key in ddp_state if not torch.equal(undying_state[key], ddp_state[key])]
    assert unequal == [], f"not bitwise equal to torchrun + DDP: {unequal}, " \
                          f"max |diff| {max_difference(tmp_path / 'undying.pt', tmp_path / 'ddp.pt'):.3g}"
    assert run.result["param_sha256"] == ddp["param_sha256"]
    assert run.result["final_loss"] == ddp["final_loss"]  # all-reduced through torch.distributed by both
    assert max_difference(tmp_path / "undying.pt", tmp_path / "local-clip.pt") > VISIBLE
