"""A real loop's own state survives process-level recovery: examples/loop/train.py (warmup + cosine
LambdaLR on the wrapped optimizer, clipping, two accumulated micro-batches, bf16 autocast, dropout,
a registered counter) ends bitwise where a fault-free run ends after a killed worker
(recover-in-place), an exception in the step (retry), a hang (recover-in-place) and a lost node
(recover). The scheduler and the counter moved on in the failed step on the survivors; only the
rollback of the loop's state to the commit boundary makes the re-run, and what the replacement
receives, equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FINAL_STATE, REPO, JobRun, assert_ends_bitwise, run_job
from tests.faults.test_process_recovery import PROCESS_LEVEL, assert_survivors_kept
from undying import events as ev

pytestmark = pytest.mark.faults

LOOP_EXAMPLE = REPO / "examples" / "loop" / "train.py"
# Few steps, the fault after the warmup: the learning rate changes at every step of the run.
STEPS = 16
FAULT_STEP = 9


def run_loop(run_dir: Path, extra: list[str] | None = None) -> JobRun:
    return run_job(run_dir, extra, steps=STEPS, script=LOOP_EXAMPLE, timeout=120,
                   script_args=["--warmup", "4", "--final-state", str(run_dir / FINAL_STATE)])


@pytest.fixture(scope="module")
def loop_reference(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    run = run_loop(tmp_path_factory.mktemp("loop-reference"))
    assert run.returncode == 0, run.output + run.logs()
    return run


def assert_same_end(run: JobRun, reference: JobRun) -> None:
    assert run.returncode == 0, run.output + run.logs()
    assert run.result["final_step"] == STEPS
    assert_ends_bitwise(run, reference)
    for key in ("samples_seen", "last_lr", "final_loss"):
        assert run.result[key] == reference.result[key], key
    failed = run.kinds(ev.STEP_FAILED)
    assert failed and failed[0].step == FAULT_STEP, [(e.step, e.details) for e in failed]


def test_loop_state_after_killed_worker_recover_in_place(loop_reference: JobRun, tmp_path: Path) -> None:
    run = run_loop(tmp_path, [*PROCESS_LEVEL, "--inject", f"kill:rank=1:step={FAULT_STEP}"])
    assert_same_end(run, loop_reference)
    assert_survivors_kept(run, {1}, "recover-in-place")


def test_loop_state_after_exception_in_step_retry(loop_reference: JobRun, tmp_path: Path) -> None:
    run = run_loop(tmp_path, [*PROCESS_LEVEL, "--inject", f"raise:rank=2:step={FAULT_STEP}"])
    assert_same_end(run, loop_reference)
    assert_survivors_kept(run, set(), "retry")


def test_loop_state_after_hang_recover_in_place(loop_reference: JobRun, tmp_path: Path) -> None:
    run = run_loop(tmp_path, [*PROCESS_LEVEL, "--inject", f"hang:rank=3:step={FAULT_STEP}"])
    assert_same_end(run, loop_reference)
    assert_survivors_kept(run, {3}, "recover-in-place")


def test_loop_state_after_node_loss_recover(loop_reference: JobRun, tmp_path: Path) -> None:
    """Node 1 killed (both its workers): its ranks restart on the node's return and receive the
    survivors' loop state as of the commit; the survivors' own was wound back to it."""
    run = run_loop(tmp_path, [*PROCESS_LEVEL, "--inject", f"node:node=1:step={FAULT_STEP}"])
    assert_same_end(run, loop_reference)
    assert_survivors_kept(run, {2, 3}, "recover")
