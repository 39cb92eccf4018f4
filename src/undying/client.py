"""HTTP client for the controller's endpoint, used by agents, workers and the CLI.

Every request carries the job token; connection errors surface as
``ControllerUnreachable`` so callers decide whether to retry or give up. In a failover
job (``--etcd``) a client has a locator: when the controller does not answer, it looks
up the current leader's address in etcd and, if it moved, sends the request there.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from undying.http_wire import Connection
from undying.protocol import PROTOCOL_VERSION, TOKEN_HEADER, TOKEN_SCHEME, VERSION_HEADER
from undying.tls import ClientTls, controller_tls_from_environ

# Failover jobs: old controller address -> where it moved, shared by every client of this process,
# so a request on one thread follows a move another thread found (instead of timing out first).
_MOVED: dict[str, str] = {}
# The clients of this process that follow moves: when one finds a move, a request another thread has
# in flight to the old address (an agent's long poll held by a frozen leader) is cut off, so that it
# follows the move at once instead of at its own timeout.
_FOLLOWERS: weakref.WeakSet[ControllerClient] = weakref.WeakSet()
# A request in flight this much longer than the controller may hold it is stuck (a frozen leader
# accepts connections and never answers): a thread of the process then asks etcd every WATCH_EVERY
# seconds whether the controller moved, and cuts such requests off once it has. A long poll names
# how long it may be held (``held``); the process's short requests (heartbeats) are the canaries.
STUCK_AFTER_S = 1.0
WATCH_EVERY_S = 0.5
_watcher_lock = threading.Lock()
_watcher: threading.Thread | None = None
_moved_news = threading.Condition()  # notified whenever a move is found (``ControllerClient.wait_for_move``)


def _cut_off_moved(old: str, new: str, found_by: ControllerClient | None = None) -> None:
    """The controller at ``old`` moved to ``new``: every client of this process follows it, and the
    requests in flight to ``old`` are cut off so that they follow it at once. ``new`` is live now:
    a move recorded away from it before (a leader back at an address it once held) is forgotten, so
    moves never form a cycle that a request would follow forever."""
    _MOVED.pop(new, None)
    _MOVED[old] = new
    for other in list(_FOLLOWERS):
        if other is not found_by and other.address == old:
            other._cut_off()
    with _moved_news:
        _moved_news.notify_all()


def _watch_for_moves() -> None:
    """The process's move watcher (a daemon thread, started with its first following client)."""
    while True:
        time.sleep(WATCH_EVERY_S)
        now = time.monotonic()
        stuck: dict[str, ControllerClient] = {}
        for client in list(_FOLLOWERS):
            since = client._in_flight_since
            if since is None or now - since <= client._held + STUCK_AFTER_S:
                continue
            if client.address in _MOVED:
                client._cut_off()  # a request to an address known to have moved: it follows the move
            else:
                stuck.setdefault(client.address, client)
        for address, client in stuck.items():
            try:
                moved_to = client.locator() if client.locator is not None else None
            except Exception:  # noqa: BLE001 (etcd unreachable: look again at the next round)
                continue
            if moved_to and moved_to != address:
                _cut_off_moved(address, moved_to)


def _start_watcher() -> None:
    global _watcher
    with _watcher_lock:
        if _watcher is None:
            _watcher = threading.Thread(target=_watch_for_moves, name="controller-move-watcher", daemon=True)
            _watcher.start()


def _after_fork_in_child() -> None:
    """A forked process (a worker forked from a warm standby) has no watcher thread: its first
    following client starts one of its own."""
    global _watcher, _watcher_lock
    _watcher, _watcher_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ControllerUnreachable(ConnectionError):
    """The controller did not answer (down, restarting, or the network is cut)."""


class Unauthorized(PermissionError):
    """The controller refused the job token."""


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); raises ValueError with the bad text."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"controller address must be HOST:PORT (got {address!r})")
    return host.strip("[]"), int(port)


def format_address(host: str, port: int) -> str:
    """(host, port) -> ``host:port``, an IPv6 host in brackets (the inverse of ``parse_address``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ControllerClient:
    """Talks JSON to one controller. Not thread-safe: give each thread its own.

    HTTPS, verifying the controller's certificate, when ``tls`` is given or, by default, when this
    process's environment names a CA (``UNDYING_TLS_CA``: set by ``undying run --tls-ca`` for its
    agents and workers); plain HTTP otherwise."""

    def __init__(self, address: str, token: str, timeout: float = 10.0,
                 locator: Callable[[], str | None] | None = None, tls: ClientTls | None = None) -> None:
        self.host, self.port = parse_address(address)
        self.address = address
        self.token = token
        self.timeout = timeout
        self.locator = locator  # finds the current controller after a failover (None: fixed address)
        self.tls = tls if tls is not None else controller_tls_from_environ()
        self._conn: Connection | None = None
        self._in_flight_since: float | None = None  # monotonic start of the request in flight, if any
        self._held = 0.0  # how long the controller may hold that request (a long poll's wait)
        if locator is not None:
            _FOLLOWERS.add(self)
            _start_watcher()

    def _relocate(self) -> bool:
        """Follow the controller to its new address; True if it moved."""
        address = self.locator() if self.locator is not None else None
        if not address or address == self.address:
            return False
        old = self.address
        self._move_to(address)
        _cut_off_moved(old, address, found_by=self)
        return True

    def wait_for_move(self, seconds: float) -> None:
        """Sleep up to ``seconds`` before a retry, but return as soon as this process knows the
        controller moved from this client's address (another thread of it found the new leader):
        an agent's poll then reaches a new controller at once, not at the end of its pause."""
        if self.locator is None:
            time.sleep(seconds)  # a fixed address: nothing can end the pause early
            return
        deadline = time.monotonic() + seconds
        with _moved_news:
            while self.address not in _MOVED:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                _moved_news.wait(left)

    def _cut_off(self) -> None:
        """End the request another thread has in flight on this client's connection (it then fails and
        follows the move). Only the socket is shut down: the owning thread closes the connection."""
        connection = self._conn
        sock = connection.sock if connection is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its thread

    def _move_to(self, address: str) -> None:
        self.close()
        self.host, self.port = parse_address(address)
        self.address = address

    def _follow_known_move(self) -> None:
        seen = set()
        while self.locator is not None and self.address in _MOVED and self.address not in seen:
            seen.add(self.address)
            self._move_to(_MOVED[self.address])

    def _connection(self, timeout: float) -> Connection:
        if self._conn is None:
            self._conn = Connection(self.host, self.port, timeout, None if self.tls is None else self.tls.context())
        self._conn.set_timeout(timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(self, method: str, path: str, payload: Any = None, timeout: float | None = None,
                held: float = 0.0) -> Any:
        """Send one request; returns the decoded JSON (or text for non-JSON replies). ``held``: how
        long the controller may hold it before answering (a long poll)."""
        self._held, self._in_flight_since = held, time.monotonic()
        try:
            return self._request(method, path, payload, timeout)
        finally:
            self._in_flight_since = None

    def _request(self, method: str, path: str, payload: Any, timeout: float | None) -> Any:
        body = None if payload is None else json.dumps(payload).encode()
        headers = {
            TOKEN_HEADER: f"{TOKEN_SCHEME} {self.token}",
            VERSION_HEADER: str(PROTOCOL_VERSION),
            "Content-Type": "application/json",
        }
        wait = self.timeout if timeout is None else timeout
        self._follow_known_move()
        attempt = 0
        while True:
            conn = self._connection(wait)
            try:
                if conn.sock is None:
                    conn.connect()
                if self.locator is not None and self.address in _MOVED:
                    # The move was found while this request connected, too early for its cut-off to
                    # reach this socket: follow it now rather than wait on the old controller.
                    self.close()
                    self._follow_known_move()
                    continue
                response = conn.request(method, path, body, headers)
                data = response.body
                if response.status == 503 and attempt < 3 and self._relocate():
                    attempt += 1  # a deposed controller (failover): ask the new one
                    continue
                break
            except (OSError, http.client.HTTPException) as error:
                self.close()
                attempt += 1
                # The controller may have moved (a failover): asked at once, so that a request that
                # timed out on a frozen leader does not wait a second timeout before following it.
                # Else a kept-alive connection the server closed fails once; a second failure is real.
                if attempt < 4 and self._relocate():
                    continue
                if attempt >= 2:
                    raise ControllerUnreachable(f"controller {self.address}: {error}") from error
        if response.status == 401:
            raise Unauthorized(f"controller {self.address} refused the job token")
        if response.status >= 400:
            raise ControllerUnreachable(f"controller {self.address}: HTTP {response.status}: {data[:200]!r}")
        if (response.headers.get("Content-Type") or "").startswith("application/json"):
            return json.loads(data)
        return data.decode()

    def post(self, path: str, payload: Any, timeout: float | None = None, held: float = 0.0) -> Any:
        return self.request("POST", path, payload, timeout, held)

    def get(self, path: str, timeout: float | None = None) -> Any:
        return self.request("GET", path, None, timeout)
