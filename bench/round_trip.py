"""Control-plane round trip: one heartbeat POST to a real controller, as agents and workers send them.

Starts a ControllerServer on 127.0.0.1 over an in-process Controller and times REQUESTS
heartbeats through ``ControllerClient`` on a kept-alive connection (as every agent and worker
sends them) and on a fresh connection each, for the server as it is and for the server with its
response written unbuffered and Nagle on (how it was: headers and body as two segments), side by
side in one run.

    python bench/round_trip.py --requests 200 --out bench/results/round_trip.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from undying.client import ControllerClient
from undying.config import JobSpec
from undying.controller.core import Controller
from undying.controller.server import ControllerServer
from undying.events import EventLog
from undying.protocol import ROUTE_WORKER_HEARTBEAT

TOKEN = "bench-round-trip-token-0123456789"
BEAT = {"rank": 0, "node": 0, "generation": 1, "step": 1, "phase": "computing", "pid": 1}


def measure(requests: int, two_segments: bool, kept_alive: bool, run_dir: Path) -> dict[str, float]:
    events = EventLog(run_dir)
    server = ControllerServer(Controller(JobSpec(), events, "bench-rtt", 29555), TOKEN, "127.0.0.1", 0)
    if two_segments:
        handler = server.httpd.RequestHandlerClass
        handler.wbufsize = 0  # type: ignore[attr-defined]
        handler.disable_nagle_algorithm = False  # type: ignore[attr-defined]
    server.start()
    client = ControllerClient(server.address, TOKEN)
    seconds = []
    try:
        client.post(ROUTE_WORKER_HEARTBEAT, BEAT)
        for _ in range(requests):
            if not kept_alive:
                client.close()
            started = time.perf_counter()
            client.post(ROUTE_WORKER_HEARTBEAT, BEAT)
            seconds.append(time.perf_counter() - started)
    finally:
        client.close()
        server.stop()
        events.close()
    seconds.sort()
    return {"median_ms": round(statistics.median(seconds) * 1000, 3),
            "p90_ms": round(seconds[int(0.9 * (len(seconds) - 1))] * 1000, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for two_segments in (True, False):
            for kept_alive in (True, False):
                result = measure(args.requests, two_segments, kept_alive, Path(scratch) / f"{two_segments}{kept_alive}")
                row = {"server": "headers and body apart, Nagle on (before)" if two_segments
                       else "one write, TCP_NODELAY (now)",
                       "connection": "kept alive" if kept_alive else "fresh", **result}
                rows.append(row)
                print(f"{row['server']:45} {row['connection']:11} median {row['median_ms']:7.3f} ms"
                      f"  p90 {row['p90_ms']:7.3f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"requests": args.requests, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
