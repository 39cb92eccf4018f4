"""Control-plane round trip: one heartbeat POST to a real controller, as agents and workers send them.

Starts a ControllerServer on 127.0.0.1 over an in-process Controller and sends REQUESTS heartbeats
(the fields a worker's heartbeat carries) on a kept-alive connection, as every agent and worker
sends them, and on a fresh connection each. Two wires side by side in one run:

- ``undying``: ``ControllerClient`` (undying/http_wire.py's ``Connection``: the request in one
  segment, the response's header fields read into a dict) to the server as it is (its request
  header fields read the same way);
- ``http.client``: ``http.client.HTTPConnection`` (headers and body sent apart, header fields
  parsed into an ``email`` message) to the same server with ``http.server``'s own request parsing.

Both servers write each response in one segment with TCP_NODELAY. Each row gives the round trip's
wall time (median, p90) and the CPU time of both ends together per request (client and server run
in this one process: ``time.process_time``).

    python bench/round_trip.py --requests 2000 --out bench/results/round_trip.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from undying.client import ControllerClient
from undying.config import JobSpec
from undying.controller.core import Controller
from undying.controller.server import ControllerServer
from undying.events import EventLog
from undying.protocol import (
    PROTOCOL_VERSION,
    ROUTE_WORKER_HEARTBEAT,
    TOKEN_HEADER,
    TOKEN_SCHEME,
    VERSION_HEADER,
    Heartbeat,
    Phase,
)

TOKEN = "bench-round-trip-token-0123456789"
BEAT = Heartbeat(0, 0, 1, 100, Phase.COMPUTING, os.getpid(), {"loss": 3.25}, 0, 1000, 20, 0.041, 0.002,
                 0.001).to_dict()
WIRES = ("undying", "http.client")


class StdlibClient:
    """What the controller's clients sent through before: ``http.client``, kept alive."""

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port = host, int(port)
        self.connection: http.client.HTTPConnection | None = None

    def post(self, path: str, payload: Any) -> Any:
        if self.connection is None:
            self.connection = http.client.HTTPConnection(self.host, self.port, timeout=10.0)
        self.connection.request("POST", path, body=json.dumps(payload).encode(), headers={
            TOKEN_HEADER: f"{TOKEN_SCHEME} {TOKEN}", VERSION_HEADER: str(PROTOCOL_VERSION),
            "Content-Type": "application/json"})
        response = self.connection.getresponse()
        return json.loads(response.read())

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


def measure(wire: str, requests: int, kept_alive: bool, run_dir: Path) -> dict[str, float]:
    events = EventLog(run_dir)
    server = ControllerServer(Controller(JobSpec(), events, "bench-rtt", 29555), TOKEN, "127.0.0.1", 0)
    if wire == "http.client":
        server.httpd.RequestHandlerClass.parse_request = BaseHTTPRequestHandler.parse_request  # type: ignore[method-assign]
    server.start()
    client = ControllerClient(server.address, TOKEN) if wire == "undying" else StdlibClient(server.address)
    post: Callable[[str, Any], Any] = client.post
    seconds = []
    try:
        post(ROUTE_WORKER_HEARTBEAT, BEAT)
        cpu_started = time.process_time()
        for _ in range(requests):
            if not kept_alive:
                client.close()
            started = time.perf_counter()
            reply = post(ROUTE_WORKER_HEARTBEAT, BEAT)
            seconds.append(time.perf_counter() - started)
        cpu = time.process_time() - cpu_started
        assert "abort_generation" in reply, reply
    finally:
        client.close()
        server.stop()
        events.close()
    seconds.sort()
    return {"median_ms": round(statistics.median(seconds) * 1000, 3),
            "p90_ms": round(seconds[int(0.9 * (len(seconds) - 1))] * 1000, 3),
            "cpu_us_per_request": round(cpu / requests * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="rounds, the wires interleaved in each")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.repeats):
            for kept_alive in (True, False):
                for wire in WIRES:
                    run_dir = Path(scratch) / f"{wire}-{kept_alive}-{round_index}"
                    row = {"wire": wire, "connection": "kept alive" if kept_alive else "fresh", "round": round_index,
                           **measure(wire, args.requests, kept_alive, run_dir)}
                    rows.append(row)
                    print(f"round {round_index} {wire:12} {row['connection']:11} median {row['median_ms']:7.3f} ms"
                          f"  p90 {row['p90_ms']:7.3f} ms  CPU {row['cpu_us_per_request']:6.1f} us/request", flush=True)
    summary = {}
    for wire in WIRES:
        for connection in ("kept alive", "fresh"):
            mine = [row for row in rows if row["wire"] == wire and row["connection"] == connection]
            summary[f"{wire}, {connection}"] = {
                key: {"median": statistics.median(row[key] for row in mine), "runs": [row[key] for row in mine]}
                for key in ("median_ms", "p90_ms", "cpu_us_per_request")}
    for name, figures in summary.items():
        print(f"{name:26} " + "  ".join(f"{key} {value['median']}" for key, value in figures.items()))
    if args.out:
        args.out.write_text(json.dumps({"command": "python bench/round_trip.py " + " ".join(
            f"--{key} {value}" for key, value in vars(args).items() if value is not None),
            "requests": args.requests, "rows": rows, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
