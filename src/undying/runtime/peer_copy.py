"""Peer copies of T1: each rank's snapshot also kept in the memory of another node, so that a pure-FSDP
job (no replica of any shard) that loses a node recovers its shards from memory, not from storage.

Runs in the worker, on three threads. The training thread hands a committed snapshot to the
sender (``after_snapshot``), reports in each commit vote which step it is copying and whether the
holder has confirmed it (``vote_report``) and learns from the vote's sums whether every rank's copy
is complete (``on_vote``); the sender thread streams the snapshot's bytes to its holder; the server thread
receives the copy of the rank whose holder this rank is, into its node's shared memory
(checkpoint/peer_slots.py). The holder of rank r is the rank with the same local rank on the next
node, ``(r + ranks per node) mod world size``; it publishes its address in the job's store.

Guarantees:

- Every rank keeps its own T1 snapshot of the *anchor* step pinned, and the holder of every rank
  keeps a complete copy of that rank's snapshot of the anchor step: the anchor moves to a newer
  step only at a commit vote in which every rank reports its copy of that step confirmed (the
  vote's sums of the step and its square say all reported the same step). A recovery therefore
  always finds one step that every rank either holds itself or has a copy of on another node.
- Copies start again after any failure: a vote in which the ranks are not all copying the same
  step (a copy failed, a snapshot was skipped) makes every rank give its copy up, so all of them
  copy the next snapshot, the same step; a recovery makes the sender read its holder's address
  from the store again (a replacement or a spare listens on a new one).
- A copy travels with an HMAC of its header, then the CRC-32 of its data and an HMAC of header,
  meta block and CRC, under the job's secret; the holder takes node memory for it only once the
  header's HMAC checks, commits it only if the rest checks (a torn or foreign transfer is never
  visible), and answers the sender only then.

Not guaranteed: that the anchor is recent (the copies run behind training: the job goes back to
the anchor, runtime/t1_repair.py); a copy when two neighbouring nodes are lost together.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from undying.checkpoint.crc import crc32
from undying.checkpoint.peer_slots import PeerSlots
from undying.checkpoint.snapshot import RankSnapshots
from undying.runtime.bounded_store import BoundedStore
from undying.runtime.gloo_interface import local_address_towards

STORE_KEY = "peer_copy/{rank}"  # under the job's store prefix: "host:port" of the rank's server
CONNECT_TIMEOUT_S = 5.0
CLOSE_WAIT_S = 1.0
ACCEPT_POLL_S = 0.5
CHUNK_BYTES = 4 << 20
MAX_HEADER_BYTES = 1 << 16
MAX_META_BYTES = 256 << 20
_LENGTH = struct.Struct("!I")
_CRC = struct.Struct("!I")
_MAC_BYTES = hashlib.sha256().digest_size
OK, REFUSED = b"OK", b"NO"


def holder_of(rank: int, world_size: int, ranks_per_node: int) -> int:
    """The rank whose node keeps ``rank``'s copy: the same local rank on the next node."""
    return (rank + ranks_per_node) % world_size


def origin_of(holder: int, world_size: int, ranks_per_node: int) -> int:
    """The rank whose copy ``holder`` keeps."""
    return (holder - ranks_per_node) % world_size


@dataclass(frozen=True)
class CopyReport:
    """What one rank says of its copy in a commit vote: the step of the snapshot it is copying (None:
    none) and whether its holder confirmed that copy."""

    step: int | None
    confirmed: bool = False

    def values(self) -> tuple[float, float, float, float]:
        """As the vote sums it: (copying, confirmed, step, step squared)."""
        if self.step is None:
            return 0.0, 0.0, 0.0, 0.0
        return 1.0, float(self.confirmed), float(self.step), float(self.step) * self.step


NO_COPY = CopyReport(None)


@dataclass(frozen=True)
class CopySent:
    """One confirmed copy, for the event the training thread emits."""

    step: int
    nbytes: int
    seconds: float


class PeerCopy:
    """This rank's side of the peer copies: sender of its own snapshots, holder of its origin's."""

    def __init__(self, *, rank: int, world_size: int, ranks_per_node: int, directory: Path, token: str,
                 snapshots: RankSnapshots, store: BoundedStore, publish: Callable[[str, str], None],
                 key_prefix: str, store_address: tuple[str, int], timeout: float) -> None:
        self.rank = rank
        self.holder = holder_of(rank, world_size, ranks_per_node)
        self.origin = origin_of(rank, world_size, ranks_per_node)
        self.copies = PeerSlots(directory)
        self._token = token.encode()
        self._snapshots = snapshots
        self._store = store  # the sender thread's own connection (never the training thread's)
        self._key_prefix = key_prefix
        self._timeout = timeout
        self._lock = threading.Lock()
        self._anchor: tuple[int, int] | None = None  # (step, slot) of the own snapshot every copy covers
        self._candidate: tuple[int, int] | None = None  # (step, slot) being copied to the holder
        self._confirmed: CopySent | None = None  # the holder's answer for the candidate
        self._epoch = 0  # a recovery starts a new one: answers of an older one are ignored
        self._failures: list[str] = []  # failed copies, for the training thread to report
        self.anchored: list[CopySent] = []  # copies that became the anchor, for the training thread to report
        self._address: tuple[str, int] | None = None  # the holder's server, as last read from the store
        self._jobs: queue.Queue[tuple[int, int, int] | None] = queue.Queue()
        self._closing = threading.Event()
        address = local_address_towards(*store_address)
        self._server = socket.create_server((address, 0), family=socket.AF_INET6 if ":" in address else socket.AF_INET)
        self._server.settimeout(ACCEPT_POLL_S)
        host, port = self._server.getsockname()[:2]
        self._published = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        publish(key_prefix + STORE_KEY.format(rank=rank), self._published)
        self._threads = [threading.Thread(target=self._serve, name="undying-peer-copy-server", daemon=True),
                         threading.Thread(target=self._send_jobs, name="undying-peer-copy-sender", daemon=True)]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------- training thread

    def after_snapshot(self, step: int) -> None:
        """A snapshot of ``step`` was committed: copy it to the holder unless a copy is under way."""
        with self._lock:
            if self._candidate is not None:
                return
            try:
                slot = self._snapshots.pin(step)  # the candidate's pin: kept while it is the anchor
                self._snapshots.pin(step)  # the sender's pin: released when its transfer ends
            except KeyError:
                return
            self._candidate, self._confirmed = (step, slot), None
            self._jobs.put((self._epoch, step, slot))

    def vote_report(self) -> CopyReport:
        """The step this rank is copying to its holder, and whether the holder confirmed it."""
        with self._lock:
            if self._candidate is None:
                return NO_COPY
            return CopyReport(self._candidate[0], self._confirmed is not None)

    def on_vote(self, report: CopyReport, sums: list[float], world_size: int) -> None:
        """The vote's sums of every rank's ``report`` (``CopyReport.values``). Every rank copying the
        same step and every copy confirmed: that step becomes the anchor and the previous anchor is
        released. The ranks not all copying the same step (a copy failed, a snapshot was skipped):
        every rank gives its copy up, so that all copy the next snapshot, the same step, again.
        Otherwise (the copies still under way) nothing changes. The same on every rank."""
        copying, confirmed, step_sum, square_sum = sums
        step = report.step
        same = (step is not None and copying == world_size and step_sum == world_size * step
                and square_sum == world_size * step * step)
        if same and confirmed == world_size:
            with self._lock:
                previous, self._anchor, self._candidate = self._anchor, self._candidate, None
                sent, self._confirmed = self._confirmed, None
            if previous is not None:
                self._snapshots.unpin(previous[1])
            if sent is not None:
                self.anchored.append(sent)
        elif not same:
            with self._lock:  # an answer still on its way no longer matches the candidate: ignored
                dropped, self._candidate, self._confirmed = self._candidate, None, None
            if dropped is not None:
                self._snapshots.unpin(dropped[1])

    def failures(self) -> list[str]:
        with self._lock:
            failed, self._failures = self._failures, []
        return failed

    def copy_steps(self, world_size: int) -> list[int]:
        """The steps of the complete copies this rank's node holds of its origin's snapshots (taken at
        ``world_size`` replicas), newest first."""
        return [info.step for info in self.copies.committed(self.origin) if info.world_size == world_size]

    def anchor_step(self) -> int | None:
        with self._lock:
            return None if self._anchor is None else self._anchor[0]

    def reset(self, continued_step: int, generation: int) -> None:
        """Generation ``generation`` continues from ``continued_step`` (a recovery, a restore): ignore
        the answer of any transfer under way, release the candidate, and the anchor if it is a later
        step; forget the copies of later steps taken before (a history given up), and refuse them."""
        with self._lock:
            self._epoch += 1
            pinned = [self._candidate] if self._candidate is not None else []
            if self._anchor is not None and self._anchor[0] > continued_step:
                pinned.append(self._anchor)
                self._anchor = None
            self._candidate = self._confirmed = None
            self._address = None  # the holder may be a new process (a replacement, a spare's): ask the store
        for _, slot in pinned:
            self._snapshots.unpin(slot)
        self.copies.drop_after(continued_step, generation)

    def use_store(self, store: BoundedStore, publish: Callable[[str, str], None]) -> None:
        """The job's store moved (controller failover): publish this rank's address there, read the
        holder's from there."""
        publish(self._key_prefix + STORE_KEY.format(rank=self.rank), self._published)
        self._store, self._address = store, None

    def close(self) -> None:
        self._closing.set()
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the server thread's accept at once (Linux)
        except OSError:
            pass
        self._server.close()
        self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=CLOSE_WAIT_S)  # daemons: one stuck on a dead peer does not hold up the exit
        self.copies.close()

    # ------------------------------------------------------------- sender thread

    def _send_jobs(self) -> None:
        while (job := self._jobs.get()) is not None:
            epoch, step, slot = job
            started = time.monotonic()
            try:
                nbytes = self._send(slot)
                error = None
            except (OSError, ValueError, KeyError, RuntimeError) as failure:
                nbytes, error = 0, f"copy of step {step} to rank {self.holder}: {failure}"
                self._address = None  # read the holder's address again next time (it may have moved)
            finally:
                self._snapshots.unpin(slot)
            with self._lock:
                current = epoch == self._epoch and self._candidate is not None and self._candidate[0] == step
                if error is not None:
                    self._failures.append(error)
                    if current:  # the next snapshot is the next candidate
                        assert self._candidate is not None
                        self._snapshots.unpin(self._candidate[1])
                        self._candidate = None
                elif current:
                    self._confirmed = CopySent(step, nbytes, time.monotonic() - started)

    def _holder_address(self) -> tuple[str, int]:
        if self._address is None:
            text = self._store.get(self._key_prefix + STORE_KEY.format(rank=self.holder)).decode()
            host, port = text.rsplit(":", 1)
            self._address = (host.strip("[]"), int(port))
        return self._address

    def _send(self, slot: int) -> int:
        """Stream the pinned ``slot`` to the holder; its byte count once the holder confirmed it."""
        info, data, meta = self._snapshots.raw_slot(slot)
        with data, socket.create_connection(self._holder_address(), timeout=CONNECT_TIMEOUT_S) as connection:
            connection.settimeout(self._timeout)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            header = json.dumps({"origin": self.rank, "seq": info.seq, "step": info.step,
                                 "generation": info.generation, "world_size": info.world_size,
                                 "data_bytes": len(data), "meta_bytes": len(meta)}).encode()
            # The header's own MAC first: the holder allocates node memory for a copy only once it knows
            # the copy comes from this job.
            connection.sendall(_LENGTH.pack(len(header)) + header + self._mac(header, b"", b""))
            connection.sendall(meta)
            crc = 0
            for offset in range(0, len(data), CHUNK_BYTES):
                with data[offset:offset + CHUNK_BYTES] as chunk:
                    connection.sendall(chunk)
                    crc = crc32(chunk, crc)
            trailer = _CRC.pack(crc)
            connection.sendall(trailer + self._mac(header, meta, trailer))
            answer = _receive_exactly(connection, len(OK))
            if answer != OK:
                raise RuntimeError(f"rank {self.holder} refused the copy ({answer!r})")
            return len(data) + len(meta)

    def _mac(self, header: bytes, meta: bytes, trailer: bytes) -> bytes:
        return hmac.new(self._token, header + meta + trailer, hashlib.sha256).digest()

    # ------------------------------------------------------------- server thread

    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                connection, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with connection:
                try:
                    self._receive(connection)
                except (OSError, ValueError, KeyError) as failure:
                    with self._lock:
                        self._failures.append(f"copy from rank {self.origin} not received: {failure}")

    def _receive(self, connection: socket.socket) -> None:
        connection.settimeout(self._timeout)
        (length,) = _LENGTH.unpack(_receive_exactly(connection, _LENGTH.size))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"a header of {length} bytes")
        header_bytes = _receive_exactly(connection, length)
        header_mac = _receive_exactly(connection, _MAC_BYTES)
        if not hmac.compare_digest(header_mac, self._mac(header_bytes, b"", b"")):
            connection.sendall(REFUSED)  # not this job's (another secret), or a damaged header
            return
        header: dict[str, Any] = json.loads(header_bytes)
        if header["origin"] != self.origin or not 0 <= header["meta_bytes"] <= MAX_META_BYTES:
            connection.sendall(REFUSED)
            return
        meta = _receive_exactly(connection, header["meta_bytes"])

        def fill(region: memoryview) -> bool:
            crc, filled = 0, 0
            while filled < len(region):
                with region[filled:filled + CHUNK_BYTES] as part:
                    count = connection.recv_into(part)
                    if count == 0:
                        raise ConnectionError("the sender closed the connection mid-copy")
                    with part[:count] as received:
                        crc = crc32(received, crc)
                filled += count
            trailer = _receive_exactly(connection, _CRC.size + _MAC_BYTES)
            crc_bytes, mac = trailer[:_CRC.size], trailer[_CRC.size:]
            return crc_bytes == _CRC.pack(crc) and hmac.compare_digest(mac, self._mac(header_bytes, meta, crc_bytes))

        info = self.copies.receive(self.origin, seq=header["seq"], step=header["step"],
                                   generation=header["generation"], world_size=header["world_size"],
                                   data_bytes=header["data_bytes"], meta=meta, fill=fill)
        connection.sendall(OK if info is not None else REFUSED)


def _receive_exactly(connection: socket.socket, count: int) -> bytes:
    parts, left = [], count
    while left:
        part = connection.recv(min(left, CHUNK_BYTES))
        if not part:
            raise ConnectionError(f"the connection closed {left} bytes early")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
