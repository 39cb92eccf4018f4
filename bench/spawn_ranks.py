"""Run one function as WORLD processes on this machine and collect what each rank returns.

Used by the benchmarks that time collectives between real processes (bench/step_checks.py,
bench/repair_memory.py, bench/studies/commit_vote.py, bench/studies/gradient_sync.py): each rank gets
its index, the arguments and a free loopback port for its store, and puts ``(rank, result)`` on the
queue it is handed.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Callable
from typing import Any

RESULT_TIMEOUT_S = 1200


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(world: int, target: Callable[..., None], *args: Any) -> dict[int, Any]:
    """``target(rank, *args, port, queue)`` in ``world`` spawned processes; rank -> its result."""
    port = free_port()
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=target, args=(rank, *args, port, queue)) for rank in range(world)]
    for process in processes:
        process.start()
    results = dict(queue.get(timeout=RESULT_TIMEOUT_S) for _ in processes)
    for process in processes:
        process.join()
    return results
