"""Run one function as WORLD processes on this machine and collect what each rank returns.

Used by the benchmarks and design studies that run their work in several real processes at once
(bench/step_checks.py, bench/repair_memory.py, and those of bench/studies/ that spawn ranks, most
of them to time collectives between them): each rank gets its index, the arguments and a free
loopback port for its store, and puts ``(rank, result)`` on the queue it is handed (``leave_with``
does that and ends the rank); ``join_gloo``, ``example_gpt``, ``add_gpt_arguments``, ``gpt_batch``
and ``gpt_step`` are what the studies of the example GPT share, ``report_ranks`` how a study keeps
what its ranks returned.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
from collections.abc import Callable
from pathlib import Path
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


def leave_with(queue: Any, rank: int, result: Any) -> None:
    """In a spawned rank: hand ``result`` back and end the process at once, without the interpreter's
    teardown, where gloo's threads can abort it (SIGABRT) after the result is out."""
    import os

    queue.put((rank, result))
    queue.close()
    queue.join_thread()
    os._exit(0)


def report_ranks(args: Any, results: dict[int, Any]) -> dict[str, Any]:
    """What a study writes: its arguments and each rank's result, into ``args.out`` where given."""
    import json

    report = {"arguments": vars(args), "per_rank": {str(rank): results[rank] for rank in sorted(results)}}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def join_gloo(rank: int, world: int, port: int) -> Any:
    """In a spawned rank: one thread of torch, the store on ``port`` (rank 0 serves it) and the
    default gloo group on it (under the prefix ``ddp``); returns the store, for more groups."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("ddp", store), rank=rank, world_size=world)
    return store


def example_gpt(repo: Path, block_size: int, n_layer: int, n_embd: int) -> Callable[[], Any]:
    """A maker of examples/gpt's model (65-token vocabulary, 4 heads), the same weights at each call."""
    import torch

    sys.path.insert(0, str(repo / "examples" / "gpt"))
    from model import GPT, GPTConfig

    config = GPTConfig(vocab_size=65, block_size=block_size, n_layer=n_layer, n_head=4, n_embd=n_embd)

    def make() -> Any:
        torch.manual_seed(0)
        return GPT(config)

    return make


def add_gpt_arguments(parser: Any) -> None:
    """The options of a study that times ``example_gpt`` on ``--world`` ranks (argparse parser)."""
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)


def gpt_batch(args: Any, generator: Any) -> tuple[Any, Any]:
    """One batch of random tokens for ``example_gpt`` (inputs, targets), ``args.batch_size`` x ``args.block_size``."""
    import torch

    shape = (args.batch_size, args.block_size)
    return torch.randint(0, 65, shape, generator=generator), torch.randint(0, 65, shape, generator=generator)


def gpt_step(model: Any, optimizer: Any, x: Any, y: Any, after_sync: Callable[[], None] = lambda: None) -> None:
    """One training step of ``example_gpt`` under stock DDP or undying's ``FixedLayoutDDP``, whose step
    is begun and whose average completed as the runtime does (``after_sync`` then: e.g. a commit vote)."""
    from undying.runtime.ddp import FixedLayoutDDP

    undying = isinstance(model, FixedLayoutDDP)
    if undying:
        model.begin_step()
    _, loss = model(x, y)
    loss.backward()
    if undying:
        model.sync_gradients()
        after_sync()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
