"""Scripts written the way popular trainers are keep DDP's meaning and their result under undying.

tests/scripts/classify.py (torchvision's reference classification loop: BatchNorm with DDP's default
``broadcast_buffers``, label smoothing, SGD with norm layers undecayed, warmup + cosine per epoch,
``model.module`` saved, an all-reduced evaluation) on 2 simulated nodes x 2 workers ends with the
parameters and BatchNorm buffers its torchrun + DDP twin ends with, bit for bit; and after a killed
rank 0 (recover-in-place: its replacement's buffers must be rank 0's), an exception (retry), a hang
(recover-in-place) and a lost node (recover), all in one run, bitwise where its fault-free run ends.
tests/scripts/nanogpt.py (nanoGPT's loop: accumulation through ``require_backward_grad_sync``, its
own lr function, a disabled GradScaler) ends bitwise where its torchrun + DDP twin ends: both sum
the first step in DDP's first bucket layout and every later one in the rebuilt one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, JobRun, assert_ends_bitwise, run_job
from tests.faults.test_process_recovery import PROCESS_LEVEL
from undying import events as ev

pytestmark = pytest.mark.faults

SCRIPTS = REPO / "tests" / "scripts"
CLASSIFY_STEPS = 20
GPT_STEPS = 12
FAULTS = ["kill:rank=0:step=4", "raise:rank=2:step=8", "hang:rank=3:step=12", "node:node=1:step=16"]


def torchrun(script: str, steps: int, final_state: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               str(SCRIPTS / script), "--steps", str(steps), "--final-state", str(final_state)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_classifier(run_dir: Path, extra: list[str] | None = None) -> JobRun:
    return run_job(run_dir, extra, steps=CLASSIFY_STEPS, script=SCRIPTS / "classify.py", timeout=200,
                   script_args=["--final-state", str(run_dir / "final.pt")])


def assert_bitwise(left: Path, right: Path) -> None:
    a, b = torch.load(left), torch.load(right)
    a, b = a.get("model", a), b.get("model", b)
    assert a.keys() == b.keys()
    unequal = {key: (a[key].double() - b[key].double()).abs().max().item()
               for key in a if not torch.equal(a[key], b[key])}
    assert not unequal, f"not bitwise equal (max |diff| per tensor): {unequal}"


@pytest.fixture(scope="module")
def classifier_reference(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    run = run_classifier(tmp_path_factory.mktemp("classify-reference"))
    assert run.returncode == 0, run.output + run.logs()
    return run


def test_the_classifier_ends_where_torchrun_ddp_ends(classifier_reference: JobRun, tmp_path: Path) -> None:
    ddp = torchrun("classify_ddp.py", CLASSIFY_STEPS, tmp_path / "ddp.pt")
    assert_bitwise(classifier_reference.run_dir / "final.pt", tmp_path / "ddp.pt")  # running stats included
    assert classifier_reference.result["param_sha256"] == ddp["param_sha256"]
    assert classifier_reference.result["accuracy"] == ddp["accuracy"]  # evaluated with rank 0's buffers by both


def test_the_classifier_after_four_faults_ends_where_its_fault_free_run_ends(classifier_reference: JobRun,
                                                                           tmp_path: Path) -> None:
    run = run_classifier(tmp_path, [*PROCESS_LEVEL, *(arg for fault in FAULTS for arg in ("--inject", fault))])
    assert run.returncode == 0, run.output + run.logs()
    assert sorted({event.step for event in run.kinds(ev.STEP_FAILED)}) == [4, 8, 12, 16], \
        [(event.step, event.details) for event in run.kinds(ev.STEP_FAILED)]
    strategies = [plan.details["strategy"] for plan in run.kinds(ev.RECOVERY_PLAN)]
    assert {"recover-in-place", "retry", "recover"} <= set(strategies), strategies
    assert not run.kinds(ev.RESTART_BEGIN), "a process-level fault must not restart the job"
    assert_ends_bitwise(run, classifier_reference)
    assert_bitwise(run.run_dir / "final.pt", classifier_reference.run_dir / "final.pt")


def test_sync_batchnorm_on_cpu_is_refused_at_start_in_one_line(tmp_path: Path) -> None:
    """torch has no CPU kernels for SyncBatchNorm (DDP refuses it on CPU too): one line, no restarts."""
    run = run_job(tmp_path, ["--max-restarts", "0"], steps=2, script=SCRIPTS / "classify.py", timeout=120,
                  script_args=["--sync-bn"])
    assert run.returncode != 0
    assert "ValueError: ft.wrap_model: SyncBatchNorm (1) needs a GPU: torch has no CPU kernels" in run.logs()


def test_nanogpt_with_require_backward_grad_sync_ends_where_torchrun_ddp_ends(tmp_path: Path) -> None:
    run = run_job(tmp_path, steps=GPT_STEPS, script=SCRIPTS / "nanogpt.py", timeout=200,
                  script_args=["--final-state", str(tmp_path / "undying.pt")])
    assert run.returncode == 0, run.output + run.logs()
    ddp = torchrun("nanogpt_ddp.py", GPT_STEPS, tmp_path / "ddp.pt")
    assert_bitwise(tmp_path / "undying.pt", tmp_path / "ddp.pt")
    assert run.result["param_sha256"] == ddp["param_sha256"]
