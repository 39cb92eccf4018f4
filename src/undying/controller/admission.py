"""Which agents may join the job: the checks an agent's hello must pass.

Runs in the controller, inside the job machine. A refused agent gets one line saying why and
changes nothing: a node id outside the job, a spare with a node's id, another ``nproc_per_node``,
a job that has ended, or a job spec that differs from the controller's (the spec travels with
the job: a worker must keep the timeouts the controller's deadlines assume).
"""

from __future__ import annotations

from undying.config import JobSpec, SpecError, spec_differences, validate_job_spec
from undying.controller.state import JobState
from undying.protocol import AgentHello


def hello_refusal(spec: JobSpec, state: JobState, hello: AgentHello) -> str:
    """Why ``hello`` is refused, or "" when the agent may join."""
    if hello.standby and hello.node < spec.nnodes:
        return f"a standby agent needs a node id >= nnodes ({spec.nnodes}), got {hello.node}"
    if not hello.standby and not 0 <= hello.node < spec.nnodes:
        return f"node {hello.node} >= nnodes"
    if hello.nproc != spec.nproc_per_node:
        return "nproc_per_node differs from the job's"
    if hello.spec:  # an agent that sends no spec (an older one) is compared on nproc alone
        try:
            differing = spec_differences(spec, validate_job_spec(hello.spec))
        except SpecError as error:
            return f"the agent's job spec is invalid: {error}"
        if differing:
            return f"the agent's job spec differs from the controller's in: {', '.join(differing)}"
    if state.terminal:
        return f"job {state.value}"
    return ""
