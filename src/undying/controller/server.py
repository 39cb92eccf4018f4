"""The controller's HTTP endpoint: agent and worker RPCs, /status, /metrics, /events.

Runs in the controller process, one thread per connection. Every route, reads
included, needs ``Authorization: Bearer <job token>``; a request without it gets 401,
is logged as an ``auth_refused`` event, and changes nothing. Given a TLS context
(``undying run --tls-cert/--tls-key``) it serves HTTPS only; a client that fails the
handshake (plain HTTP, a certificate it does not trust) is logged as ``auth_refused`` too.
"""

from __future__ import annotations

import hmac
import json
import select
import socket
import ssl
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

from undying import events as ev
from undying.client import format_address
from undying.controller.core import Controller, NotInCharge
from undying.controller.message_checks import check_request, worker_event
from undying.events import Event, read_events
from undying.http_wire import LeanRequestHead
from undying.protocol import (
    ROUTE_AGENT_HELLO,
    ROUTE_AGENT_LEAVE,
    ROUTE_AGENT_POLL,
    ROUTE_AGENT_REPORT,
    ROUTE_EVENT,
    ROUTE_EVENTS,
    ROUTE_INJECT_CLAIM,
    ROUTE_JOB_STOP,
    ROUTE_METRICS,
    ROUTE_STATUS,
    ROUTE_WORKER_HEARTBEAT,
    ROUTE_WORKER_RECOVER,
    TOKEN_HEADER,
    TOKEN_SCHEME,
    AgentHello,
    AgentLeave,
    AgentPoll,
    Granted,
    Heartbeat,
    InjectionClaim,
    Message,
    Plan,
    RecoverRequest,
    StopRequest,
)
from undying.tls import HANDSHAKE_TIMEOUT_S

M = TypeVar("M", bound=Message)
MAX_BODY = 1 << 20
SHUTDOWN_POLL_S = 0.05  # how soon ``ControllerServer.stop`` returns


class PlanReplies:
    """A recovery's plan encoded once, not once per rank: every survivor and newcomer leaves with the
    same plan, whose member list makes each encoding cost ~10 ms at 16k ranks (bench/scale.py)."""

    def __init__(self) -> None:
        self._last: tuple[Plan, bytes] | None = None

    def encode(self, plan: Plan) -> bytes:
        last = self._last  # read once: handler threads share it, and a race only encodes twice
        if last is not None and last[0] == plan:
            return last[1]
        body = json.dumps(plan.to_dict()).encode()
        self._last = (plan, body)
        return body


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    tls: ssl.SSLContext | None = None  # HTTPS: each connection's handshake runs on its own thread
    on_tls_refused: Callable[[str, str], object] = staticmethod(lambda client, why: None)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        # Not in accept(): a client that never finishes its handshake must not hold up the others.
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the handshake's writes too (Nagle)
        try:
            secured = self.tls.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as error:
            request.close()
            self.on_tls_refused(client_address[0], f"TLS handshake failed: {getattr(error, 'reason', None) or error}")
            return
        secured.settimeout(None)
        try:
            super().finish_request(secured, client_address)
        finally:
            secured.close()  # the plain socket was detached into it: closing that one closes nothing

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that died mid-request (a killed agent or worker) is normal here.
        error = sys.exc_info()[1]
        if isinstance(error, (BrokenPipeError, ConnectionResetError, TimeoutError, ssl.SSLError)):
            return
        super().handle_error(request, client_address)


class ControllerServer:
    """Serves one Controller on (host, port); port 0 picks a free one."""

    def __init__(self, controller: Controller, token: str, host: str, port: int = 0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.controller = controller
        self.token = token
        self.plan_replies = PlanReplies()
        handler = _make_handler(self)
        self.httpd = _QuietServer((host, port), handler)
        self.httpd.tls = tls
        self.httpd.on_tls_refused = lambda client, why: controller.events.emit(Event(
            kind=ev.AUTH_REFUSED, details={"client": client, "why": why}))
        self.host = host
        self.port: int = self.httpd.server_address[1]
        # A short poll: ``stop`` waits for the loop's next look at its shutdown flag (0.5 s by default,
        # paid at the end of every job); new connections wake it at once either way.
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                                        name="controller-http", daemon=True)

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def authorized(self, header: str | None) -> bool:
        if not header or not header.startswith(TOKEN_SCHEME + " "):
            return False
        return hmac.compare_digest(header[len(TOKEN_SCHEME) + 1:].encode(), self.token.encode())


def _make_handler(server: ControllerServer) -> type[BaseHTTPRequestHandler]:
    controller = server.controller

    class Handler(LeanRequestHead):
        protocol_version = "HTTP/1.1"
        # One segment per response on kept-alive connections: written unbuffered, the headers left
        # alone and the body waited (Nagle) for the client's delayed ACK, 40 ms per round trip here.
        # Buffered, the response goes out in one write when the request is done (handle_one_request
        # flushes), and TCP_NODELAY sends it at once.
        wbufsize = -1
        disable_nagle_algorithm = True
        # The agent (node, pid) whose polls this connection carries: when it closes, the agent may be gone.
        polling_agent: tuple[int, int] | None = None

        def handle(self) -> None:
            try:
                super().handle()
            finally:
                if self.polling_agent is not None:
                    controller.agent_disconnected(*self.polling_agent)

        def _connected(self) -> bool:
            """False once the client closed this connection (a request in flight is never followed
            by another before its answer, so anything readable now is the close)."""
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                # The TCP stream itself (under TLS too: a peek below the TLS layer): b"" is the close.
                return not readable or socket.socket.recv(self.connection, 1, socket.MSG_PEEK) != b""
            except OSError:
                return False

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base-class signature
            return

        def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, payload: Any, status: int = 200) -> None:
            self._reply(status, json.dumps(payload).encode())

        def _check_token(self) -> bool:
            if server.authorized(self.headers.get(TOKEN_HEADER)):
                return True
            controller.events.emit(Event(kind=ev.AUTH_REFUSED, details={
                "path": self.path, "method": self.command, "client": self.client_address[0]}))
            self._json({"error": "unauthorized"}, 401)
            return False

        def _not_in_charge(self) -> None:
            # Another controller leads now (failover): clients look it up in etcd and go there.
            self.close_connection = True
            self._json({"error": "this controller does not lead the job; ask etcd for the leader"}, 503)

        def _deposed(self) -> bool:
            if controller.deposed:
                self._not_in_charge()
            return controller.deposed

        def do_GET(self) -> None:  # noqa: N802 - http.server naming
            if not self._check_token() or self._deposed():
                return
            path, _, query = self.path.partition("?")
            if path == ROUTE_STATUS:
                self._json(controller.status())
            elif path == ROUTE_METRICS:
                body, content_type = controller.metrics.render(self.headers.get("Accept"))
                self._reply(200, body, content_type)
            elif path == ROUTE_EVENTS:
                since_text = query.split("since=")[1].split("&")[0] if "since=" in query else "0"
                if not since_text.isdecimal():
                    self._json({"error": "since must be a non-negative integer"}, 400)
                    return
                since = int(since_text)
                events = read_events(controller.events.path)[since:]
                self._json([event.__dict__ for event in events])
            else:
                self._json({"error": "not found"}, 404)

        def do_POST(self) -> None:  # noqa: N802 - http.server naming
            if not self._check_token():
                self.close_connection = True
                return
            if self._deposed():
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY:
                self.close_connection = True
                self._json({"error": f"Content-Length must be 0..{MAX_BODY}"}, 413)
                return
            body = self.rfile.read(length) if length else b""
            try:
                payload = json.loads(body) if body else {}
                if not isinstance(payload, dict):
                    raise ValueError("body must be a JSON object")
                self._route_post(payload)
            except NotInCharge:
                self._not_in_charge()
            except (ValueError, TypeError, KeyError) as error:
                # Logged: a client of the job sending what the controller refuses is a bug worth seeing.
                controller.events.emit(Event(kind=ev.REQUEST_REFUSED, details={
                    "path": self.path, "client": self.client_address[0], "error": str(error)[:300]}))
                self._json({"error": f"bad request: {error}"}, 400)

        def _decoded(self, kind: type[M], payload: dict[str, Any]) -> M:
            """The request as a ``kind``, its types and values checked (message_checks.py): nothing
            of a request with a bad value reaches the job machine."""
            message = kind.from_dict(payload)
            check_request(controller.machine.spec, message)
            return message

        def _route_post(self, payload: dict[str, Any]) -> None:
            if self.path == ROUTE_AGENT_HELLO:
                self._json(controller.hello(self._decoded(AgentHello, payload)).to_dict())
            elif self.path == ROUTE_AGENT_POLL:
                poll = self._decoded(AgentPoll, payload)
                self.polling_agent = (poll.node, poll.pid)
                self._json(controller.poll(poll, connected=self._connected).to_dict())
            elif self.path == ROUTE_AGENT_LEAVE:
                self._json({"ok": controller.agent_leaving(self._decoded(AgentLeave, payload))})
            elif self.path == ROUTE_AGENT_REPORT:
                controller.report(self._decoded(AgentPoll, payload))
                self._json({"ok": True})
            elif self.path == ROUTE_WORKER_HEARTBEAT:
                self._json(controller.heartbeat(self._decoded(Heartbeat, payload)).to_dict())
            elif self.path == ROUTE_WORKER_RECOVER:
                plan = controller.recover(self._decoded(RecoverRequest, payload))
                self._reply(200, server.plan_replies.encode(plan))
            elif self.path == ROUTE_EVENT:
                controller.worker_event(worker_event(controller.machine.spec, payload))
                self._json({"ok": True})
            elif self.path == ROUTE_INJECT_CLAIM:
                self._json(Granted(controller.claim_injection(self._decoded(InjectionClaim, payload))).to_dict())
            elif self.path == ROUTE_JOB_STOP:
                stop = self._decoded(StopRequest, payload)
                controller.request_stop(stop.reason or "stopped through the HTTP endpoint", at_once=stop.now)
                self._json({"ok": True})
            else:
                self._json({"error": "not found"}, 404)

    return Handler
