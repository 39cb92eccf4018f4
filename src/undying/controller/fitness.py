"""Whether a node may hold ranks: its health check (agent/node_check.py) and the agents switched out.

Runs in the controller, inside the job machine. An agent whose health check failed, or that was
switched out of the job (a straggler, a transient bad step: strategies/switch.py), joins as a
spare that is never given ranks: its hello is answered with a spare id (the agent then waits as a
spare), its node's place stays free for an idle spare to adopt (or the job waits for the node, or
shrinks by its chain), and why is logged (``node_check_failed``) and said on the console. A check
that fails after a job restart stopped the node's workers frees the node's place the same way:
the agent is told to say hello again, with a fresh check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from undying import events as ev
from undying.controller.membership import Membership, NodeRecord
from undying.protocol import AgentHello, HelloReply

if TYPE_CHECKING:
    from undying.controller.job import JobCore


def check_problems(check: dict[str, Any]) -> list[str]:
    """The problems a health check found (node_check.NodeCheck.to_dict); none: the node is fit."""
    return [str(problem) for problem in check.get("problems") or []]


def unfit_reason(membership: Membership, hello: AgentHello) -> str:
    """Why the agent saying ``hello`` may not hold ranks, or "" when it may."""
    retired = membership.retired.get((hello.hostname, hello.pid))
    if retired is not None:
        return f"switched out of the job: {retired}"
    return "; ".join(check_problems(hello.check))


def join_as_unfit_spare(job: JobCore, hello: AgentHello, why: str, now: float) -> HelloReply:
    """Register the agent as a spare that is never given ranks; its node's place waits for another."""
    membership = job.membership
    if hello.check and check_problems(hello.check):
        job.emit(ev.NODE_CHECK_FAILED, node=hello.node, generation=job.generation,
                 details={"host": hello.hostname, "problems": check_problems(hello.check), "when": "hello",
                          "timings": hello.check.get("timings", {}), "standby": hello.standby})
    if not hello.standby:
        membership.unfit_places.add(hello.node)
    spare_id = hello.node if hello.standby else membership.reserve_spare_id()
    membership.nodes[spare_id] = NodeRecord(spare_id, hello.pid, hello.hostname, now, standby=True, unfit=why)
    job.emit(ev.AGENT_REGISTERED, node=spare_id, details={
        "pid": hello.pid, "host": hello.hostname, "standby": True, "unfit": why, "as_node": hello.node})
    return HelloReply(job.job_id, job.store_port, node=spare_id, reason=f"not given ranks: {why}")


def check_after_restart(job: JobCore, node: NodeRecord, check: dict[str, Any], now: float) -> None:
    """A node's check once a job restart stopped its workers: a failing one frees its place (the agent
    says hello again, with a new check, and joins as an unfit spare if it still fails)."""
    node.check_due = False
    problems = check_problems(check)
    if not problems:
        return
    job.emit(ev.NODE_CHECK_FAILED, node=node.node, generation=job.generation,
             details={"host": node.hostname, "problems": problems, "when": "restart",
                      "timings": check.get("timings", {}), "standby": node.standby})
    node.alive = False
    node.orders.clear()
    if not node.standby:
        job.membership.unfit_places.add(node.node)
