"""Scripts as they are written: the step value is an ``int`` wherever a script puts it (a checkpoint
dict, JSON, an f-string); a script's own resume tells ``ft.steps()`` where to start, the first rank's
state on every rank, undying's own state winning when it has one; a prefetched batch is refused
inside ``with step:`` even with ``retry``; and a plain-python run is one process in a fresh run
directory (torchrun's environment refused in one line). Standalone runtimes in this process, and
ranks as threads for what takes two."""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.gloo_ranks import run_ranks
from undying.config import JobSpec
from undying.runtime.carried_batches import CarriedBatchError
from undying.runtime.core import Runtime
from undying.runtime.ddp import FixedLayoutDDP
from undying.runtime.loop_start import agree_on_start, start_from_script_checkpoint
from undying.runtime.optim import CommitOptimizer
from undying.runtime.pg import GenerationGroup
from undying.runtime.training_state import TrainingState
from undying.worker_env import WorkerEnv, worker_env_of_this_process

_RUNTIMES: list[Runtime] = []


def standalone(run_dir: Path, **spec: Any) -> Runtime:
    runtime = Runtime(WorkerEnv(spec=JobSpec(**spec), run_dir=run_dir))
    _RUNTIMES.append(runtime)
    return runtime


@pytest.fixture(autouse=True)
def _close_runtimes() -> Iterator[None]:
    """A runtime a test left unfinished (its loop raised) still holds torch's default group: close it,
    so that later tests may make their own."""
    yield
    while _RUNTIMES:
        runtime = _RUNTIMES.pop()
        if not runtime.finished:
            runtime.checkpoints.close()
            runtime.membership.close()


def small_job(ft: Runtime) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = ft.wrap_model(torch.nn.Linear(4, 1))
    opt = ft.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    data = [(torch.full((4,), float(i)), torch.tensor([float(i % 3)])) for i in range(64)]
    return model, opt, ft.dataloader(data, batch_size=4, seed=1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def test_the_step_value_is_an_int_wherever_a_script_puts_it(tmp_path: Path) -> None:
    ft = standalone(tmp_path)
    model, opt, loader = small_job(ft)
    for step in ft.steps(2):
        with step:
            train_step(model, opt, *next(loader))
        checkpoint = {"iter_num": step, "model": model.module.state_dict()}
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)  # failed with "cannot pickle 'socket' object"
        buffer.seek(0)
        loaded = torch.load(buffer)["iter_num"]
        assert loaded == step and type(loaded) is int
        assert type(pickle.loads(pickle.dumps(step))) is int
        assert json.dumps({"iter_num": step}) == f'{{"iter_num": {int(step)}}}'
        assert f"{step:04d}" == f"{int(step):04d}" and type(step + 1) is int and type(step * 2) is int
    ft.finish()


def test_a_prefetched_batch_is_refused_even_where_retry_would_re_run_the_step(tmp_path: Path) -> None:
    """The refusal is the script's error: ``with step:`` must not take it for a transient one."""
    ft = standalone(tmp_path, process_recover=True, recover_strategy=["retry"])
    model, opt, loader = small_job(ft)
    x, y = next(loader)  # nanoGPT: the first batch before the loop
    with pytest.raises(CarriedBatchError, match="step 0 calls the model before drawing"):
        for step in ft.steps(3):
            with step:
                train_step(model, opt, x, y)
                x, y = next(loader)  # ... and the next one at the end of the body


def test_eval_forwards_and_validation_batches_are_not_training_forwards(tmp_path: Path) -> None:
    """nanoGPT evaluates at the top of a step, under no_grad, on batches of its own; then it trains
    on a batch drawn in the step. Neither the eval forward nor a validation loader's draw is taken
    for a batch carried in."""
    ft = standalone(tmp_path)
    model, opt, loader = small_job(ft)
    validation = ft.dataloader([(torch.zeros(4), torch.zeros(1))] * 16, batch_size=4)
    for step in ft.steps(4):
        with step:
            with torch.no_grad():
                model(torch.ones(2, 4))  # data of its own: not looked at
                model(next(validation)[0])
            train_step(model, opt, *next(loader))
            if step % 2 == 1:
                with torch.no_grad():
                    model(next(validation)[0])  # drawn after this step's training forward
    ft.finish()


def test_start_resumes_at_the_scripts_step_unless_undying_holds_state(tmp_path: Path) -> None:
    ft = standalone(tmp_path, checkpoint={"interval": 2})
    model, opt, loader = small_job(ft)
    assert [int(step) for step in ft.steps(6, start=4)] == [4, 5]  # nothing restored: the script's step
    ft.finish()  # step 6 committed to RUN_DIR/checkpoints

    again = standalone(tmp_path, checkpoint={"interval": 2})
    small_job(again)
    with pytest.warns(UserWarning, match="starts at step 6, restored from undying's own state, not at start=3"):
        steps = [int(step) for step in again.steps(8, start=3)]
    assert steps == [6, 7]
    again.finish()


def test_a_start_that_is_not_a_step_is_refused(tmp_path: Path) -> None:
    ft = standalone(tmp_path)
    small_job(ft)
    with pytest.raises(ValueError, match="start must be an integer >= 0"):
        next(iter(ft.steps(3, start=-1)))


def test_every_rank_starts_from_the_first_ranks_state() -> None:
    """Rank 1 loaded other weights and another optimizer state (another file, or none): after the
    start, it holds rank 0's, at rank 0's committed step."""

    def rank(group: GenerationGroup) -> tuple[int, list[float], float]:
        torch.manual_seed(group.rank)  # different weights per rank
        state = TrainingState(holds_state=True)
        model = FixedLayoutDDP(torch.nn.Linear(3, 1), lambda: group, torch.device("cpu"), broadcast=False)
        inner = torch.optim.SGD(model.parameters(), lr=0.1 * (group.rank + 1), momentum=0.9)
        state.models.append(model)
        state.optimizers.append(CommitOptimizer(inner, lambda: True, lambda phase: None))
        assert agree_on_start(group, 7, torch.device("cpu")) == 7
        start_from_script_checkpoint(state, group, torch.device("cpu"), 7)
        return state.committed_step, model.module.weight.flatten().tolist(), inner.param_groups[0]["lr"]

    first, second = run_ranks(2, rank, prefix="start")
    assert first == second and first[0] == 7 and first[2] == pytest.approx(0.1)


def test_ranks_that_pass_different_starts_are_refused_alike() -> None:
    def rank(group: GenerationGroup) -> str:
        with pytest.raises(ValueError) as refused:
            agree_on_start(group, [5, None][group.rank], torch.device("cpu"))
        return str(refused.value)

    messages = run_ranks(2, rank, prefix="starts")
    assert messages[0] == messages[1] and "start differs between ranks (1 of 2 passed one" in messages[0]
    assert run_ranks(2, lambda group: agree_on_start(group, None, torch.device("cpu")), prefix="none") == [None] * 2


def test_a_plain_python_run_is_one_process_in_a_fresh_run_directory() -> None:
    first, second = worker_env_of_this_process({}), worker_env_of_this_process({"UNDYING_RUN_DIR": "runs/mine"})
    assert first.world_size == 1 and first.controller is None
    assert first.run_dir.parent == Path("runs") and first.run_dir.name.startswith("standalone-")
    assert second.run_dir == Path("runs/mine")


def test_torchruns_environment_without_undying_run_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError) as refused:
        worker_env_of_this_process({"RANK": "1", "WORLD_SIZE": "4"})
    message = str(refused.value)
    assert "\n" not in message and "WORLD_SIZE=4" in message and "undying run --nproc-per-node 4" in message
