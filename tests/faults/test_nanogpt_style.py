"""A GPT trainer written the way nanoGPT's train.py is (tests/scripts/nanogpt_style.py: accumulation
through ``require_backward_grad_sync``, a disabled GradScaler, its own ``get_lr`` written into the
param groups, its own ``ckpt.pt`` with ``iter_num``, ``init_from='resume'``, ``raw_model =
model.module``, batches that ft.dataloader's worker prefetches across steps) keeps its result.

One chain of runs: the script trains from scratch under plain ``python`` (one process) and writes
its checkpoint at iteration 8; two 4-rank ``undying run`` jobs resume from it with
``init_from='resume'`` (``ft.steps(max_iters, start=iter_num)``): one fault-free, one through a
SIGKILL (recover-in-place), an exception (retry), a hang (recover-in-place) and a lost node
(recover), which must end bitwise where the fault-free one ends. nanoGPT's own prefetch into
``X, Y`` is refused at its first step, before it can change a result.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import undying
from tests.conftest import REPO, JobRun, assert_ends_bitwise, run_job
from undying import events as ev

pytestmark = pytest.mark.faults

SCRIPT = REPO / "tests" / "scripts" / "nanogpt_style.py"
# `--recover-strategy` with a process-level strategy turns process_recover on by itself.
CHAIN = ["--set", "pod_rescheduling=on", "--recover-strategy", "retry,recover-in-place,recover"]
SAVED_AT = 8  # the iteration of the plain run's last checkpoint (eval_interval 8, 9 iterations)
STEPS = 20
FAULTS = {10: ("kill:rank=1", "recover-in-place"), 12: ("raise:rank=2", "retry"),
          14: ("hang:rank=3", "recover-in-place"), 17: ("node:node=1", "recover")}


def plain_python(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("UNDYING_")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=240)


def script_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nanogpt_style", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain ``python train.py`` run: one process, ``undying.init()`` outside ``undying run``; the
    script's own ckpt.pt (holding the step value as ``iter_num``) and undying's result.json in a
    fresh run directory."""
    cwd = tmp_path_factory.mktemp("nanogpt-plain")
    done = plain_python(cwd, "--steps", str(SAVED_AT + 1), "--out-dir", "out", "--gradient-accumulation-steps", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"iter {SAVED_AT}: loss" in done.stdout
    [run_dir] = (cwd / "runs").iterdir()
    assert run_dir.name.startswith("standalone-")
    assert f'"final_step": {SAVED_AT + 1}' in (run_dir / "result.json").read_text()
    # The resume below loads it as nanoGPT does (torch.load's weights_only default, in a process where
    # undying allowlisted int); a tool that does not import undying needs add_safe_globals([int]), for
    # good: the safe_globals context removes int on exit, even where undying had allowlisted it.
    torch.serialization.add_safe_globals([int])
    checkpoint = torch.load(cwd / "out" / "ckpt.pt")
    assert checkpoint["iter_num"] == SAVED_AT and type(checkpoint["iter_num"]) is int
    return cwd / "out"


def resumed_run(run_dir: Path, saved: Path, extra: list[str]) -> JobRun:
    out_dir = run_dir / "out"
    shutil.copytree(saved, out_dir)
    run = run_job(run_dir, [*CHAIN, *extra], steps=STEPS, script=SCRIPT, timeout=240,
                  script_args=["--init-from", "resume", "--out-dir", str(out_dir)])
    assert run.returncode == 0, run.output + run.logs()
    assert run.result["final_step"] == STEPS
    assert "[undying] recovery: retry -> recover-in-place -> recover -> job-restart -> exit;" in run.output
    return run


@pytest.fixture(scope="module")
def resumed_reference(saved_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    return resumed_run(tmp_path_factory.mktemp("nanogpt-resumed"), saved_checkpoint, [])


def test_its_own_resume_continues_from_its_iter_num_with_the_saved_weights_on_every_rank(
        resumed_reference: JobRun, saved_checkpoint: Path) -> None:
    gpt = script_module()
    torch.serialization.add_safe_globals([int])
    checkpoint = torch.load(saved_checkpoint / "ckpt.pt")
    model = gpt.GPT(gpt.GPTConfig(**checkpoint["model_args"]))
    model.load_state_dict(checkpoint["model"])
    saved = undying.param_sha256(model)
    assert resumed_reference.result["first_iter"] == SAVED_AT
    for rank in range(4):
        log = (resumed_reference.run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"rank {rank} first iter {SAVED_AT} params {saved}" in log, log[-2000:]


def test_sigkill_exception_hang_and_node_loss_end_bitwise_where_the_fault_free_run_ends(
        resumed_reference: JobRun, saved_checkpoint: Path, tmp_path: Path) -> None:
    injections = [argument for step, (fault, _) in FAULTS.items() for argument in ("--inject", f"{fault}:step={step}")]
    run = resumed_run(tmp_path, saved_checkpoint, injections)
    assert_ends_bitwise(run, resumed_reference)
    assert not run.kinds(ev.RESTART_BEGIN), "every fault is recovered in place of the processes"
    decisions = [(event.step, event.details["strategy"]) for event in run.kinds(ev.DECISION)]
    assert [strategy for _, strategy in decisions] == [strategy for _, strategy in FAULTS.values()], decisions
    assert sorted({event.step for event in run.kinds(ev.STEP_FAILED)}) == sorted(FAULTS)
    # A survivor's log says why the lines of a step appear twice.
    survivor_log = (tmp_path / "logs" / "rank0.log").read_text()
    for step in FAULTS:
        assert f"--- undying: rank 0 continues at step {step} (generation" in survivor_log
    for recovered in run.kinds(ev.RECOVERED):
        assert recovered.details["wait_for_plan"] >= 0, recovered.details


def test_nanoGPTs_prefetch_into_variables_is_refused_at_the_first_step(tmp_path: Path) -> None:
    """``X, Y = get_batch('train')`` before the loop and again at the end of the body: after a fault
    the re-run step would train on the failed attempt's batch. Refused at step 0, in one line."""
    done = plain_python(tmp_path, "--steps", "3", "--out-dir", "out", "--prefetch-in-variable")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("undying.runtime.carried_batches.CarriedBatchError: undying: step 0 calls the model "
                           "before drawing any batch of its own"), done.stderr[-3000:]
    assert "X, Y = next(loader)" in last and "docs/migrating.md" in last
    assert "iter 0: loss" not in done.stdout
