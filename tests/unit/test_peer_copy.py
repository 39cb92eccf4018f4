"""Peer copies of T1 (runtime/peer_copy.py, checkpoint/peer_slots.py), between two ranks of this process
over loopback TCP: a committed snapshot reaches its holder's node memory whole and checked; a copy
whose bytes or secret do not check is never visible; the anchor moves only when every rank's vote
confirms the same step, and ranks that disagree on the step all start again; a recovery forgets
copies of a history given up, even ones still arriving."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import time
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from undying.checkpoint.peer_slots import PeerSlots
from undying.checkpoint.snapshot import RankSnapshots
from undying.runtime.bounded_store import BoundedStore
from undying.runtime.peer_copy import NO_COPY, CopyReport, PeerCopy, holder_of, origin_of

LOOPBACK = ("127.0.0.1", 1)  # the "store" the server's address is chosen towards


def state(value: float) -> dict:
    return {"replica": {"weight": torch.full((1000,), value)}, "rank": {"rng": torch.arange(8, dtype=torch.uint8)}}


def make_pair(tmp_path: Path, tokens: tuple[str, str] = ("secret", "secret")) -> tuple[list[PeerCopy], list[RankSnapshots]]:
    """Ranks 0 and 1 on two nodes of one rank each: each is the other's holder."""
    store = dist.HashStore()
    snapshots = [RankSnapshots(tmp_path / f"node{rank}", rank, slots=3) for rank in range(2)]
    copies = [PeerCopy(rank=rank, world_size=2, ranks_per_node=1, directory=tmp_path / f"node{rank}" / "peer",
                       token=tokens[rank], snapshots=snapshots[rank], store=BoundedStore(lambda: store, 5.0),
                       publish=store.set, key_prefix="job/", store_address=LOOPBACK, timeout=5.0)
              for rank in range(2)]
    return copies, snapshots


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_holder_of_a_rank_is_the_same_local_rank_on_the_next_node() -> None:
    assert [holder_of(rank, 8, 4) for rank in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert all(origin_of(holder_of(rank, 12, 4), 12, 4) == rank for rank in range(12))


def test_a_confirmed_copy_becomes_the_anchor_when_every_rank_confirms_the_same_step(tmp_path: Path) -> None:
    copies, snapshots = make_pair(tmp_path)
    try:
        for rank in range(2):
            snapshots[rank].write(state(float(rank)), step=5, generation=1, world_size=1)
            copies[rank].after_snapshot(5)
        wait_until(lambda: all(copy.vote_report() == CopyReport(5, True) for copy in copies))
        # Rank 1 holds rank 0's copy, bit for bit, and the other way round.
        seen: list[torch.Tensor] = []
        copies[1].copies.read(0, 5, lambda copy: seen.append(copy["replica"]["weight"].clone()))
        assert torch.equal(seen[0], torch.zeros(1000))
        # A vote in which one rank has not confirmed yet moves no anchor and keeps the copy.
        report = copies[0].vote_report()
        copies[0].on_vote(report, votes(CopyReport(5, True), CopyReport(5, False)), world_size=2)
        assert copies[0].anchor_step() is None and copies[0].vote_report() == CopyReport(5, True)
        copies[0].on_vote(report, votes(CopyReport(5, True), CopyReport(5, True)), world_size=2)
        assert copies[0].anchor_step() == 5 and copies[0].vote_report() == NO_COPY
        assert [sent.step for sent in copies[0].anchored] == [5]
        # The anchor stays pinned: newer snapshots never overwrite it (three slots: anchor, copy, newest).
        for step in (6, 7, 8):
            assert snapshots[0].write(state(float(step)), step=step, generation=1, world_size=1) is not None
        assert 5 in [info.step for info in snapshots[0].committed()]
    finally:
        for copy in copies:
            copy.close()


def votes(*reports: CopyReport) -> list[float]:
    """The commit vote's sums of these ranks' reports."""
    return [sum(values) for values in zip(*(report.values() for report in reports), strict=True)]


def test_ranks_that_are_not_copying_the_same_step_all_give_their_copy_up_and_start_again(tmp_path: Path) -> None:
    """Rank 0's copy of step 5 is confirmed while rank 1's failed (its holder was being replaced) or
    is of another step: no anchor can ever come of that, so every rank gives its copy up at the vote,
    and the next snapshot is every rank's copy again; once all confirm it, it is the anchor."""
    copies, snapshots = make_pair(tmp_path)
    try:
        snapshots[0].write(state(0.0), step=5, generation=1, world_size=1)
        copies[0].after_snapshot(5)
        wait_until(lambda: copies[0].vote_report() == CopyReport(5, True))
        for other in (NO_COPY, CopyReport(6, True), CopyReport(4, False)):
            report = copies[0].vote_report()
            if report == NO_COPY:
                snapshots[0].write(state(0.0), step=5, generation=1, world_size=1)
                copies[0].after_snapshot(5)
                wait_until(lambda: copies[0].vote_report() == CopyReport(5, True))
                report = copies[0].vote_report()
            copies[0].on_vote(report, votes(report, other), world_size=2)
            assert copies[0].vote_report() == NO_COPY and copies[0].anchor_step() is None, other
            assert sum(snapshots[0]._pins) == 0  # the dropped copy's snapshot is free again
        snapshots[0].write(state(0.0), step=6, generation=1, world_size=1)
        copies[0].after_snapshot(6)
        wait_until(lambda: copies[0].vote_report() == CopyReport(6, True))
        copies[0].on_vote(copies[0].vote_report(), votes(CopyReport(6, True), CopyReport(6, True)), world_size=2)
        assert copies[0].anchor_step() == 6
    finally:
        for copy in copies:
            copy.close()


def test_a_recovery_makes_the_sender_ask_the_store_for_its_holders_address(tmp_path: Path) -> None:
    """The holder (rank 1) is replaced by a new process listening on another port; after the
    recovery (``reset``) rank 0's next copy goes there at once, not to the old address."""
    copies, snapshots = make_pair(tmp_path)
    replacement = None
    try:
        snapshots[0].write(state(0.0), step=5, generation=1, world_size=1)
        copies[0].after_snapshot(5)
        wait_until(lambda: copies[0].vote_report() == CopyReport(5, True))
        store = copies[1]._store
        copies[1].close()
        replacement = PeerCopy(rank=1, world_size=2, ranks_per_node=1, directory=tmp_path / "spare" / "peer",
                               token="secret", snapshots=RankSnapshots(tmp_path / "spare", 1, slots=3), store=store,
                               publish=store.set,
                               key_prefix="job/", store_address=LOOPBACK, timeout=5.0)
        copies[0].reset(5, generation=2)
        snapshots[0].write(state(1.0), step=6, generation=2, world_size=1)
        copies[0].after_snapshot(6)
        wait_until(lambda: copies[0].vote_report() != CopyReport(6, False))
        assert copies[0].vote_report() == CopyReport(6, True), copies[0].failures()
        assert replacement.copy_steps(1) == [6]
    finally:
        for copy in [*copies, *([replacement] if replacement else [])]:
            copy.close()


def test_a_copy_under_another_secret_is_refused_and_never_visible(tmp_path: Path) -> None:
    copies, snapshots = make_pair(tmp_path, tokens=("secret", "another"))
    try:
        snapshots[0].write(state(1.0), step=3, generation=1, world_size=1)
        copies[0].after_snapshot(3)
        wait_until(lambda: bool(copies[1]._failures) or bool(copies[0]._failures))
        wait_until(lambda: bool(copies[0]._failures))
        # Refused after the header: the answer, or the reset of a connection whose rest was never read.
        failure = copies[0].failures()[0]
        assert any(sign in failure for sign in ("refused", "Broken pipe", "reset")), failure
        assert copies[1].copy_steps(1) == [] and copies[0].vote_report() == NO_COPY
        # The failed copy is released: the next snapshot is the next candidate.
        snapshots[0].write(state(2.0), step=4, generation=1, world_size=1)
        copies[0].after_snapshot(4)
        assert copies[0]._candidate is not None and copies[0]._candidate[0] == 4
    finally:
        for copy in copies:
            copy.close()


def test_a_torn_transfer_leaves_the_previous_copy_and_the_newest_is_never_overwritten(tmp_path: Path) -> None:
    slots = PeerSlots(tmp_path)

    def receive(step: int, value: float, checked: bool = True):
        data = torch.full((16,), value).numpy().tobytes()

        def fill(region: memoryview) -> bool:
            region[:] = data
            return checked

        return slots.receive(3, seq=step, step=step, generation=1, world_size=1, data_bytes=len(data),
                             meta=b"m", fill=fill)

    assert receive(10, 1.0) is not None and receive(11, 2.0) is not None
    assert receive(12, 3.0, checked=False) is None  # written over the older copy (10): the newest stands
    assert [info.step for info in slots.committed(3)] == [11]
    assert receive(12, 3.0) is not None
    assert [info.step for info in slots.committed(3)] == [12, 11]


def test_a_recovery_forgets_copies_of_a_given_up_history_even_those_still_arriving(tmp_path: Path) -> None:
    """Generation 2 continues from step 11: copies of later steps taken in generation 1 go, and one
    that arrives afterwards is refused; the node's next process (a reopened directory) sees the same."""
    slots = PeerSlots(tmp_path)

    def receive(step: int, generation: int):
        return slots.receive(0, seq=step, step=step, generation=generation, world_size=1, data_bytes=64,
                             meta=b"m", fill=lambda region: True)

    receive(11, 1)
    receive(12, 1)
    slots.drop_after(11, generation=2)
    assert [info.step for info in slots.committed(0)] == [11]
    assert receive(13, 1) is None  # a copy of generation 1 still on its way
    assert receive(13, 2) is not None  # generation 2's own step 13
    assert [info.step for info in slots.committed(0)] == [13, 11]
    slots.close()
    assert [info.step for info in PeerSlots(tmp_path).committed(0)] == [13, 11]


@pytest.mark.parametrize("corrupt", ["data", "secret"])
def test_bytes_changed_on_the_way_are_refused(tmp_path: Path, corrupt: str) -> None:
    """A sender speaking the protocol by hand: data whose CRC-32 does not match (its MAC right), or a MAC
    under another secret, is answered NO and leaves no copy; the same transfer done right is taken."""
    copies, _ = make_pair(tmp_path)
    holder = copies[1]
    address = holder._published.rsplit(":", 1)
    data, meta = bytes(range(256)) * 4, b"meta"
    header = json.dumps({"origin": 0, "seq": 1, "step": 3, "generation": 1, "world_size": 1,
                         "data_bytes": len(data), "meta_bytes": len(meta)}).encode()

    def send(crc: int, secret: bytes) -> bytes:
        trailer = struct.pack("!I", crc)
        header_mac = hmac.new(secret, header, hashlib.sha256).digest()
        mac = hmac.new(secret, header + meta + trailer, hashlib.sha256).digest()
        with socket.create_connection((address[0], int(address[1])), timeout=5) as connection:
            try:
                connection.sendall(struct.pack("!I", len(header)) + header + header_mac + meta + data + trailer + mac)
                return connection.recv(2)
            except ConnectionResetError:  # refused after the header, the rest unread: the kernel resets
                return b"NO"

    try:
        right = zlib.crc32(data)
        wrong = (right + 1, b"secret") if corrupt == "data" else (right, b"another")
        assert send(*wrong) == b"NO"
        assert holder.copy_steps(1) == []
        assert send(right, b"secret") == b"OK"
        assert holder.copy_steps(1) == [3]
    finally:
        for copy in copies:
            copy.close()


def test_a_recovery_keeps_an_anchor_it_continues_after_and_releases_the_copy_under_way(tmp_path: Path) -> None:
    """The anchor (step 5) stays pinned through a recovery that continues from step 6; the candidate
    (step 6) is released and its late confirmation ignored. A recovery back to step 4 releases the
    anchor too: step 5 belongs to the history given up."""
    copies, snapshots = make_pair(tmp_path)
    try:
        for rank in range(2):
            snapshots[rank].write(state(float(rank)), step=5, generation=1, world_size=1)
            copies[rank].after_snapshot(5)
        wait_until(lambda: copies[0].vote_report() == CopyReport(5, True))
        copies[0].on_vote(CopyReport(5, True), votes(CopyReport(5, True), CopyReport(5, True)), world_size=2)
        snapshots[0].write(state(6.0), step=6, generation=1, world_size=1)
        copies[0].after_snapshot(6)
        copies[0].reset(6, generation=2)
        assert copies[0].anchor_step() == 5 and copies[0].vote_report() == NO_COPY
        # The copy of step 6 that was under way ends (its pin goes; the anchor's stays) and its answer
        # is ignored.
        wait_until(lambda: sum(snapshots[0]._pins) == 1)
        assert copies[0].vote_report() == NO_COPY
        copies[0].reset(4, generation=3)
        assert copies[0].anchor_step() is None and snapshots[0]._pins == [0, 0, 0]
    finally:
        for copy in copies:
            copy.close()
