"""The store gate's cost: a generation's rendezvous and one store round trip, plain TCPStore against
the token-checked gate (controller/store.py + store_link.py) and the gate over TLS.

Each recovery gives every worker a fresh store connection and builds its gloo group through it
(runtime/membership.py ``build_group``). Here W spawned processes do exactly that, ``ROUNDS`` times
per mode: connect (``plain``: torch's own client to a TCPStore; ``gate``/``gate+tls``: undying's
``connect_store``, the link's handshake, then torch's client through it) and build a
``ProcessGroupGloo`` on a fresh prefix, every process starting together (a count in the store).
The figure is the slowest process's seconds per rendezvous. Rank 0 then times ``OPS`` set+get
round trips on its connection (the RNG mirror's write each step is one set). The modes alternate
``--repeats`` times, so a change in the machine's load falls on all of them.

    python bench/store_gate.py --worlds 2 4 8 --repeats 3 --out bench/results/store_gate.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.tls_files: the certificates

MODES = ("plain", "gate", "gate+tls")
ROUNDS = 5
OPS = 500
TOKEN = "bench-token-0123456789abcdef0123"
TIMEOUT = datetime.timedelta(seconds=60)


def connect(mode: str, port: int) -> dist.Store:
    if mode == "plain":
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    from undying.runtime.pg import connect_store

    return connect_store("127.0.0.1", port, TIMEOUT.total_seconds())


def process_main(rank: int, world: int, port: int, prefix: str, mode: str, environ: dict[str, str],
                 results: Any) -> None:
    os.environ.update(environ)
    control = connect(mode, port)
    kept = []  # every group lives to the end: one dropped while a peer still connects to it fails that peer
    for build in range(ROUNDS + 1):
        key = f"{prefix}/{build}"
        control.add(f"{key}/arrived", 1)
        while control.add(f"{key}/arrived", 0) < world:
            time.sleep(0.001)
        if build == ROUNDS:
            break  # the last count: every process is done building
        started = time.perf_counter()
        store = connect(mode, port)
        kept.append((store, dist.ProcessGroupGloo(dist.PrefixStore(key, store), rank, world, TIMEOUT)))
        results.put(("build", build, time.perf_counter() - started))
    if rank == 0:
        started = time.perf_counter()
        for op in range(OPS):
            control.set(f"{prefix}/op", str(op))
            control.get(f"{prefix}/op")
        results.put(("op", 0, (time.perf_counter() - started) / OPS))


def measure(world: int, mode: str, prefix: str, port: int, environ: dict[str, str]) -> dict[str, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=process_main, args=(rank, world, port, prefix, mode, environ, results))
                 for rank in range(world)]
    for process in processes:
        process.start()
    slowest = [0.0] * ROUNDS
    round_trip = 0.0
    for _ in range(world * ROUNDS + 1):
        kind, build, seconds = results.get(timeout=300)
        if kind == "op":
            round_trip = seconds
        else:
            slowest[build] = max(slowest[build], seconds)
    for process in processes:
        process.join(timeout=60)
    return {"rendezvous_s": [round(seconds, 4) for seconds in slowest], "set_get_us": round(round_trip * 1e6, 1)}


def main() -> None:
    from tests.tls_files import make_tls_files
    from undying.controller.store import JobStore
    from undying.store_link import ENV_TOKEN
    from undying.tls import ENV_TLS_CA, ServerTls

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    files = make_tls_files(Path(tempfile.mkdtemp(prefix="undying-bench-tls-")))
    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    gate = JobStore("127.0.0.1", TOKEN)
    gate_tls = JobStore("127.0.0.1", TOKEN, tls=ServerTls(str(files.cert), str(files.key)).context())
    assert gate.wait_ready(60) and gate_tls.wait_ready(60)
    ports = {"plain": plain.port, "gate": gate.port, "gate+tls": gate_tls.port}
    environs = {"plain": {}, "gate": {ENV_TOKEN: TOKEN, ENV_TLS_CA: ""},
                "gate+tls": {ENV_TOKEN: TOKEN, ENV_TLS_CA: str(files.ca)}}
    runs = []
    for world in args.worlds:
        for repeat in range(args.repeats):
            for mode in MODES:
                result = measure(world, mode, f"w{world}/r{repeat}/{mode}", ports[mode], environs[mode])
                runs.append({"world": world, "mode": mode, "repeat": repeat, **result})
                print(json.dumps(runs[-1]), flush=True)
    print("| world | store | rendezvous (connect + gloo group), slowest process, median s | set + get round trip, median µs |")
    print("| --- | --- | --- | --- |")
    for world in args.worlds:
        for mode in MODES:
            mine = [run for run in runs if (run["world"], run["mode"]) == (world, mode)]
            builds = [seconds for run in mine for seconds in run["rendezvous_s"]]
            trips = [run["set_get_us"] for run in mine]
            print(f"| {world} | {mode} | {statistics.median(builds):.4f} | {statistics.median(trips):.0f} |")
    if args.out:
        args.out.write_text(json.dumps({"command": "python bench/store_gate.py " + " ".join(sys.argv[1:]),
                                        "rounds": ROUNDS, "ops": OPS, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
