"""Hosts the c10d TCPStore that every process-group generation rendezvous through, behind a gate.

Runs in the controller (and in every controller candidate of a failover job, whose store is
started before it leads). torch's TCPStore has no authentication, so it listens on this host's
loopback only (a socket we bind and hand it: it would otherwise listen on every interface), and
the address the job is told (``port``) is a gate on the controller's bind address: each connection
proves it holds the job's token (``store_link.server_handshake``; over TLS when the controller has
a certificate) before its bytes are pumped to the store. A connection that does not is closed and
reported (``on_refused``); one that leaves before sending anything (a port probe) only closed. Processes on this host's own network namespace can still reach the
loopback store directly: in Kubernetes that is the controller's pod alone (docs/security.md).
"""

from __future__ import annotations

import socket
import ssl
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from undying.store_link import HandshakeAbandoned, StoreRefused, pump, server_handshake
from undying.tls import HANDSHAKE_TIMEOUT_S

LOOPBACK = "127.0.0.1"


def _listening(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(1024)
    return listener


class JobStore:
    """A TCPStore on loopback and its gate on ``bind_host``; lives as long as the controller.

    Both sockets are bound and listening when the constructor returns, so ``port`` (the gate's)
    is known and clients may connect at once (the kernel queues them); the TCPStore that answers
    them is built on a helper thread, since importing torch takes a second or two that the agents
    and workers, starting meanwhile, need not wait for."""

    def __init__(self, bind_host: str, token: str, port: int = 0, timeout: float = 300.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.token = token
        self.tls = tls
        # Told about each connection the gate closed: (client address, why). The controller logs it.
        self.on_refused: Callable[[str, str], object] = lambda client, why: None
        self._store_socket = _listening(LOOPBACK, 0)
        self.store_port: int = self._store_socket.getsockname()[1]  # on loopback: the gate's side
        self._gate = _listening(bind_host, port)
        self.port: int = self._gate.getsockname()[1]
        self.store: Any = None  # the TCPStore, once built
        self.error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._serve, args=(timeout,), daemon=True, name="undying-job-store")
        self._thread.start()
        threading.Thread(target=self._accept, daemon=True, name="undying-store-gate").start()

    def _serve(self, timeout: float) -> None:
        try:
            import torch.distributed as dist  # heavy import; only the controller process pays it

            self.store = dist.TCPStore(
                LOOPBACK,
                self.store_port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout),
                master_listen_fd=self._store_socket.fileno(),
            )
        except Exception as error:  # noqa: BLE001 - the workers' store connections then time out, said here
            self.error = error
            print(f"undying: the job's store on {LOOPBACK}:{self.store_port} could not start: {error}",
                  file=sys.stderr)

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, address = self._gate.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._admit, args=(connection, address[0]), daemon=True,
                             name="undying-store-link").start()

    def _admit(self, connection: socket.socket, client: str) -> None:
        """One connection: TLS (if configured), the token handshake, then pumped to the store."""
        connection.settimeout(HANDSHAKE_TIMEOUT_S)
        # Before the handshakes: their small writes must not wait for the peer's delayed ACK (Nagle).
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if self.tls is not None:
                try:
                    connection = self.tls.wrap_socket(connection, server_side=True)
                except ConnectionResetError as error:  # reset before a ClientHello: a probe too
                    raise HandshakeAbandoned("the connection closed before the TLS handshake") from error
            server_handshake(connection, self.token)
        except (OSError, StoreRefused) as error:
            connection.close()
            if not isinstance(error, HandshakeAbandoned | ssl.SSLEOFError):
                self.on_refused(client, _why(error))  # not a port probe that connected and left at once
            return
        try:
            store = socket.create_connection((LOOPBACK, self.store_port), timeout=HANDSHAKE_TIMEOUT_S)
        except OSError:
            connection.close()  # the store is gone (the controller is ending): the client sees it closed
            return
        connection.settimeout(None)
        store.settimeout(None)
        store.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pump(connection, store)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Until the TCPStore serves (or failed to start); True once it serves."""
        self._thread.join(timeout)
        return self.store is not None

    def close(self) -> None:
        """Stop admitting connections (the store itself lives until the process ends)."""
        self._closed = True
        self._gate.close()


def _why(error: BaseException) -> str:
    if isinstance(error, StoreRefused):
        return str(error)
    if isinstance(error, ssl.SSLError):
        return f"TLS handshake failed: {error.reason or error}"
    if isinstance(error, TimeoutError | socket.timeout):
        return "no handshake within the time allowed"
    return f"connection failed: {error}"
