"""Ranks as threads of the test process, each with its own gloo ``GenerationGroup`` over one
HashStore: for tests of collectives (gradient averaging, state transfer) without processes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from undying.runtime.pg import GenerationGroup

JOIN_S = 60


def run_ranks(world_size: int, body: Callable[[GenerationGroup], Any], prefix: str = "test",
              options: Callable[[int], dict[str, Any]] = lambda _rank: {}) -> list[Any]:
    """``body(group)`` on ``world_size`` threads, one gloo group each (``options(rank)``: more keyword
    arguments of its ``GenerationGroup``); their results in rank order. A rank's exception is raised
    here; a rank still running after JOIN_S fails the test."""
    store = torch.distributed.HashStore()
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def rank(index: int) -> None:
        try:
            group = GenerationGroup(store, prefix, 1, index, world_size, "gloo", 20.0, torch.device("cpu"),
                                    **options(index))
            results[index] = body(group)
        except BaseException as error:  # noqa: BLE001 - re-raised in the test thread
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results
