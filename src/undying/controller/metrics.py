"""The job's Prometheus metrics, by Prometheus' conventions, from the events the controller logs.

Runs in the controller. One registry for the controller's life: ``JobMetrics.observe`` is a
listener on the job's event log (every event, in log order), so every metric that counts or times
something is computed here from events (through ``job_view.JobView``), never inside the job
machine. Counters end in ``_total``; times are histograms in seconds; what is a state at the
moment of the scrape (generation, nodes alive, the job's state as a StateSet, the age of the newest
durable checkpoint, the scalars of ``ft.log``) is read then. No series is per rank: at 16k ranks
that would be 16k series a name, so ranks are counted by phase and scalars are aggregated.

A failed-over controller starts its counters at zero (a counter reset, which ``rate()`` handles).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import GaugeMetricFamily, Metric, StateSetMetricFamily

from undying import events as ev
from undying.controller.job_view import JobView, Measured
from undying.controller.state import JobState
from undying.events import Event
from undying.protocol import Phase

NAMESPACE = "undying"
MTTR_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
PHASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
STALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PERSIST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
_METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class JobMetrics:
    """Every metric of one controller. ``observe`` (the event log's listener) may be called from any
    thread; ``render`` answers a scrape. ``status`` gives the controller's ``/status`` at scrape time."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.view = JobView()
        self._lock = threading.Lock()  # the view; the prometheus_client metrics lock themselves
        self.registry = CollectorRegistry()
        registry = self.registry
        self.steps = Counter("steps", "Training steps the job committed (a step replayed after a rollback "
                             "counts again)", namespace=NAMESPACE, registry=registry)
        self.faults = Counter("faults", "Faults detected, by reason", ["reason"], namespace=NAMESPACE,
                              registry=registry)
        self.recoveries = Counter("recoveries", "Recoveries started, by strategy (every kind counts against "
                                  "max_restarts)", ["strategy"], namespace=NAMESPACE, registry=registry)
        self.recoveries_failed = Counter("recoveries_failed", "Recoveries that gave up (the chain went on), "
                                         "by strategy", ["strategy"], namespace=NAMESPACE, registry=registry)
        self.persist_failed = Counter("checkpoint_persist_failures", "Checkpoints whose background write "
                                      "to storage (T2) failed", namespace=NAMESPACE, registry=registry)
        self.mttr = Histogram("mttr_seconds", "Time to recover: a fault detected until the first step "
                              "committed after it", namespace=NAMESPACE, registry=registry, buckets=MTTR_BUCKETS)
        self.recovery_phase = Histogram("recovery_phase_seconds", "One rank's part of a process-level "
                                        "recovery, by phase (wait_for_plan, rebuild, repair) and strategy",
                                        ["strategy", "phase"], namespace=NAMESPACE, registry=registry,
                                        buckets=PHASE_BUCKETS)
        self.step_time = Histogram("step_seconds", "Time per committed step (the mean between two sampled "
                                   "heartbeats of one rank)", namespace=NAMESPACE, registry=registry,
                                   buckets=STEP_BUCKETS)
        self.checkpoint_stall = Histogram("checkpoint_stall_seconds", "Training time a checkpoint's copy "
                                          "into node memory (T1) took from the step", namespace=NAMESPACE,
                                          registry=registry, buckets=STALL_BUCKETS)
        self.persist_time = Histogram("checkpoint_persist_seconds", "Time a checkpoint's background write "
                                      "to storage (T2) took", namespace=NAMESPACE, registry=registry,
                                      buckets=PERSIST_BUCKETS)
        self.step_parts = Histogram("step_part_seconds", "A rank's mean time per step in each part: its own "
                                    "compute, its wait inside collectives (comm), its data loading (from "
                                    "sampled heartbeats)", ["part"], namespace=NAMESPACE, registry=registry,
                                    buckets=STEP_BUCKETS)
        self.stragglers = Counter("stragglers", "Ranks found persistently slower than their peers",
                                  namespace=NAMESPACE, registry=registry)
        self.switches = Counter("switches", "Nodes switched to a spare (a straggler, a transient bad step)",
                                namespace=NAMESPACE, registry=registry)
        self.bad_steps = Counter("bad_steps", "Attempts of a step the commit vote found bad (non-finite, a loss "
                                 "spike), by what followed (replay, skip, stop), and replays that committed "
                                 "(replayed: the fault was transient)", ["action"], namespace=NAMESPACE,
                                 registry=registry)
        self.node_checks_failed = Counter("node_check_failures", "Health checks a node failed (it was given "
                                          "no ranks)", namespace=NAMESPACE, registry=registry)
        registry.register(_StateCollector(status))

    def observe(self, event: Event) -> None:
        with self._lock:
            measured = self.view.observe(event)
        self._record(measured, event)

    def live(self, now: float) -> dict[str, Any]:
        """The view's part of ``/status`` at wall time ``now``."""
        with self._lock:
            return self.view.live(now)

    def scalars_by_rank(self) -> dict[int, dict[str, float]]:
        with self._lock:
            return self.view.scalars_by_rank()

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition a scraper asked for (Prometheus text, or OpenMetrics), and its content type."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def _record(self, measured: Measured, event: Event) -> None:
        if measured.steps:
            self.steps.inc(measured.steps)
        if measured.step_seconds is not None:
            self.step_time.observe(measured.step_seconds)
        if measured.fault_reason is not None:
            self.faults.labels(measured.fault_reason).inc()
        if measured.recovery_strategy is not None:
            self.recoveries.labels(measured.recovery_strategy).inc()
        if measured.recovery_failed is not None:
            self.recoveries_failed.labels(measured.recovery_failed).inc()
        strategy = str(event.details.get("strategy") or "unknown")
        for phase, seconds in measured.recovery_phases.items():
            self.recovery_phase.labels(strategy, phase).observe(seconds)
        if measured.mttr_seconds is not None:
            self.mttr.observe(measured.mttr_seconds)
        if measured.checkpoint_stall is not None:
            self.checkpoint_stall.observe(measured.checkpoint_stall)
        if measured.persist_seconds is not None:
            self.persist_time.observe(measured.persist_seconds)
        if measured.persist_failed:
            self.persist_failed.inc()
        for part, seconds in measured.step_parts.items():
            self.step_parts.labels(part).observe(seconds)
        self._count_incident(measured.incident)

    def _count_incident(self, incident: str | None) -> None:
        if incident == ev.STRAGGLER:
            self.stragglers.inc()
        elif incident == ev.SWITCH_BEGIN:
            self.switches.inc()
        elif incident == ev.NODE_CHECK_FAILED:
            self.node_checks_failed.inc()
        elif incident is not None and incident.startswith(f"{ev.BAD_STEP}:"):
            self.bad_steps.labels(incident.split(":", 1)[1]).inc()


class _StateCollector:
    """The gauges of the job's state at the moment of the scrape, read from ``/status``."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def describe(self) -> list[Metric]:
        return []  # collected at scrape time only (registering must not ask the controller)

    def collect(self) -> Iterator[Metric]:
        status = self._status()

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{NAMESPACE}_{name}", documentation, value=value)

        yield StateSetMetricFamily(f"{NAMESPACE}_job_state", "The job's state",
                                   {state.value: state.value == status["state"] for state in JobState})
        yield gauge("generation", "Current process-group generation", status["generation"])
        yield gauge("recoveries_counted", "Recoveries of every kind counted against max_restarts",
                    status["restart_count"])
        yield gauge("max_restarts", "Recoveries the job may take (max_restarts)", status["max_restarts"])
        yield gauge("world_size", "Ranks in the current generation", status["world_size"])
        yield gauge("committed_step", "Lowest committed step over the current generation's ranks",
                    status["committed_step"])
        yield gauge("uptime_seconds", "Seconds since this controller started", status["uptime_seconds"])
        yield gauge("nodes_alive", "Nodes whose agent is alive (spares included)",
                    sum(1 for node in status["nodes"].values() if node["alive"]))
        ranks = GaugeMetricFamily(f"{NAMESPACE}_ranks", "Ranks of the current generation, by the phase "
                                  "their newest heartbeat reported", labels=["phase"])
        counts = {phase.value: 0 for phase in Phase}
        for rank in status["ranks"].values():
            counts[rank["phase"]] = counts.get(rank["phase"], 0) + 1
        for phase, count in counts.items():
            ranks.add_metric([phase], count)
        yield ranks
        durable = status.get("durable_checkpoint")
        if durable is not None:
            yield gauge("checkpoint_durable_age_seconds", "Seconds since the newest checkpoint in storage "
                        "(T2 or a dying checkpoint) was committed", durable["age_seconds"])
            yield gauge("checkpoint_durable_step", "Step of the newest checkpoint in storage", durable["step"])
        for name, stats in sorted(status.get("scalars", {}).items()):
            if not _METRIC_NAME.fullmatch(name):
                continue  # the worker checks names (runtime/scalars.py); never export a malformed one
            family = GaugeMetricFamily(f"{NAMESPACE}_train_{name}", f"The scalar {name} the ranks logged "
                                       "(ft.log), over the current generation's ranks", labels=["stat"])
            for stat, value in stats.items():
                family.add_metric([stat], value)
            yield family
