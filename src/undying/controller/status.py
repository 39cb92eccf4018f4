"""The job's status as ``/status``, ``undying status`` and ``/metrics`` show it.

Runs in the controller: a read of the job machine, taken under the shell's lock, with what the
event stream told the metrics (pace, scalars, the newest durable checkpoint, the latest faults and
recoveries: ``job_view.py``).
"""

from __future__ import annotations

from typing import Any

from undying.controller.machine import JobMachine
from undying.controller.membership import RankRecord
from undying.controller.metrics import JobMetrics


def job_status(job: JobMachine, now: float, metrics: JobMetrics | None = None, wall_now: float = 0.0) -> dict[str, Any]:
    """The machine's view at monotonic ``now``; with ``metrics``, the event stream's at wall time ``wall_now``."""
    status = _machine_status(job, now)
    if metrics is not None:
        status.update(metrics.live(wall_now))
        for rank, scalars in metrics.scalars_by_rank().items():
            if str(rank) in status["ranks"]:
                status["ranks"][str(rank)]["scalars"] = scalars
    return status


def _machine_status(job: JobMachine, now: float) -> dict[str, Any]:
    membership = job.membership
    recovery = job.recovery
    return {
        "job_id": job.job_id,
        "state": job.state.value,
        "generation": job.generation,
        "restart_count": job.restart_count,
        "max_restarts": job.spec.max_restarts,
        "world_size": len(membership.members) or job.spec.world_size,
        "members": list(membership.members),
        "committed_step": membership.committed_step(),
        "message": job.message,
        "uptime_seconds": now - job.started,
        "faults": dict(job.faults_total),
        "recovery": None if recovery is None else {
            "strategy": recovery.strategy, "generation": recovery.generation,
            "waiting_for": recovery.missing(), "awaited_nodes": sorted(recovery.awaited_nodes)},
        "nodes": {
            str(n.node): {"alive": n.alive, "pid": n.pid, "host": n.hostname, "standby": n.standby,
                          "seconds_since_poll": round(now - n.last_seen, 3),
                          "running_workers": len(n.running_workers())}
            for n in membership.nodes.values()
        },
        "ranks": {
            str(r.rank): {"node": r.node, "step": r.step, "phase": r.phase, "pid": r.pid or _agent_pid(job, r),
                          "generation": r.spawn_generation,
                          "done": r.done, "exitcode": r.exitcode,
                          "seconds_since_heartbeat": None if r.last_heartbeat is None
                          else round(now - r.last_heartbeat, 3)}
            for r in membership.ranks.values()
        },
    }


def _agent_pid(job: JobMachine, record: RankRecord) -> int | None:
    """The PID the rank's agent reported for its process, before the process's first heartbeat."""
    node = job.membership.nodes.get(record.node)
    status = node.workers.get(record.rank) if node is not None else None
    return status.pid if status is not None and status.generation >= record.spawn_generation else None
