"""HTTP/1.1 between the controller and its clients (undying/http_wire.py): what both ends read and
refuse, on real sockets.

The server end is a real ``ControllerServer`` on 127.0.0.1 over an in-process Controller, sent raw
bytes: bad request lines, versions and headers are answered with the status ``http.server`` gives
them and the connection is closed; kept-alive and closing connections behave as HTTP/1.0 and 1.1
say. The client end (``Connection``, what ``ControllerClient`` sends through) is pointed at a
scripted socket server that answers with the bytes each test gives it.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from undying.client import ControllerClient
from undying.config import JobSpec
from undying.controller.core import Controller
from undying.controller.server import ControllerServer
from undying.events import EventLog
from undying.http_wire import MAX_HEADERS, MAX_LINE, Connection, LineTooLong, MessageError, read_headers
from undying.protocol import ROUTE_STATUS, ROUTE_WORKER_HEARTBEAT, TOKEN_HEADER, TOKEN_SCHEME

HOST = "127.0.0.1"
TOKEN = "wire-token-0123456789abcdef0123456789"
AUTH = f"{TOKEN_SCHEME} {TOKEN}"
BEAT = {"rank": 0, "node": 0, "generation": 1, "step": 1, "phase": "computing", "pid": 1}


# ------------------------------------------------------------------------------- header fields


def test_header_fields_are_found_in_any_case_and_the_first_of_a_repeated_one_wins() -> None:
    stream = io.BytesIO(b"Content-Type: application/json\r\nX-Twice: first\r\nx-twice: second\r\n"
                        b"Empty:\r\n\r\nnot a header\r\n")
    headers = read_headers(stream)
    assert headers.get("content-type") == "application/json" == headers.get("CONTENT-TYPE")
    assert headers.get("X-TWICE") == "first"
    assert headers.get("empty") == ""
    assert headers.get("missing") is None and headers.get("missing", "d") == "d"
    assert stream.read() == b"not a header\r\n"  # the blank line ends the fields; the body is left


@pytest.mark.parametrize(("text", "error", "says"), [
    (b"A: " + b"x" * MAX_LINE + b"\r\n\r\n", LineTooLong, "too long"),
    (b"".join(b"F%d: v\r\n" % index for index in range(MAX_HEADERS + 1)) + b"\r\n", MessageError, "more than"),
    (b"A: 1\r\n  folded\r\n\r\n", MessageError, "folded"),
    (b"no colon here\r\n\r\n", MessageError, "malformed"),
    (b": no name\r\n\r\n", MessageError, "malformed"),
    (b"Two words: v\r\n\r\n", MessageError, "malformed"),
])
def test_bad_header_fields_are_refused(text: bytes, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=says):
        read_headers(io.BytesIO(text))


def test_exactly_the_most_header_fields_are_read() -> None:
    text = b"".join(b"F%d: v\r\n" % index for index in range(MAX_HEADERS)) + b"\r\n"
    assert len(read_headers(io.BytesIO(text))) == MAX_HEADERS


# ------------------------------------------------------------------------------- the server end


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ControllerServer]:
    events = EventLog(tmp_path)
    served = ControllerServer(Controller(JobSpec(), events, "job-wire", 29555), TOKEN, HOST, 0)
    thread = threading.Thread(target=served.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield served
    served.stop()
    events.close()


def _exchange(port: int, data: bytes) -> tuple[bytes, bool]:
    """Send ``data`` on a fresh connection; (everything answered, whether the server closed it)."""
    with socket.create_connection((HOST, port), timeout=5.0) as sock:
        sock.sendall(data)
        sock.settimeout(1.0)
        answered = b""
        try:
            while chunk := sock.recv(65536):
                answered += chunk
        except TimeoutError:
            return answered, False
        return answered, True


def _status(answered: bytes) -> int:
    return int(answered.split(b" ", 2)[1])


@pytest.mark.parametrize(("request_line", "status"), [
    (b"GET /status\r\n", 400),
    (b"GET /status HTTP/1.1 extra\r\n", 400),
    (b"GET /status FTP/1.1\r\n", 400),
    (b"GET /status HTTP/2.0\r\n", 505),
    (b"GET /status HTTP/1.2\r\n", 505),
])
def test_bad_request_lines_are_answered_and_closed(server: ControllerServer, request_line: bytes, status: int) -> None:
    answered, closed = _exchange(server.port, request_line + f"{TOKEN_HEADER}: {AUTH}\r\n\r\n".encode())
    assert _status(answered) == status and closed


@pytest.mark.parametrize(("fields", "status"), [
    (b"X-Long: " + b"x" * MAX_LINE + b"\r\n", 431),
    (b"".join(b"F%d: v\r\n" % index for index in range(MAX_HEADERS + 1)), 431),
    (b"X: 1\r\n folded\r\n", 400),
])
def test_bad_header_fields_are_answered_and_closed(server: ControllerServer, fields: bytes, status: int) -> None:
    answered, closed = _exchange(server.port, b"GET /status HTTP/1.1\r\n" + fields + b"\r\n")
    assert _status(answered) == status and closed


def _get_status(version: str, connection: str | None) -> bytes:
    lines = [f"GET {ROUTE_STATUS} {version}", f"authorization: {AUTH}"]  # the field's name in lower case
    if connection is not None:
        lines.append(f"Connection: {connection}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.parametrize(("version", "connection", "kept"), [
    ("HTTP/1.1", None, True),
    ("HTTP/1.1", "close", False),
    ("HTTP/1.0", None, False),
    ("HTTP/1.0", "keep-alive", True),
])
def test_connections_are_kept_or_closed_as_the_request_says(server: ControllerServer, version: str,
                                                            connection: str | None, kept: bool) -> None:
    answered, closed = _exchange(server.port, _get_status(version, connection))
    assert _status(answered) == 200 and closed is not kept
    assert json.loads(answered.partition(b"\r\n\r\n")[2])["job_id"] == "job-wire"


def test_two_requests_in_one_segment_are_both_answered(server: ControllerServer) -> None:
    answered, _ = _exchange(server.port, _get_status("HTTP/1.1", None) * 2)
    assert answered.count(b"HTTP/1.1 200 OK") == 2


def test_the_client_sends_each_request_in_one_segment_on_one_kept_connection(server: ControllerServer,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    client = ControllerClient(server.address, TOKEN)
    try:
        client.post(ROUTE_WORKER_HEARTBEAT, BEAT)
        connection = client._conn
        assert connection is not None and connection.sock is not None
        sent: list[bytes] = []
        real_sendall = connection.sock.sendall

        class Counting:  # the socket's own methods cannot be patched; wrap it
            def __getattr__(self, name: str) -> object:
                return getattr(real_socket, name)

            def sendall(self, data: bytes) -> None:
                sent.append(bytes(data))
                real_sendall(data)

        real_socket = connection.sock
        monkeypatch.setattr(connection, "sock", Counting())
        client.post(ROUTE_WORKER_HEARTBEAT, BEAT)
        assert len(sent) == 1 and sent[0].startswith(b"POST ") and sent[0].endswith(json.dumps(BEAT).encode())
        assert client._conn is connection
    finally:
        client.close()


# ------------------------------------------------------------------------------- the client end


class Scripted:
    """A one-connection socket server that reads one request and answers ``reply`` (raw bytes)."""

    def __init__(self, reply: bytes, close_after: bool) -> None:
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.reply, self.close_after = reply, close_after
        self.requests: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sock, _ = self.listener.accept()
        with sock:
            data = b""
            while b"\r\n\r\n" not in data:
                data += sock.recv(65536)
            self.requests.append(data)
            sock.sendall(self.reply)
            if not self.close_after:
                sock.recv(1)  # held open until the client closes it

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize(("reply", "close_after", "body", "kept"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", False, b"hello", True),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nConnection: close\r\n\r\nhello", True, b"hello", False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi", True, b"hi", False),
    (b"HTTP/1.1 404 Not Found\r\n\r\nto the close", True, b"to the close", False),
])
def test_responses_are_read_to_their_length_or_their_close(reply: bytes, close_after: bool, body: bytes,
                                                           kept: bool) -> None:
    scripted = Scripted(reply, close_after)
    connection = Connection(HOST, scripted.port, 5.0)
    try:
        response = connection.request("GET", "/x", None, {"A": "1"})
        assert response.body == body and response.status == int(reply.split(b" ")[1])
        assert (connection.sock is not None) is kept
        assert scripted.requests[0].startswith(b"GET /x HTTP/1.1\r\nHost: 127.0.0.1:")
    finally:
        connection.close()
        scripted.close()


@pytest.mark.parametrize(("reply", "error"), [
    (b"", http.client.RemoteDisconnected),
    (b"ICY 200 OK\r\n\r\n", MessageError),
    (b"HTTP/1.1 2x0 OK\r\n\r\n", MessageError),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", MessageError),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", MessageError),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", http.client.IncompleteRead),
])
def test_responses_the_endpoint_never_sends_fail_as_http_errors(reply: bytes, error: type[Exception]) -> None:
    scripted = Scripted(reply, close_after=True)
    connection = Connection(HOST, scripted.port, 5.0)
    try:
        with pytest.raises(error):
            connection.request("POST", "/x", b"{}", {})
        assert issubclass(error, (OSError, http.client.HTTPException))  # what ControllerClient retries on
    finally:
        connection.close()
        scripted.close()
