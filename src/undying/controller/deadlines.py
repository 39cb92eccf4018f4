"""Every deadline the controller keeps, derived from the job spec in one place.

Runs in the controller. All deadlines are measured on ``time.monotonic()`` (the job
machine is handed the time; the shell reads the monotonic clock); wall time is used
for event timestamps only.
"""

from __future__ import annotations

from dataclasses import dataclass

from undying.config import JobSpec

# How long stopped workers may take to go before the restart goes ahead anyway.
STOP_TIMEOUT = 30.0
# How long a job restart holds its stop orders while a survivor commits a T2 checkpoint whose records
# are all in (the worker's own bound is runtime/recovery_client.py COMMIT_DRAIN_S).
COMMIT_DRAIN = 30.0
# How long agents have to pick up their exit order at the end of the job.
EXIT_GRACE = 10.0
# A worker's own report that its step failed waits this long for the cause to show up
# (a dead peer's exit, a lost node), so the decision is made on the real fault.
STEP_FAILED_GRACE = 0.5
# After a controller failover: how much longer than one long poll a live agent may take to show up.
UNCONFIRMED_GRACE = 4.0
# A live agent whose poll connection closed reconnects at once; one that does not poll again
# within this long after the close is lost (seconds, not the silence timeout of a vanished host).
DISCONNECT_GRACE = 0.5
# An agent polls again at most monitor_interval after its last poll; this much more silence, while
# its ranks miss their heartbeats too, means the whole host is frozen or cut off.
AGENT_QUIET_SLACK = 2.0
# Heartbeats are logged at most this often per rank.
HEARTBEAT_LOG_EVERY = 0.5
# The longest an agent's poll or a worker's check-in is held open.
LONGEST_HOLD = 30.0
# How often the controller's loop hands the job machine the time, news or not: every deadline
# above is checked at this resolution (an observation with news is acted on at once).
TICK = 0.05


@dataclass(frozen=True)
class Deadlines:
    """Seconds, each derived from the spec (or a fixed bound above)."""

    agent_lost_after: float  # no poll from a confirmed agent for this long: its node is lost
    agent_quiet_after: float  # no poll for this long and a rank of the node silent too: the node is lost
    unconfirmed_agent_lost_after: float  # after a failover: an agent not heard from since is lost
    disconnected_agent_lost_after: float  # an agent whose poll connection closed and that did not poll again
    node_return: float  # waiting for every node, at the start and at a restart
    recovery: float  # a process-level recovery (or the regroup of a grow) must form its generation
    grow_start: float  # returned ranks must start before a grow is tried
    heartbeat: float  # no heartbeat for this long: the rank hangs
    host_silent: float  # neither the agent nor any rank of a node heard for this long: the host is frozen
    start: float  # no first heartbeat for this long: the rank did not start
    step: float | None  # the step-progress watchdog (None: off)
    reschedule_wait: float  # a lost node's time to come back before an elastic shrink
    graceful_stop: float = 120.0  # a job asked to stop persists its newest step within this, or is cancelled
    stop: float = STOP_TIMEOUT
    commit_drain: float = COMMIT_DRAIN
    exit_grace: float = EXIT_GRACE
    step_failed_grace: float = STEP_FAILED_GRACE

    @classmethod
    def from_spec(cls, spec: JobSpec) -> Deadlines:
        return cls(
            agent_lost_after=spec.monitor_interval * 2 + 5.0,
            agent_quiet_after=spec.monitor_interval + AGENT_QUIET_SLACK,
            unconfirmed_agent_lost_after=spec.monitor_interval + UNCONFIRMED_GRACE,
            disconnected_agent_lost_after=DISCONNECT_GRACE,
            node_return=spec.node_return_timeout,
            recovery=spec.start_timeout + spec.comm_timeout,
            grow_start=spec.start_timeout,
            heartbeat=spec.heartbeat_timeout,
            host_silent=spec.host_silence_limit(),
            start=spec.start_timeout,
            step=spec.step_timeout,
            reschedule_wait=spec.reschedule_wait(),
            graceful_stop=spec.stop_timeout,
        )
