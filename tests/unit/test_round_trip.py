"""A request on a kept-alive connection is answered in one round trip, not after a delayed ACK.

A real ``ControllerServer`` on 127.0.0.1 with the agents' and workers' own client. With the
response's headers and body written as two small segments, Nagle's algorithm held the body
until the client's delayed ACK: 40 ms or more per request on Linux loopback, paid by every
heartbeat, poll, report and check-in of a recovery. The bound below is half of that delay, far
above a real round trip here (about 1 ms); the measured figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from undying.client import ControllerClient
from undying.config import JobSpec
from undying.controller.core import Controller
from undying.controller.server import ControllerServer
from undying.events import EventLog
from undying.protocol import ROUTE_WORKER_HEARTBEAT

TOKEN = "round-trip-token-0123456789abcdef"
# Nagle + delayed ACK costs at least 40 ms on Linux; a round trip without it is about 1 ms.
BOUND_S = 0.020


def test_kept_alive_requests_are_not_held_by_nagle(tmp_path: Path) -> None:
    events = EventLog(tmp_path)
    server = ControllerServer(Controller(JobSpec(), events, "job-rtt", 29555), TOKEN, "127.0.0.1", 0)
    server.start()
    client = ControllerClient(server.address, TOKEN)
    try:
        beat = {"rank": 0, "node": 0, "generation": 1, "step": 1, "phase": "computing", "pid": 1}
        client.post(ROUTE_WORKER_HEARTBEAT, beat)  # opens the connection every later request reuses
        connection = client._conn
        seconds = []
        for _ in range(15):
            started = time.perf_counter()
            client.post(ROUTE_WORKER_HEARTBEAT, beat)
            seconds.append(time.perf_counter() - started)
        assert client._conn is connection, "the connection was not kept alive"
        assert statistics.median(seconds) < BOUND_S, seconds
    finally:
        client.close()
        server.stop()
        events.close()

