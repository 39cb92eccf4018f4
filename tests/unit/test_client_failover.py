"""The controller client follows a failover at the first failed request: a request that timed out on
a frozen leader (it accepts connections and never answers) goes to the new leader next, not to the
frozen one a second time."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

from undying.client import ControllerClient


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"from": "new leader"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _Cluster:
    """A frozen leader (takes connections, never answers) and a new leader that answers."""

    def __init__(self) -> None:
        self.frozen = socket.socket()
        self.frozen.bind(("127.0.0.1", 0))
        self.frozen.listen(8)
        self.accepted: list[socket.socket] = []
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()
        self.leader = http.server.HTTPServer(("127.0.0.1", 0), _Answer)
        threading.Thread(target=self.leader.serve_forever, daemon=True).start()
        self.frozen_address = f"127.0.0.1:{self.frozen.getsockname()[1]}"
        self.new_address = f"127.0.0.1:{self.leader.server_address[1]}"

    def _accept(self) -> None:
        self.frozen.settimeout(0.1)
        while not self.stop.is_set():
            try:
                self.accepted.append(self.frozen.accept()[0])
            except OSError:
                continue

    def close(self) -> None:
        self.stop.set()
        self.leader.shutdown()
        self.frozen.close()
        for connection in self.accepted:
            connection.close()


def test_a_move_one_thread_found_cuts_another_threads_request_to_the_frozen_leader_short() -> None:
    """An agent's long poll (a long timeout) held by a frozen leader follows the move its beat thread
    found, instead of waiting for its own timeout."""
    cluster = _Cluster()
    try:
        poll = ControllerClient(cluster.frozen_address, "token", timeout=60.0, locator=lambda: cluster.new_address)
        answers: list[object] = []
        poller = threading.Thread(target=lambda: answers.append(poll.post("/agent/poll", {})), daemon=True)
        poller.start()
        while not cluster.accepted:  # the poll is in flight on the frozen leader
            time.sleep(0.01)
        beat = ControllerClient(cluster.frozen_address, "token", timeout=0.3, locator=lambda: cluster.new_address)
        assert beat.post("/agent/beat", {}) == {"from": "new leader"}
        poller.join(timeout=20)  # far below the poll's own 60 s timeout
        assert answers == [{"from": "new leader"}] and poll.address == cluster.new_address
    finally:
        cluster.close()


def test_a_request_that_timed_out_on_a_frozen_leader_goes_to_the_new_one_next() -> None:
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # a frozen controller: takes connections, never answers
        frozen.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(frozen.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    leader = http.server.HTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=leader.serve_forever, daemon=True).start()
    try:
        new_address = f"127.0.0.1:{leader.server_address[1]}"
        client = ControllerClient(f"127.0.0.1:{frozen.getsockname()[1]}", "token", timeout=0.5,
                                  locator=lambda: new_address)
        assert client.post("/agent/poll", {}) == {"from": "new leader"}
        assert client.address == new_address
        assert len(accepted) == 1  # one try on the frozen leader, not two
    finally:
        stop.set()
        leader.shutdown()
        frozen.close()
        for connection in accepted:
            connection.close()


def test_a_request_stuck_on_a_frozen_leader_follows_the_move_the_watcher_finds() -> None:
    """No other thread of the process asks: the process's move watcher sees the request in flight
    for longer than it may be held, asks where the controller is, and cuts it off once it moved."""
    cluster = _Cluster()
    try:
        located: list[str | None] = [None]  # the new leader is not published yet
        client = ControllerClient(cluster.frozen_address, "token", timeout=60.0, locator=lambda: located[0])
        answers: list[object] = []
        requester = threading.Thread(target=lambda: answers.append(client.post("/worker/heartbeat", {})), daemon=True)
        requester.start()
        while not cluster.accepted:
            time.sleep(0.01)
        time.sleep(0.5)
        assert not answers  # still held by the frozen leader
        located[0] = cluster.new_address  # the takeover is published
        requester.join(timeout=20)  # far below the request's own 60 s timeout
        assert answers == [{"from": "new leader"}] and client.address == cluster.new_address
    finally:
        cluster.close()


def test_a_pause_before_a_retry_ends_when_another_thread_finds_the_move() -> None:
    """An agent whose poll found no controller (the dead leader's lease not yet expired) pauses before
    it polls again; its beat thread finding the new leader ends that pause at once, so its poll
    reaches the new controller then, not a whole pause later."""
    cluster = _Cluster()
    try:
        located: list[str | None] = [None]
        poll = ControllerClient(cluster.frozen_address, "token", timeout=0.3, locator=lambda: located[0])
        beat = ControllerClient(cluster.frozen_address, "token", timeout=0.3, locator=lambda: located[0])

        def new_leader_found_by_the_beat() -> None:
            time.sleep(0.3)
            located[0] = cluster.new_address
            beat.post("/agent/beat", {})  # times out on the frozen leader, then relocates

        threading.Thread(target=new_leader_found_by_the_beat, daemon=True).start()
        paused = time.monotonic()
        poll.wait_for_move(10.0)
        assert time.monotonic() - paused < 3.0
        assert poll.post("/agent/poll", {}) == {"from": "new leader"}
        fixed = ControllerClient(cluster.new_address, "token")  # no locator: a plain pause
        paused = time.monotonic()
        fixed.wait_for_move(0.2)
        assert time.monotonic() - paused >= 0.2
    finally:
        cluster.close()


def test_a_request_that_connects_as_the_move_is_found_follows_it(monkeypatch) -> None:  # noqa: ANN001
    """Another thread finds the move while this request is connecting to the frozen leader, after it
    looked for a known move and before its socket exists for the cut-off to reach: the request still
    follows the move at once instead of waiting its timeout on the frozen leader."""
    from undying import client as client_module
    from undying.http_wire import Connection

    cluster = _Cluster()
    real_connect = Connection.connect
    found = []

    def connect_as_the_move_is_found(self: Connection) -> None:
        if self.port == int(cluster.frozen_address.rsplit(":", 1)[1]) and not found:
            found.append(True)
            client_module._cut_off_moved(cluster.frozen_address, cluster.new_address)  # the other thread
        real_connect(self)

    monkeypatch.setattr(Connection, "connect", connect_as_the_move_is_found)
    try:
        client = ControllerClient(cluster.frozen_address, "token", timeout=5.0, locator=lambda: cluster.new_address)
        sent = time.monotonic()
        assert client.post("/worker/heartbeat", {}) == {"from": "new leader"}
        assert found and time.monotonic() - sent < 2.0
    finally:
        client_module._MOVED.pop(cluster.frozen_address, None)
        cluster.close()


def test_a_leader_back_at_an_address_it_once_held_is_reached_there() -> None:
    """The controller moves from A to B, then back to A (a restarted node on its old port): a request
    goes to A and is answered there, instead of following a stale move A -> B -> A in a loop."""
    from undying import client as client_module

    cluster = _Cluster()
    try:
        a, b = cluster.new_address, cluster.frozen_address
        client_module._cut_off_moved(a, b)
        client_module._cut_off_moved(b, a)
        assert a not in client_module._MOVED and client_module._MOVED[b] == a
        client = ControllerClient(b, "token", timeout=2.0, locator=lambda: a)
        sent = time.monotonic()
        assert client.post("/worker/heartbeat", {}) == {"from": "new leader"} and client.address == a
        assert time.monotonic() - sent < 2.0
    finally:
        client_module._MOVED.pop(cluster.frozen_address, None)
        client_module._MOVED.pop(cluster.new_address, None)
        cluster.close()
