"""Prometheus metrics of the job, rendered from the controller's status on each scrape.

Runs in the controller. A fresh registry per scrape keeps the numbers exactly the
controller's view at that instant, with no global state.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest


def render_metrics(status: dict[str, Any]) -> bytes:
    registry = CollectorRegistry()
    Gauge("undying_generation", "Current process-group generation", registry=registry).set(status["generation"])
    Gauge("undying_restarts", "Job-level restarts so far", registry=registry).set(status["restart_count"])
    Gauge("undying_world_size", "Ranks in the job", registry=registry).set(status["world_size"])
    Gauge("undying_committed_step", "Lowest committed step over all ranks",
          registry=registry).set(status["committed_step"])
    Gauge("undying_uptime_seconds", "Seconds since the controller started",
          registry=registry).set(status["uptime_seconds"])
    nodes_alive = sum(1 for node in status["nodes"].values() if node["alive"])
    Gauge("undying_nodes_alive", "Nodes whose agent is alive", registry=registry).set(nodes_alive)
    state = Gauge("undying_job_state", "1 for the job's current state", ["state"], registry=registry)
    state.labels(status["state"]).set(1)
    faults = Gauge("undying_faults", "Faults detected, by reason", ["reason"], registry=registry)
    for reason, count in status["faults"].items():
        faults.labels(reason).set(count)
    step = Gauge("undying_rank_step", "Committed step per rank", ["rank"], registry=registry)
    for rank, info in status["ranks"].items():
        step.labels(rank).set(info["step"])
    return generate_latest(registry)
