"""/metrics by Prometheus' conventions, computed from a synthetic event stream (no processes).

The metrics are fed the events a controller logs, in order, and scraped as a Prometheus server
would: the text parsed with prometheus_client's parser. A real job's metrics across a real
recovery: tests/faults/test_observe.py.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from undying import events as ev
from undying.config import JobSpec
from undying.controller.job_view import JobView
from undying.controller.machine import JobMachine
from undying.controller.metrics import JobMetrics
from undying.controller.status import job_status
from undying.events import Event

T0 = 1_700_000_000.0
STEP_SECONDS = 0.1  # every synthetic step takes this long
BEAT_EVERY = 5  # steps between two sampled heartbeats of a rank


class Stream:
    """Events of a 2 x 2 job, as its controller would log them, with a clock in steps."""

    def __init__(self, ranks: int = 4) -> None:
        self.ranks = ranks
        self.events: list[Event] = [Event(ev.JOB_START, T0, details={"world_size": ranks})]
        self.time = T0
        self.generation = 0
        self.step = 0

    def add(self, kind: str, **fields: Any) -> Event:
        event = Event(kind, self.time, **fields)
        self.events.append(event)
        return event

    def start_generation(self, restored: int | None = None) -> None:
        self.generation += 1
        self.add(ev.GENERATION_START, generation=self.generation, details={"world_size": self.ranks})
        if restored is not None:
            self.step = restored
            for rank in range(self.ranks):
                self.add(ev.CHECKPOINT_LOAD, rank=rank, node=rank // 2, step=restored, generation=self.generation)

    def train(self, until: int, loss: float = 2.0) -> None:
        while self.step < until:
            self.step += 1
            self.time += STEP_SECONDS
            if self.step % BEAT_EVERY == 0:
                for rank in range(self.ranks):
                    self.add(ev.HEARTBEAT, rank=rank, node=rank // 2, step=self.step, generation=self.generation,
                             details={"phase": "computing", "loss": loss + rank, "lr": 0.01})
            if self.step % 10 == 0:
                self.add(ev.CHECKPOINT_SAVE, rank=0, node=0, step=self.step, generation=self.generation,
                         details={"seconds": 0.4, "stall": 0.003, "bytes": 1000})

    def fault(self, strategy: str, rank: int = 1) -> float:
        fault = self.add(ev.FAULT_DETECTED, rank=rank, node=rank // 2, step=self.step, generation=self.generation,
                         details={"reason": "worker_exit", "description": f"rank {rank} exited (killed by SIGKILL)"})
        self.add(ev.DECISION, step=self.step, generation=self.generation, details={"strategy": strategy})
        return fault.time

    def recover_in_place(self) -> None:
        self.generation += 1
        self.time += 0.3
        for rank in range(self.ranks):
            self.add(ev.RECOVERED, rank=rank, node=rank // 2, step=self.step, generation=self.generation,
                     details={"strategy": "recover-in-place", "wait_for_plan": 0.25, "rebuild": 0.02,
                              "repair": 0.05, "total": 0.32})
        self.first_steps()

    def first_steps(self) -> None:
        resumed = self.step
        self.step += 1
        self.time += STEP_SECONDS
        for rank in range(self.ranks):
            self.add(ev.FIRST_STEP, rank=rank, node=rank // 2, step=self.step, generation=self.generation,
                     details={"resumed_from": resumed})


def scrape(metrics: JobMetrics) -> dict[str, Any]:
    """The exposition as a scraper parses it: family name -> family."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def value(families: dict[str, Any], sample_name: str, **labels: str) -> float:
    family_name = sample_name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    family_name = family_name.removesuffix("_bucket")
    for sample in families[family_name].samples:
        if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return float(sample.value)
    raise AssertionError(f"no sample {sample_name} {labels}")


def metrics_of(events: list[Event], spec: JobSpec | None = None) -> JobMetrics:
    machine = JobMachine(spec or JobSpec(nnodes=2, nproc_per_node=2), "job-metrics", "127.0.0.1:29555")
    holder: list[JobMetrics] = []
    metrics = JobMetrics(status=lambda: job_status(machine, 0.0, holder[0], time.time()))
    holder.append(metrics)
    for event in events:
        metrics.observe(event)
    return metrics


def recovered_run() -> tuple[Stream, float, float]:
    """Steps 1-12, a rank killed and recovered in place, steps to 23, another killed and the job
    restarted from the checkpoint of step 20, steps to 30. Returns the stream and both faults' times."""
    stream = Stream()
    stream.start_generation()
    stream.train(12)
    first = stream.fault("recover-in-place")
    stream.recover_in_place()
    stream.train(23)
    second = stream.fault("job-restart", rank=2)
    stream.add(ev.RESTART_BEGIN, generation=stream.generation)
    stream.time += 2.0
    stream.start_generation(restored=20)
    stream.first_steps()
    stream.train(30)
    return stream, first, second


def test_counters_and_histograms_follow_the_events():
    stream, first_fault, second_fault = recovered_run()
    families = scrape(metrics_of(stream.events))

    assert families["undying_steps"].type == "counter"
    # 30 steps of work, and steps 21-23 done twice (the restart rolled them back).
    assert value(families, "undying_steps_total") == 33
    assert value(families, "undying_faults_total", reason="worker_exit") == 2
    assert value(families, "undying_recoveries_total", strategy="recover-in-place") == 1
    assert value(families, "undying_recoveries_total", strategy="job-restart") == 1

    assert families["undying_mttr_seconds"].type == "histogram"
    assert value(families, "undying_mttr_seconds_count") == 2
    first_steps = [e.time for e in stream.events if e.kind == ev.FIRST_STEP]
    expected = (first_steps[0] - first_fault) + (first_steps[-1] - second_fault)
    assert value(families, "undying_mttr_seconds_sum") == pytest.approx(expected)
    # Every rank's part of the recovery, by phase.
    for phase, seconds in (("wait_for_plan", 0.25), ("rebuild", 0.02), ("repair", 0.05)):
        assert value(families, "undying_recovery_phase_seconds_count", strategy="recover-in-place", phase=phase) == 4
        assert value(families, "undying_recovery_phase_seconds_sum", strategy="recover-in-place",
                     phase=phase) == pytest.approx(4 * seconds)

    count = value(families, "undying_step_seconds_count")
    assert count > 0
    assert value(families, "undying_step_seconds_sum") / count == pytest.approx(STEP_SECONDS)
    saves = [e for e in stream.events if e.kind == ev.CHECKPOINT_SAVE]
    assert value(families, "undying_checkpoint_stall_seconds_count") == len(saves)
    assert value(families, "undying_checkpoint_persist_seconds_sum") == pytest.approx(0.4 * len(saves))
    assert value(families, "undying_checkpoint_durable_step") == 30
    assert value(families, "undying_checkpoint_durable_age_seconds") >= 0


def test_state_is_a_state_set_and_scalars_are_aggregated_over_ranks():
    stream, _, _ = recovered_run()
    families = scrape(metrics_of(stream.events))
    states = {sample.labels["undying_job_state"]: sample.value for sample in families["undying_job_state"].samples}
    assert states["waiting_for_nodes"] == 1 and sum(states.values()) == 1 and "running" in states
    # Rank r logged loss 2 + r: the mean, min and max over the 4 ranks of the newest generation.
    assert value(families, "undying_train_loss", stat="mean") == pytest.approx(3.5)
    assert value(families, "undying_train_loss", stat="min") == 2
    assert value(families, "undying_train_loss", stat="max") == 5
    assert value(families, "undying_train_lr", stat="mean") == pytest.approx(0.01)
    assert value(families, "undying_recoveries_counted") == 0  # the machine here ran nothing
    assert value(families, "undying_max_restarts") == 32767


def test_one_registry_counters_only_grow_between_scrapes():
    stream, _, _ = recovered_run()
    metrics = metrics_of(stream.events[:40])
    before = scrape(metrics)
    for event in stream.events[40:]:
        metrics.observe(event)
    after = scrape(metrics)
    assert value(after, "undying_steps_total") > value(before, "undying_steps_total")
    assert value(after, "undying_faults_total", reason="worker_exit") == 2


def test_series_do_not_grow_with_the_ranks():
    """At 16k ranks a per-rank series would be 16k series a name: none is per rank."""
    def series(ranks: int) -> int:
        stream = Stream(ranks=ranks)
        stream.start_generation()
        stream.train(10)
        families = scrape(metrics_of(stream.events, JobSpec(nnodes=ranks // 8, nproc_per_node=8)))
        return sum(len(family.samples) for family in families.values())

    assert series(16) == series(16384)


def test_the_view_follows_one_rank_and_measures_the_pace():
    stream = Stream()
    stream.start_generation()
    stream.train(40)
    view = JobView()
    for event in stream.events:
        view.observe(event)
    rate = view.steps_per_second(stream.time)
    assert rate == pytest.approx(1 / STEP_SECONDS, rel=0.15)
    # A stalled job's pace falls to nothing.
    assert view.steps_per_second(stream.time + 60) == 0
    live = view.live(stream.time + 5)
    assert live["durable_checkpoint"] == {"step": 40, "age_seconds": 5.0}
    assert live["scalars"]["loss"] == {"mean": 3.5, "min": 2.0, "max": 5.0}


def test_the_view_keeps_the_latest_faults_and_recoveries_in_words():
    stream, _, _ = recovered_run()
    view = JobView()
    for event in stream.events:
        view.observe(event)
    texts = [line["text"] for line in view.recent]
    assert texts[0] == "FAULT rank 1 exited (killed by SIGKILL)"
    assert texts[1].startswith("decision: recover-in-place")
    assert texts[2].startswith("training again at step 13, ")
    assert texts[3] == "FAULT rank 2 exited (killed by SIGKILL)"
    assert texts[-1].startswith("training again at step 21, ")


def test_scalars_of_ranks_gone_with_an_older_generation_are_dropped():
    view = JobView()
    view.observe(Event(ev.HEARTBEAT, T0, rank=3, step=5, generation=1, details={"phase": "computing", "loss": 9.0}))
    view.observe(Event(ev.HEARTBEAT, T0 + 1, rank=0, step=6, generation=2, details={"phase": "computing",
                                                                                     "loss": 1.0}))
    assert view.scalars_by_rank() == {0: {"loss": 1.0}}
    assert view.scalar_stats() == {"loss": (1.0, 1.0, 1.0)}
