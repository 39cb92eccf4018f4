"""Finding a failover job's controller through etcd, wherever the current leader runs.

Runs in agents and workers (their ``ControllerClient`` follows the controller after a
failover), in ``undying status`` and in ``undying run --etcd``. The leader publishes its
address under ``/undying/<job>/leader`` (``controller/ha.py``); this reads it back and
loads nothing of ``undying.controller``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from undying.etcd import EtcdClient, EtcdUnavailable
from undying.tls import ClientTls, etcd_tls_from_environ

ENV_ETCD = "UNDYING_ETCD"  # host:port of etcd, in agents and workers of a failover job
ENV_HA_JOB = "UNDYING_HA_JOB"  # the job's name (its key prefix in etcd)


def job_prefix(job: str) -> str:
    """The etcd key prefix under which a failover job keeps its leader, candidates and state."""
    return f"/undying/{job}"


def locate_controller(endpoint: str, job: str, timeout: float = 1.0, tls: ClientTls | None = None) -> str | None:
    """The current leader's controller address ``host:port``, or None while there is none. etcd is
    reached with ``tls``, or by default as this process's environment says (``tls.ENV_ETCD_CA``)."""
    client = EtcdClient(endpoint, timeout=timeout, tls=tls if tls is not None else etcd_tls_from_environ())
    try:
        record = client.get(f"{job_prefix(job)}/leader")
    except EtcdUnavailable:
        return None
    finally:
        client.close()
    if record is None:
        return None
    try:
        address = json.loads(record.value).get("controller") or None
    except (ValueError, AttributeError):
        return None
    return address


def locator_from_env(env: Mapping[str, str]) -> Callable[[], str | None] | None:
    """A locator for ``ControllerClient`` when this process belongs to a failover job, else None."""
    endpoint, job = env.get(ENV_ETCD), env.get(ENV_HA_JOB)
    if not endpoint or not job:
        return None
    tls = etcd_tls_from_environ(env)
    return lambda: locate_controller(endpoint, job, tls=tls)
