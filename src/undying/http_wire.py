"""HTTP/1.1 on the wire between the controller and the processes that talk to it.

Runs in every process that sends the controller requests (agents, workers, the CLI: ``Connection``)
and in the controller's handler threads (``LeanRequestHead``: its requests' first line and headers). A heartbeat is
sent about four times a second by every rank, so its framing is kept lean: the request leaves in one
segment (headers and body together, where ``http.client`` sends two) and header fields are read
into a plain dict (``http.client.parse_headers`` builds an ``email`` message, about a third of a
round trip's CPU on either end). Only what the endpoint speaks is read: a response framed by
``Content-Length`` or ended by its connection's close; anything else fails as
``http.client.HTTPException``, so callers handle it with the connection errors they already handle.
"""

from __future__ import annotations

import http.client
import socket
import ssl
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import IO

MAX_LINE = 65536  # bytes in one header or status line
MAX_HEADERS = 100  # header fields in one message


class MessageError(http.client.HTTPException):
    """A message that is not the HTTP/1.1 the endpoint speaks (its text says what was wrong)."""


class HeadTooLarge(MessageError):
    """A message head over the limits (a server answers it with 431)."""


class LineTooLong(HeadTooLarge):
    """A status, request or header line longer than ``MAX_LINE``."""


class TooManyHeaders(HeadTooLarge):
    """More than ``MAX_HEADERS`` header fields."""


class Headers(dict[str, str]):
    """A message's header fields by lower-cased name (the first of a repeated field), looked up in
    any case, as ``email.message.Message.get`` did."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)


def read_headers(stream: IO[bytes]) -> Headers:
    """The header fields of a message from ``stream``, up to and including the blank line that ends
    them (or the end of the stream). Raises ``LineTooLong``, ``TooManyHeaders`` or ``MessageError``: a
    folded (obsolete) continuation line, a line without a name and a colon."""
    headers = Headers()
    for _ in range(MAX_HEADERS + 1):
        line = stream.readline(MAX_LINE + 1)
        if len(line) > MAX_LINE:
            raise LineTooLong("header line too long")
        if line in (b"\r\n", b"\n", b""):
            return headers
        if line[:1] in (b" ", b"\t"):
            raise MessageError("folded header lines are not accepted")
        name, colon, value = line.decode("iso-8859-1").partition(":")
        name = name.strip()
        if not colon or not name or " " in name or "\t" in name:
            raise MessageError(f"malformed header line {line[:80]!r}")
        headers.setdefault(name.lower(), value.strip())
    raise TooManyHeaders(f"more than {MAX_HEADERS} header fields")


@dataclass(frozen=True)
class Response:
    status: int
    headers: Headers
    body: bytes


class Connection:
    """One kept-alive HTTP/1.1 connection to ``host:port`` (HTTPS given an ``ssl`` context, which
    verifies the server's name as ``host``). Opened at the first request; closed after a response
    that says so. ``sock`` is None until then, and after ``close``. Not thread-safe."""

    def __init__(self, host: str, port: int, timeout: float, context: ssl.SSLContext | None = None) -> None:
        self.host, self.port, self.timeout, self.context = host, port, timeout, context
        self.sock: socket.socket | None = None
        self._reader: IO[bytes] | None = None
        self._host_field = (f"[{host}]" if ":" in host else host) + f":{port}"

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the request is one segment already
            if self.context is not None:
                sock = self.context.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        self.sock, self._reader = sock, sock.makefile("rb")

    def set_timeout(self, timeout: float) -> None:
        self.timeout = timeout
        if self.sock is not None:
            self.sock.settimeout(timeout)

    def request(self, method: str, path: str, body: bytes | None, fields: dict[str, str]) -> Response:
        """Send one request (``fields``: its header fields besides Host and Content-Length) and
        read its response. Any error leaves the connection to be closed by the caller."""
        if self.sock is None:
            self.connect()
        assert self.sock is not None and self._reader is not None
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self._host_field}",
                 *(f"{name}: {value}" for name, value in fields.items())]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("iso-8859-1") + (body or b""))
        return self._response()

    def _response(self) -> Response:
        assert self._reader is not None
        line = self._reader.readline(MAX_LINE + 1)
        if not line:
            raise http.client.RemoteDisconnected("the controller closed the connection without a response")
        if len(line) > MAX_LINE:
            raise LineTooLong("status line too long")
        version, _, rest = line.decode("iso-8859-1").rstrip("\r\n").partition(" ")
        code = rest.partition(" ")[0]
        if version not in ("HTTP/1.0", "HTTP/1.1") or len(code) != 3 or not code.isdigit():
            raise MessageError(f"bad status line {line[:80]!r}")
        headers = read_headers(self._reader)
        if "transfer-encoding" in headers:
            raise MessageError(f"a {headers['transfer-encoding']} response (only Content-Length is read)")
        length = headers.get("Content-Length")
        if length is None:
            body = self._reader.read()  # ended by the connection's close
        elif not length.isdigit():
            raise MessageError(f"bad Content-Length {length[:40]!r}")
        else:
            body = self._reader.read(int(length))
            if len(body) < int(length):
                raise http.client.IncompleteRead(body, int(length) - len(body))
        connection = (headers.get("Connection") or "").lower()
        if length is None or connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive"):
            self.close()
        return Response(int(code), headers, body)

    def close(self) -> None:
        reader, sock = self._reader, self.sock
        self._reader = self.sock = None
        if reader is not None:
            reader.close()
        if sock is not None:
            sock.close()


class LeanRequestHead(BaseHTTPRequestHandler):
    """``http.server``'s request handler with the request line and header fields read by
    ``read_headers``. HTTP/1.0 and HTTP/1.1 only (no HTTP/0.9): a bad line gets 400, another
    version 505, headers too long or too many 431, a malformed header 400, each through
    ``send_error`` with a status line, and the connection is closed. ``self.headers`` is a
    ``Headers``."""

    raw_requestline: bytes  # set by http.server's handle_one_request before it calls parse_request

    def parse_request(self) -> bool:
        self.command = None  # type: ignore[assignment]  # as http.server: unset until the line is read
        self.request_version = self.default_request_version
        self.close_connection = True
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = self.requestline.split()
        if not words:
            return False
        # Errors are answered with a status line and headers (as to HTTP/1.0), never HTTP/0.9's bare body.
        self.request_version = "HTTP/1.0"
        if len(words) != 3:
            self.send_error(HTTPStatus.BAD_REQUEST, f"Bad request syntax ({self.requestline[:80]!r})")
            return False
        command, path, version = words
        if version not in ("HTTP/1.0", "HTTP/1.1"):
            bad = not version.startswith("HTTP/")
            self.send_error(HTTPStatus.BAD_REQUEST if bad else HTTPStatus.HTTP_VERSION_NOT_SUPPORTED,
                            f"Unsupported HTTP version ({version[:20]!r})")
            return False
        self.command, self.request_version = command, version
        self.path = "/" + path.lstrip("/") if path.startswith("//") else path
        try:
            self.headers = read_headers(self.rfile)  # type: ignore[arg-type,assignment]
        except HeadTooLarge as error:
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Header fields too large", str(error))
            return False
        except MessageError as error:
            self.send_error(HTTPStatus.BAD_REQUEST, "Bad header", str(error))
            return False
        connection = (self.headers.get("Connection") or "").lower()
        self.close_connection = not (self.protocol_version == "HTTP/1.1" and connection != "close"
                                     and (version == "HTTP/1.1" or connection == "keep-alive"))
        if (self.headers.get("Expect") or "").lower() == "100-continue" and version == "HTTP/1.1":
            return self.handle_expect_100()
        return True
