"""The controller's HTTP endpoint refuses every route without the job token, and changes nothing.

A real ``ControllerServer`` on 127.0.0.1 with an ephemeral port over an in-process
Controller (its run loop is not needed); requests go through ``http.client``.
"""

from __future__ import annotations

import errno
import http.client
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from undying import events as ev
from undying.client import ControllerClient, Unauthorized
from undying.config import JobSpec
from undying.controller.core import Controller
from undying.controller.server import ControllerServer
from undying.controller.state import JobState
from undying.events import EventLog, read_events
from undying.inject import encode, parse_injections
from undying.protocol import (
    ROUTE_AGENT_HELLO,
    ROUTE_AGENT_POLL,
    ROUTE_EVENT,
    ROUTE_EVENTS,
    ROUTE_INJECT_CLAIM,
    ROUTE_JOB_STOP,
    ROUTE_METRICS,
    ROUTE_STATUS,
    ROUTE_WORKER_HEARTBEAT,
    TOKEN_HEADER,
    AgentHello,
)

TOKEN = "s3cret-job-token-0123456789abcdef"
HOST = "127.0.0.1"

# Every route with a request that would change the controller (or reveal its state) if it were let in.
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", ROUTE_STATUS, None),
    ("GET", ROUTE_METRICS, None),
    ("GET", ROUTE_EVENTS, None),
    ("POST", ROUTE_AGENT_HELLO, {"node": 1, "pid": 4242, "hostname": "intruder", "nproc": 1}),
    ("POST", ROUTE_AGENT_POLL, {"node": 0, "generation": 0, "workers": [], "wait": 0.0}),
    ("POST", ROUTE_WORKER_HEARTBEAT,
     {"rank": 0, "node": 0, "generation": 0, "step": 5, "phase": "computing", "pid": 1}),
    ("POST", ROUTE_EVENT, {"kind": "forged_event", "node": 0}),
    ("POST", ROUTE_INJECT_CLAIM, {"index": 0, "rank": 0, "node": 0, "generation": 0, "step": 0}),
    ("POST", ROUTE_JOB_STOP, {"reason": "forged stop"}),
]
ROUTE_IDS = [f"{method} {path}" for method, path, _ in ROUTES]

BAD_CREDENTIALS = {
    "missing": None,
    "wrong-token": "Bearer not-the-token",
    "token-prefix": "Bearer " + TOKEN[:-1],
    "token-suffix": "Bearer " + TOKEN + "x",
    "empty-token": "Bearer ",
    "wrong-scheme": "Basic " + TOKEN,
    "no-scheme": TOKEN,
}


class Served:
    """A controller (nnodes=2) behind a started server on 127.0.0.1."""

    def __init__(self, run_dir: Path) -> None:
        self.events_log = EventLog(run_dir)
        self.run_dir = run_dir
        self.controller = Controller(JobSpec(nnodes=2), self.events_log, "job-auth", 29555)
        self.server = ControllerServer(self.controller, TOKEN, HOST, 0)
        # ControllerServer.start() serves with the default 0.5 s poll, which stop() then waits out;
        # a short poll keeps a hundred servers fast (test_start_and_stop covers start() itself).
        self._thread = threading.Thread(target=self.server.httpd.serve_forever,
                                        kwargs={"poll_interval": 0.01}, daemon=True)
        self._thread.start()

    def request(self, method: str, path: str, payload: dict[str, Any] | None,
                authorization: str | None) -> tuple[int, bytes, str]:
        connection = http.client.HTTPConnection(HOST, self.server.port, timeout=5.0)
        headers = {"Content-Type": "application/json"}
        if authorization is not None:
            headers[TOKEN_HEADER] = authorization
        body = None if payload is None else json.dumps(payload).encode()
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.read(), response.getheader("Content-Type", "")
        finally:
            connection.close()

    def kinds(self) -> list[str]:
        return [event.kind for event in read_events(self.run_dir)]

    def close(self) -> None:
        self.server.stop()
        self.events_log.close()


@pytest.fixture
def served(tmp_path: Path):
    served = Served(tmp_path)
    yield served
    served.close()


@pytest.mark.parametrize("authorization", list(BAD_CREDENTIALS.values()), ids=list(BAD_CREDENTIALS))
@pytest.mark.parametrize(("method", "path", "payload"), ROUTES, ids=ROUTE_IDS)
def test_every_route_refuses_a_request_without_the_right_token(served, method, path, payload, authorization):
    controller = served.controller
    controller.hello(_hello(0))
    node0_seen = controller.nodes[0].last_seen
    before = read_events(served.run_dir)

    status, body, content_type = served.request(method, path, payload, authorization)

    assert status == 401
    assert content_type.startswith("application/json")
    assert json.loads(body) == {"error": "unauthorized"}
    # Nothing changed: no node joined, no poll seen, no claim, no event, no cancel.
    assert set(controller.nodes) == {0}
    assert controller.nodes[0].pid == 1000
    assert controller.nodes[0].last_seen == node0_seen
    assert controller.claimed_injections == set()
    assert controller.state is JobState.WAITING_FOR_NODES
    assert controller.exit_code is None
    after = read_events(served.run_dir)
    assert [event.kind for event in after[len(before):]] == [ev.AUTH_REFUSED]
    refused = after[-1]
    assert refused.details["path"] == path
    assert refused.details["method"] == method
    assert refused.details["client"] == HOST
    assert "forged_event" not in served.kinds()


@pytest.mark.parametrize(("method", "path", "payload"), ROUTES, ids=ROUTE_IDS)
def test_every_route_answers_the_right_token(served, method, path, payload):
    # The same requests succeed with the token, so the refusals above are about the token alone.
    status, _, _ = served.request(method, path, payload, "Bearer " + TOKEN)
    assert status == 200
    assert ev.AUTH_REFUSED not in served.kinds()


def test_authorized_requests_do_what_they_say(served):
    controller = served.controller
    controller.machine.injections_text = encode(parse_injections(["raise:rank=0:step=0"]))
    # The run loop starts generation 1 once both nodes said hello, so the claims have a rank to belong to.
    loop = threading.Thread(target=controller.run, name="controller-run", daemon=True)
    loop.start()
    client = ControllerClient(served.server.address, TOKEN)
    claim = {"index": 0, "rank": 0, "node": 0, "generation": 1, "step": 0}
    try:
        # No rank is known before the job starts: a claim is refused and not used up.
        assert client.post(ROUTE_INJECT_CLAIM, claim) == {"granted": False}
        for node in (0, 1):
            reply = client.post(ROUTE_AGENT_HELLO, _hello(node).to_dict())
            assert reply["accepted"] and reply["job_id"] == "job-auth"
        assert set(controller.nodes) == {0, 1}
        deadline = time.time() + 5.0
        while controller.state is not JobState.RUNNING and time.time() < deadline:
            time.sleep(0.01)
        assert (controller.state, controller.generation) == (JobState.RUNNING, 1)

        assert client.post(ROUTE_INJECT_CLAIM, claim) == {"granted": True}
        assert client.post(ROUTE_INJECT_CLAIM, claim) == {"granted": False}
        assert controller.claimed_injections == {0}
        client.post(ROUTE_JOB_STOP, {"reason": "stopped by test", "now": True})
        assert controller.state is JobState.CANCELLED
        assert controller.message == "stopped by test"
    finally:
        controller.cancel("test teardown")
        for node in (0, 1):  # each agent takes its exit order, so the loop ends at once
            client.post(ROUTE_AGENT_POLL, {"node": node, "generation": 1, "workers": [], "wait": 0.0})
        client.close()
        loop.join(5.0)
    assert not loop.is_alive()
    assert controller.exit_code == 130


def test_status_is_json_and_metrics_are_prometheus_text(served):
    client = ControllerClient(served.server.address, TOKEN)
    try:
        status = client.get(ROUTE_STATUS)
        assert status["job_id"] == "job-auth"
        assert status["state"] == "waiting_for_nodes"
        metrics = client.get(ROUTE_METRICS)
        assert isinstance(metrics, str)
        assert "# TYPE undying_generation gauge" in metrics
        assert "undying_generation 0.0" in metrics
        assert 'undying_job_state{undying_job_state="waiting_for_nodes"} 1.0' in metrics
        events = client.get(ROUTE_EVENTS)
        assert isinstance(events, list)
    finally:
        client.close()
    status, _, content_type = served.request("GET", ROUTE_METRICS, None, "Bearer " + TOKEN)
    assert status == 200 and content_type.startswith("text/plain")


def test_client_with_a_wrong_token_raises_unauthorized(served):
    client = ControllerClient(served.server.address, "not-the-token")
    try:
        with pytest.raises(Unauthorized):
            client.get(ROUTE_STATUS)
        with pytest.raises(Unauthorized):
            client.post(ROUTE_AGENT_HELLO, _hello(1).to_dict())
    finally:
        client.close()
    assert served.controller.nodes == {}
    assert served.kinds() == [ev.AUTH_REFUSED, ev.AUTH_REFUSED]


def test_start_and_stop(tmp_path):
    events_log = EventLog(tmp_path)
    server = ControllerServer(Controller(JobSpec(), events_log, "job-auth", 29555), TOKEN, HOST, 0)
    server.start()
    client = ControllerClient(server.address, TOKEN)
    try:
        assert client.get(ROUTE_STATUS)["job_id"] == "job-auth"
    finally:
        client.close()
        server.stop()
        events_log.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((HOST, server.port), timeout=2.0).close()


def test_server_binds_only_the_given_host(served):
    host, port = served.server.httpd.server_address[:2]
    assert (host, port) == (HOST, served.server.port)
    assert port != 0
    assert served.server.address == f"{HOST}:{port}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="127.0.0.2 is loopback on Linux only")
def test_server_is_not_reachable_on_another_local_address(served):
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        code = probe.connect_ex(("127.0.0.2", served.server.port))
    finally:
        probe.close()
    assert code == errno.ECONNREFUSED


def _hello(node: int) -> AgentHello:
    return AgentHello(node, 1000 + node, f"host{node}", 1)
