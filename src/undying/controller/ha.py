"""Controller failover: leader election by an etcd lease, the controller's state kept in etcd.

Runs in every ``undying run --etcd`` process (each one is a controller candidate); agents
and workers find the leader with ``undying.locate``. Keys, under ``/undying/<job>/``:

* ``leader``: JSON ``{"id", "controller", "store", "epoch"}``, created only if absent
  (a compare-and-put on its create revision) and bound to the winner's lease. When
  the leader's process or node dies, its lease expires after ``ttl`` seconds, etcd
  deletes the key, and the next candidate's create succeeds.
* ``candidates/<id>``: each candidate's node, host, pid and pre-started store, under its
  lease. The leader names one on another node as the *backup store*: workers mirror their
  per-step RNG state there too, so the replacements of ranks that died with the leader's
  node (and its store) still resume with their exact RNG state. A successor reads them at
  its takeover (``live_processes``): a node's agent runs in its candidate's process, so a
  node whose process holds no lease any more went with the leader (killed, frozen or cut
  off for a whole lease) and is lost at once instead of after a wait for its poll.
* ``state``: the controller's saved state (``Controller.export_state``), written only
  while ``leader`` still holds this candidate's record (a fenced write), so a deposed
  leader that has not noticed yet cannot overwrite its successor's state.

The consensus is etcd's; nothing here votes. A leader that cannot renew its lease for
``ttl`` seconds (cut off from etcd) steps down by itself: ``on_lost`` is called and it
stops serving, so agents re-resolve the address and find the new leader.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from undying.etcd import EtcdClient, EtcdUnavailable, KeyValue
from undying.locate import job_prefix
from undying.tls import ClientTls

# A leader acts only within this fraction of the ttl after its last confirmed renewal (renewals
# come every ttl/3), so it stops before etcd can let the lease expire and another candidate win.
IN_CHARGE_FRACTION = 0.8


def saved_state(endpoint: str, job: str, tls: ClientTls | None = None) -> dict[str, Any] | None:
    """The job's saved controller state (``Controller.export_state``), or None if there is none."""
    client = EtcdClient(endpoint, tls=tls)
    try:
        return _state_of(client.get(f"{job_prefix(job)}/state"))
    finally:
        client.close()


def _state_of(record: KeyValue | None) -> dict[str, Any] | None:
    return None if record is None else json.loads(record.value)


class Candidate:
    """One controller candidate of a job: campaigns, and while leader renews its lease."""

    def __init__(self, endpoint: str, job: str, ttl: int, on_lost: Callable[[], None] | None = None,
                 node: int = -1, store: str = "", tls: ClientTls | None = None) -> None:
        if ttl < 2:
            raise ValueError("the leader lease ttl must be at least 2 s")
        self.endpoint = endpoint
        self.job = job
        self.ttl = ttl
        self.on_lost = on_lost
        self.id = uuid.uuid4().hex[:12]
        self.node = node
        self.store = store  # this candidate's pre-started store (host:port), announced while it campaigns
        self.lease = 0
        self.record = ""  # our leader record while we lead
        self.leading = threading.Event()
        self._client = EtcdClient(endpoint, timeout=max(1.0, ttl / 3), tls=tls)
        self._renew_client = EtcdClient(endpoint, timeout=max(1.0, ttl / 3), tls=tls)  # the lease thread's own
        self._lock = threading.Lock()  # the main client: the candidate thread and the controller's
        self.lost_reason = ""
        self._renewed = 0.0  # monotonic time of the last renewal etcd confirmed
        self._stop = threading.Event()
        self._keepalive: threading.Thread | None = None

    @property
    def leader_key(self) -> str:
        return f"{job_prefix(self.job)}/leader"

    @property
    def state_key(self) -> str:
        return f"{job_prefix(self.job)}/state"

    def campaign(self, stop: threading.Event, poll: float = 0.2) -> bool:
        """Block until this candidate leads (True) or ``stop`` is set (False)."""
        while not stop.is_set():
            try:
                if not self.lease:
                    self.lease = self._client.grant(self.ttl)
                    self._client.put(f"{job_prefix(self.job)}/candidates/{self.id}",
                                     json.dumps({"node": self.node, "store": self.store,
                                                 "host": socket.gethostname(), "pid": os.getpid()}),
                                     lease=self.lease)
                record = json.dumps({"id": self.id, "controller": "", "store": "", "epoch": 0})
                created, _ = self._client.put_if_absent(self.leader_key, record, lease=self.lease)
                if created:
                    self.record = record
                    self._renewed = time.monotonic()
                    self.leading.set()
                    self._keepalive = threading.Thread(target=self._renew, name="leader-lease", daemon=True)
                    self._keepalive.start()
                    return True
                # Someone leads: keep our lease alive for a quick takeover, and look again soon.
                if self._client.keepalive(self.lease) <= 0:
                    self.lease = 0
            except EtcdUnavailable:
                # Our lease may have expired meanwhile: take a new one (an old one expires by itself).
                self.lease = 0
            stop.wait(poll)
        return False

    def in_charge(self) -> bool:
        """True while etcd confirmed our lease recently enough that it cannot have expired yet. A
        process frozen past its lease (SIGSTOP, a long pause) wakes up not in charge, before its
        renewal thread has even run."""
        return self.leading.is_set() and time.monotonic() - self._renewed < self.ttl * IN_CHARGE_FRACTION

    def publish(self, controller: str, store: str, epoch: int) -> None:
        """Tell agents and workers where the controller and its store listen (under our lease)."""
        record = json.dumps({"id": self.id, "controller": controller, "store": store, "epoch": epoch})
        with self._lock:
            published = self._client.put_if_equal(self.leader_key, self.record, self.leader_key, record,
                                                  lease=self.lease)
        if not published:
            self._lost("the leader record changed before it was published")
            return
        self.record = record

    def _candidates(self) -> list[dict[str, Any]] | None:
        """Every live candidate's record (None: etcd did not answer)."""
        try:
            with self._lock:
                records = self._client.get_prefix(f"{job_prefix(self.job)}/candidates/")
        except EtcdUnavailable:
            return None
        infos = []
        for record in records:
            try:
                info = json.loads(record.value)
            except ValueError:
                continue
            if isinstance(info, dict):
                infos.append(info)
        return infos

    def live_processes(self) -> set[tuple[str, int]] | None:
        """(host, pid) of every process that holds a candidate lease now: the job's ``undying run``
        processes alive and in touch with etcd (None: etcd did not answer)."""
        infos = self._candidates()
        if infos is None:
            return None
        return {(str(info["host"]), int(info["pid"])) for info in infos if info.get("host") and info.get("pid")}

    def backup_store(self) -> str:
        """The store of a live candidate on another node (the lowest node id), or "" if none."""
        others = []
        for info in self._candidates() or []:
            if info.get("node") != self.node and info.get("store"):
                others.append((int(info["node"]), str(info["store"])))
        return min(others)[1] if others else ""

    def load_state(self) -> dict[str, Any] | None:
        with self._lock:
            return _state_of(self._client.get(self.state_key))

    def save_state(self, state: dict[str, Any]) -> bool:
        """Write the controller's state while we still lead; False (and on_lost) if we do not."""
        if not self.leading.is_set():
            return False
        try:
            with self._lock:
                saved = self._client.put_if_equal(self.leader_key, self.record, self.state_key, json.dumps(state))
        except EtcdUnavailable:
            saved = False
        if not saved:
            self._lost("the saved state could not be written under our leadership")
        return saved

    def resign(self) -> None:
        """Give up leadership (the job ended here): the lease goes, with the leader key."""
        self._stop.set()
        self.leading.clear()
        if self.lease:
            try:
                self._client.revoke(self.lease)
            except EtcdUnavailable:
                pass
            self.lease = 0

    def _renew(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.ttl / 3):
            try:
                if self._renew_client.keepalive(self.lease) > 0:
                    last_ok = self._renewed = time.monotonic()
                    continue
                self._lost("the leader lease expired")
                return
            except EtcdUnavailable:
                if time.monotonic() - last_ok >= self.ttl:
                    self._lost(f"etcd unreachable for {self.ttl} s")
                    return

    def _lost(self, why: str) -> None:
        if not self.leading.is_set():
            return
        self.leading.clear()
        self.lost_reason = why
        if self.on_lost is not None:
            self.on_lost()
