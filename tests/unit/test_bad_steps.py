"""Bad steps: the check's verdict from the vote's sums, the loss history every rank holds alike, and
what the controller does with the workers' bad-step events (the job machine on a fake clock)."""

from __future__ import annotations

import math

import pytest
import torch

from undying import events as ev
from undying.config.loading import validate_job_spec
from undying.controller.state import JobState
from undying.events import Event
from undying.protocol import AgentHello
from undying.runtime.step_check import REPORT_LEN, RecentLosses, StepCheck, gradients_of


def check(rank: int = 0, **spec: object) -> StepCheck:
    return StepCheck(validate_job_spec(spec), rank)


def summed(*reports: tuple[float, ...]) -> list[float]:
    return [sum(values) for values in zip(*reports, strict=True)]


def test_a_rank_whose_loss_is_not_finite_fails_the_step_and_is_named():
    mine, peer, third = check(rank=5), check(rank=0), check(rank=1)
    mine.watch({"loss": torch.tensor(float("nan"))})
    peer.watch({"loss": 2.0})
    grads = [torch.ones(3)]
    sums = summed(mine.vote_report(grads), peer.vote_report(grads), third.vote_report(grads))
    assert len(sums) == REPORT_LEN
    bad = mine.verdict(sums)
    assert bad is not None and bad.cause == "non-finite values on 1 rank(s)"
    assert math.isnan(bad.own["loss"]) and (bad.named, bad.named_count) == ([5], 1)
    other = peer.verdict(sums)  # the same verdict, this rank's values fine; the vote names rank 5 to it
    assert other is not None and other.own == {} and other.named == [5]
    third.watch({"loss": float("inf")})
    sums = summed(mine.vote_report(grads), peer.vote_report(grads), third.vote_report(grads))
    both = peer.verdict(sums)
    assert both is not None and (both.named, both.named_count) == ([], 2)  # each of them says so itself


def test_non_finite_gradients_fail_the_step_without_any_checked_value():
    step = check()
    report = step.vote_report([torch.tensor([1.0, float("inf")]), torch.ones(2)])
    bad = step.verdict(summed(report))
    assert bad is not None and "grad_norm" in bad.own


def test_a_clean_step_commits_and_its_mean_loss_joins_the_history():
    first, second = check(), check()
    first.watch({"loss": 1.0})
    first.watch({"loss": 3.0})  # two micro-batches: this rank's loss is their mean
    second.watch({"loss": 4.0})
    sums = summed(first.vote_report([torch.ones(2)]), second.vote_report([torch.ones(2)]))
    assert first.verdict(sums) is None
    first.committed(sums)
    assert list(first.recent.losses) == [3.0]


def test_a_loss_spike_is_judged_on_the_job_mean_once_the_window_is_full():
    step = check(loss_spike_factor=3.0, loss_spike_window=3)
    for loss in (2.0, 2.0):
        step.recent.losses.append(loss)
    step.watch({"loss": 100.0})
    assert step.verdict(summed(step.vote_report([]))) is None  # two of three: too little history yet
    step.recent.losses.append(2.0)
    bad = step.verdict(summed(step.vote_report([])))
    assert bad is not None and bad.cause.startswith("loss spike: 100 > 3 x its mean 2 over the last 3 steps")
    step.begin_step()
    step.watch({"loss": 5.9})
    assert step.verdict(summed(step.vote_report([]))) is None


def test_the_loss_history_is_job_state():
    recent = RecentLosses(window=2)
    recent.losses.extend([1.0, 2.0, 3.0])
    again = RecentLosses(window=2)
    again.load_state_dict(recent.state_dict())
    assert list(again.losses) == [2.0, 3.0] and again.mean() == 2.5


def test_values_to_watch_are_named_and_single():
    step = check()
    with pytest.raises(ValueError, match="value name '1x'"):
        step.watch({"1x": 1.0})
    with pytest.raises(ValueError, match="a tensor of 2 elements"):
        step.watch({"loss": torch.ones(2)})


def test_the_gradients_checked_are_every_wrapped_models_own():
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    assert [grad.shape for grad in gradients_of([model])] == [torch.Size([1, 2]), torch.Size([1])]


def bad_event(kind: str, rank: int, step: int, **details: object) -> dict:
    return Event(kind, rank=rank, node=rank // 2, step=step, generation=1, details=details).__dict__


def test_the_controller_names_the_ranks_and_stops_a_job_whose_bad_step_repeats(make_job):
    job = make_job(nnodes=2, nproc_per_node=2)
    job.start_running()
    # Two ranks' values were bad: the vote names neither, each says so itself (in any order).
    job.controller.worker_event(bad_event(ev.BAD_VALUE, 1, 12, attempt=1, values={"loss": "nan"}))
    job.controller.worker_event(bad_event(ev.BAD_STEP, 0, 12, attempt=1, action="replay", cause="non-finite",
                                          ranks=[]))
    job.controller.worker_event(bad_event(ev.BAD_VALUE, 2, 12, attempt=1, values={"loss": "nan"}))
    job.controller.worker_event(bad_event(ev.BAD_STEP, 0, 12, attempt=2, action="stop", cause="non-finite",
                                          ranks=[]))
    assert job.controller.state is JobState.FAILED and job.exit_code == 1
    assert job.controller.message == ("step 12 was bad again when replayed (non-finite; bad values on rank(s) "
                                      "[1, 2]); stopped by bad_step_repeat: stop")
    assert [event.details["ranks"] for event in job.events(ev.BAD_STEP)] == [[1], [1, 2]]
    kinds = [event.kind for event in job.events() if event.kind in (ev.BAD_STEP, ev.JOB_END)]
    assert kinds == [ev.BAD_STEP, ev.BAD_STEP, ev.JOB_END]  # the cause is logged before the end
    # No heartbeat told the controller of any step: every rank joined step 12's vote, so the job
    # ends having committed the 12 steps before it.
    [end] = job.events(ev.JOB_END)
    assert end.step == 12, end


def test_a_transient_bad_step_switches_the_ranks_node_when_asked(make_job):
    job = make_job(nnodes=2, nproc_per_node=2, process_recover=True, bad_step_transient="switch",
                   straggler_strategy="off")
    assert job.controller.hello(AgentHello(2, 1002, "spare", 2, standby=True)).accepted
    job.start_running()
    job.controller.worker_event(bad_event(ev.BAD_STEP, 0, 12, attempt=1, action="replay", cause="non-finite",
                                          ranks=[3]))
    job.controller.worker_event(bad_event(ev.BAD_STEP, 0, 12, attempt=2, action="replayed", cause="clean"))
    job.advance(0.05)
    [begin] = job.events(ev.SWITCH_BEGIN)
    assert begin.node == 1 and "transient bad step at step 12" in begin.details["why"]
