"""The job machine's serialisation: what a successor controller resumes from after a failover.

Runs in the controller. ``export_state`` is written to etcd at every change (fenced on the
leader key, ``ha.py``); ``resume`` rebuilds a machine from it. Only what cannot be learnt
again is saved: membership is re-confirmed by the agents' polls and the workers' heartbeats.
Times are saved as wall-clock times (monotonic clocks differ between hosts).
"""

from __future__ import annotations

from typing import Any

from undying import events as ev
from undying.controller.machine import JobMachine
from undying.controller.membership import NodeRecord, RankRecord
from undying.controller.state import JobState
from undying.controller.strategies.job_restart import begin_job_restart
from undying.protocol import Phase, Plan


def export_state(job: JobMachine) -> dict[str, Any]:
    """What a successor needs to carry on; the rest it rebuilds from polls and heartbeats."""
    membership = job.membership
    return {
        "job_id": job.job_id,
        "state": job.state.value,
        "generation": job.generation,
        "abort_generation": job.abort_generation,
        "restart_count": job.restart_count,
        "members": list(membership.members),
        "spawned": {str(rank): record.spawn_generation for rank, record in membership.ranks.items()},
        "nodes": {str(n.node): {"standby": n.standby, "alive": n.alive, "pid": n.pid, "host": n.hostname,
                                "unfit": n.unfit}
                  for n in membership.nodes.values()},
        # Agents switched out (host, pid, why) and node places whose agent failed its check (fitness.py).
        "retired": [[host, pid, why] for (host, pid), why in membership.retired.items()],
        "unfit_places": sorted(membership.unfit_places),
        "adopted_by": {str(node): spare for node, spare in membership.adopted_by.items()},
        "plan": None if job.generation not in job.plans else job.plans[job.generation].to_dict(),
        "claimed_injections": sorted(job.claimed_injections),
        "node_down_until": {str(node): until + job.wall_offset for node, until in job.node_down_until.items()},
        "faults": dict(job.faults_total),
        "started": job.started + job.wall_offset,
        "store": job.store_address,
        "backup_store": job.backup_store,
    }


def resume(job: JobMachine, saved: dict[str, Any], why: str, now: float,
           live: set[tuple[str, int]] | None = None) -> None:
    """Take over a job another controller ran (it died or lost its lease). A running generation
    goes on untouched: its nodes and ranks are known from ``saved`` and confirm themselves by
    polling and beating here (a node that does not is lost, as any other). ``live``: the (host,
    pid) of the processes that hold an etcd lease now (controller/ha.py ``live_processes``; None:
    unknown): a node whose agent's process is not among them is lost at once (``gone``). A job
    caught in the middle of a recovery or restart restarts (the successor cannot know how far it got)."""
    job.now = now
    membership = job.membership
    job.job_id = saved["job_id"]
    job.generation = int(saved["generation"])
    job.abort_generation = int(saved["abort_generation"])
    job.restart_count = int(saved["restart_count"])
    membership.members = [int(rank) for rank in saved["members"]]
    membership.adopted_by = {int(node): int(spare) for node, spare in saved["adopted_by"].items()}
    job.claimed_injections = {int(index) for index in saved["claimed_injections"]}
    job.node_down_until = {int(node): float(until) - job.wall_offset
                           for node, until in saved["node_down_until"].items()}
    for reason, count in saved["faults"].items():
        job.faults_total[reason] = job.faults_total.get(reason, 0) + int(count)
    job.started = float(saved["started"]) - job.wall_offset
    # The RNG mirrors of the last steps are in the old store (gone with its node, most likely)
    # and in its backup store, which may be ours.
    job.rng_stores = [address for address in (saved.get("backup_store"), saved.get("store"))
                      if address and address != job.store_address]
    if saved.get("plan"):
        job.plans[job.generation] = Plan.from_dict(saved["plan"])
    for node_id, node in saved["nodes"].items():
        if node["alive"]:
            # The agent's pid and host: a poll from another process is not the node's.
            pid, host = int(node.get("pid") or 0), str(node.get("host") or "")
            gone = live is not None and bool(pid and host) and (host, pid) not in live
            membership.nodes[int(node_id)] = NodeRecord(int(node_id), pid, host, now,
                                                        standby=bool(node["standby"]), confirmed=False,
                                                        unfit=str(node.get("unfit") or ""), gone=gone)
    membership.retired = {(str(host), int(pid)): str(why) for host, pid, why in saved.get("retired", [])}
    membership.unfit_places = {int(node) for node in saved.get("unfit_places", [])}
    for rank_text, spawned in saved["spawned"].items():
        rank = int(rank_text)
        membership.ranks[rank] = RankRecord(rank, membership.node_of(rank), int(spawned), now, last_heartbeat=now,
                                            phase=Phase.COMPUTING, step_known=False)
    previous = JobState(saved["state"])
    job.emit(ev.CONTROLLER_TAKEOVER, generation=job.generation, details={
        "previous_state": previous.value, "why": why, "nodes": sorted(membership.nodes),
        "members": membership.members, "gone": sorted(n.node for n in membership.nodes.values() if n.gone)})
    job.state_deadline = now + job.deadlines.node_return
    if previous is JobState.RUNNING:
        job.state = JobState.RUNNING
    elif previous is JobState.WAITING_FOR_NODES:
        membership.nodes.clear()  # agents say hello again; nothing ran yet
        membership.ranks.clear()
    else:
        job.state = JobState.RECOVERING  # only to leave it by the legal path below
        begin_job_restart(job, f"controller failover during {previous.value}", now)
