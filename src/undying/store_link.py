"""The authenticated link to the job's store: no process without the job's token reads or writes it.

torch's TCPStore has no authentication: anyone who can connect reads and overwrites every key.
So the store itself listens on the controller's loopback only, and what the network sees is a
gate in front of it (``controller/store.py``): every connection must first prove it holds the
job's token, and the gate proves it holds it too, before a byte reaches the store. Inside the
worker, ``connect`` opens that link (TLS first, when ``undying run --tls-ca`` named a CA), then
hands torch's TCPStore client a loopback socket of this process that is pumped into it; torch
speaks its own protocol end to end, untouched.

Runs in the worker (``connect``, used by ``runtime/pg.connect_store`` for every store connection:
the generation's group, the RNG mirror, the persister, peer copies) and in the controller (the
gate uses ``server_handshake`` and ``pump``).

The handshake (both ends, over TLS when configured): the gate sends ``MAGIC`` and a fresh 32-byte
nonce; the client answers with its own nonce and HMAC-SHA256(token, "client" | both nonces); the
gate checks it in constant time and answers with HMAC-SHA256(token, "server" | both nonces), which
the client checks. A wrong or missing proof closes the connection without a word. The token never
crosses the wire; a recorded handshake is worth nothing (fresh nonces).

Guarantees: without the token, no store key is read or written through the gate; a client never
talks to a gate that does not hold the token. Not guaranteed without TLS: the traffic after the
handshake is plain (an eavesdropper on the path reads it, an active one can take the connection
over); with ``--tls-cert`` on the controller and ``--tls-ca`` on every node it is encrypted and bound
to the controller's certificate.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import select
import socket
import ssl
import threading

from undying.tls import ClientTls, controller_tls_from_environ

MAGIC = b"undying-store/1\n"
NONCE_BYTES = 32
MAC_BYTES = 32
CHUNK = 1 << 16
ACCEPT_TIMEOUT_S = 30.0  # the local TCPStore client connects at once; a link nobody takes is closed
ENV_TOKEN = "UNDYING_TOKEN"  # the job's token, in every worker's environment (worker_env.py)


class StoreRefused(ConnectionError):
    """The other end did not prove it holds the job's token (or closed during the handshake)."""


class HandshakeAbandoned(StoreRefused):
    """The other end closed before sending a byte (a port probe, a client that gave up)."""


def _mac(token: str, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token.encode(), label + server_nonce + client_nonce, hashlib.sha256).digest()


def _read_exactly(sock: socket.socket, count: int, reset_is_close: bool = False) -> bytes:
    """``count`` bytes; with ``reset_is_close`` (the gate's side) a reset counts as a close: a client
    that leaves with the gate's greeting unread resets the connection (a TCP probe does)."""
    data = b""
    while len(data) < count:
        try:
            chunk = sock.recv(count - len(data))
        except ConnectionResetError:
            if not reset_is_close:
                raise
            chunk = b""
        if not chunk:
            raise (HandshakeAbandoned if not data else StoreRefused)("the connection closed during the store handshake")
        data += chunk
    return data


def server_handshake(sock: socket.socket, token: str) -> None:
    """The gate's half; raises StoreRefused when the client's proof is wrong or missing."""
    server_nonce = os.urandom(NONCE_BYTES)
    try:
        sock.sendall(MAGIC + server_nonce)
    except (ConnectionResetError, BrokenPipeError) as error:
        raise HandshakeAbandoned("the connection closed before the store handshake") from error
    answer = _read_exactly(sock, NONCE_BYTES + MAC_BYTES, reset_is_close=True)
    client_nonce, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _mac(token, b"client", server_nonce, client_nonce)):
        raise StoreRefused("wrong token proof")
    sock.sendall(_mac(token, b"server", server_nonce, client_nonce))


def client_handshake(sock: socket.socket, token: str) -> None:
    """The client's half; raises StoreRefused when the gate is not the job's (or refused us)."""
    greeting = _read_exactly(sock, len(MAGIC) + NONCE_BYTES)
    if greeting[:len(MAGIC)] != MAGIC:
        raise StoreRefused("the other end is not an undying store gate")
    server_nonce, client_nonce = greeting[len(MAGIC):], os.urandom(NONCE_BYTES)
    sock.sendall(client_nonce + _mac(token, b"client", server_nonce, client_nonce))
    proof = _read_exactly(sock, MAC_BYTES)
    if not hmac.compare_digest(proof, _mac(token, b"server", server_nonce, client_nonce)):
        raise StoreRefused("the store gate does not hold the job's token")


def pump(left: socket.socket, right: socket.socket) -> None:
    """Copy bytes both ways until either side closes, then close both (on the calling thread; plain
    sockets use a second thread for the other direction: one wake-up per message, no select)."""
    if isinstance(left, ssl.SSLSocket) or isinstance(right, ssl.SSLSocket):
        _pump_selecting(left, right)
        return
    other = threading.Thread(target=_copy, args=(right, left), name="store-link-back", daemon=True)
    other.start()
    _copy(left, right)
    other.join()
    for end in (left, right):
        _close(end)


def _copy(source: socket.socket, target: socket.socket) -> None:
    """One direction of a plain pump, until ``source`` closes or either end fails."""
    try:
        while data := source.recv(CHUNK):
            target.sendall(data)
    except OSError:
        pass
    for end in (source, target):  # torch's store never half-closes: one side gone ends the link
        try:
            end.shutdown(socket.SHUT_RDWR)  # the other direction's thread wakes with the close
        except OSError:
            pass


def _pump_selecting(left: socket.socket, right: socket.socket) -> None:
    """Both directions on one thread, non-blocking: an SSL socket must never be read on one thread
    while it is written on another."""
    ends = (left, right)
    pending: dict[socket.socket, bytearray] = {left: bytearray(), right: bytearray()}  # to be sent to the key
    for end in ends:
        end.setblocking(False)
    other = {left: right, right: left}
    try:
        while True:
            readable = [end for end in ends if len(pending[other[end]]) < CHUNK * 16]
            ready: list[socket.socket] = [end for end in readable if isinstance(end, ssl.SSLSocket) and end.pending()]
            if not ready:
                writable = [end for end in ends if pending[end]]
                ready_read, ready_write, _ = select.select(readable, writable, [])
                for end in ready_write:
                    _send(end, pending[end])
                ready = ready_read
            for end in ready:
                data = _receive(end)
                if data is None:
                    continue
                if not data:
                    _flush(other[end], pending[other[end]])
                    return
                pending[other[end]] += data
                _send(other[end], pending[other[end]])
    except OSError:
        return
    finally:
        for end in ends:
            _close(end)


def _receive(end: socket.socket) -> bytes | None:
    """Bytes read (b"": closed), or None when nothing could be read after all."""
    try:
        return end.recv(CHUNK)
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
        return None


def _send(end: socket.socket, buffer: bytearray) -> None:
    try:
        sent = end.send(buffer)
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
        return
    del buffer[:sent]


def _flush(end: socket.socket, buffer: bytearray) -> None:
    """What is left for ``end`` before it is closed (its peer closed), within a few seconds."""
    end.settimeout(5.0)
    if buffer:
        end.sendall(buffer)


def _close(end: socket.socket) -> None:
    try:
        end.close()
    except OSError:
        pass


class StoreLink:
    """This process's way to the job's store: its token and, with TLS, the CA to verify the gate."""

    def __init__(self, token: str, tls: ClientTls | None) -> None:
        self.token = token
        self.tls = tls

    @classmethod
    def from_environ(cls) -> StoreLink:
        return cls(os.environ.get(ENV_TOKEN, ""), controller_tls_from_environ())

    def open(self, host: str, port: int, timeout: float) -> socket.socket:
        """An authenticated connection to the gate at (host, port)."""
        if not self.token:
            raise StoreRefused(f"no job token in {ENV_TOKEN}: this process cannot join the job's store")
        sock = socket.create_connection((host, port), timeout=timeout)
        # Before the handshakes: their small writes must not wait for the peer's delayed ACK (Nagle).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if self.tls is not None:
                sock = self.tls.context().wrap_socket(sock, server_hostname=host)
            client_handshake(sock, self.token)
        except (OSError, StoreRefused) as error:
            sock.close()
            if isinstance(error, StoreRefused | ssl.SSLError):
                raise StoreRefused(f"the job's store at {host}:{port} refused this process: {error}") from None
            raise
        sock.settimeout(None)
        return sock

    def local_end(self, host: str, port: int, timeout: float) -> tuple[str, int]:
        """Open the link to (host, port) and return a loopback address of this process that leads
        into it: the one connection made to it from this process is pumped to the gate."""
        upstream = self.open(host, port, timeout)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        threading.Thread(target=_serve_one, args=(listener, upstream), name=f"store-link-{host}:{port}",
                         daemon=True).start()
        return "127.0.0.1", listener.getsockname()[1]


def _serve_one(listener: socket.socket, upstream: socket.socket) -> None:
    """Accept the one connection from this process (any other is dropped) and pump it to ``upstream``."""
    listener.settimeout(ACCEPT_TIMEOUT_S)
    try:
        while True:
            try:
                local, _ = listener.accept()
            except OSError:  # nobody came: the client gave up
                _close(upstream)
                return
            if _from_this_process(local):
                break
            _close(local)
    finally:
        _close(listener)
    local.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pump(local, upstream)


def _from_this_process(connection: socket.socket) -> bool:
    """Whether the peer of a loopback ``connection`` is a socket this process holds: another
    user's process on this host could otherwise ride on the link through its loopback port."""
    peer = connection.getpeername()[:2]
    local = connection.getsockname()[:2]
    inode = _socket_inode((peer[0], peer[1]), (local[0], local[1]))
    if inode is None:
        return False
    target = f"socket:[{inode}]"
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == target:
                return True
        except OSError:
            continue
    return False


def _proc_address(text: str) -> tuple[str, int]:
    """``HEX:PORT`` of /proc/net/tcp{,6} as (address, port); an IPv4-mapped IPv6 address as IPv4
    (torch's client dials 127.0.0.1 from an IPv6 socket)."""
    host_hex, port_hex = text.split(":")
    raw = b"".join(bytes.fromhex(host_hex[i:i + 8])[::-1] for i in range(0, len(host_hex), 8))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address), int(port_hex, 16)


def _socket_inode(local: tuple[str, int], remote: tuple[str, int]) -> str | None:
    """The inode of the TCP socket of this network namespace with these (local, remote) ends."""
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows, None)  # the header
                for row in rows:
                    fields = row.split()
                    if len(fields) > 9 and fields[1].endswith(f":{local[1]:04X}") \
                            and _proc_address(fields[1]) == local and _proc_address(fields[2]) == remote:
                        return fields[9]
        except (OSError, ValueError):
            continue
    return None
