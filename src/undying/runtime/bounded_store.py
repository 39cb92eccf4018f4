"""A c10d store client whose every call returns within a bound, even when the store's host froze.

Runs in the worker (the RNG mirror, the persister). A TCPStore server whose process is
stopped (SIGSTOP, a hung machine) still accepts connections in the kernel and never
answers, and a client's socket calls to it do not honour the store's own timeout. Here
each call runs on a helper daemon thread and is waited for at most ``timeout`` seconds;
a call that does not return in time raises ``StoreTimeout``, its thread is left to it
(a daemon: it never holds up the process's exit) and the next call connects afresh.
The connection itself is opened on the helper thread too, on first use.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from undying.runtime.pg import connect_store


class StoreTimeout(RuntimeError):
    """The store did not answer within the bound (its host is down or frozen)."""


class BoundedStore:
    """set/get/check/delete_key/add of a lazily connected store, each bounded by ``timeout``."""

    def __init__(self, connect: Callable[[], dist.Store], timeout: float, name: str = "store") -> None:
        self._connect = connect
        self.timeout = timeout
        self.name = name
        self._store: dist.Store | None = None
        self._caller = _Caller(name)

    def _call(self, operation: Callable[[dist.Store], Any]) -> Any:
        def run() -> Any:
            if self._store is None:
                self._store = self._connect()
            return operation(self._store)

        finished, value = self._caller.call(run, self.timeout)
        if not finished:
            self._caller = _Caller(self.name)
            self._store = None
            raise StoreTimeout(f"{self.name} did not answer within {self.timeout:g} s")
        if isinstance(value, BaseException):
            raise value
        return value

    def run(self, operation: Callable[[dist.Store], Any]) -> Any:
        """Several calls in one trip to the client's thread, bounded together by ``timeout``."""
        return self._call(operation)

    def set(self, key: str, value: bytes | str) -> None:
        self._call(lambda store: store.set(key, value))  # type: ignore[arg-type]  # the binding takes bytes; the stub says str

    def get(self, key: str) -> bytes:
        return self._call(lambda store: store.get(key))

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda store: store.check(keys))

    def delete_key(self, key: str) -> bool:
        return self._call(lambda store: store.delete_key(key))

    def add(self, key: str, amount: int) -> int:
        return self._call(lambda store: store.add(key, amount))


def connect_bounded(host: str, port: int, timeout: float, name: str) -> BoundedStore:
    """A bounded client of the TCPStore at (host, port), connected on its first call."""
    return BoundedStore(lambda: connect_store(host, port, timeout), timeout, name=name)


class _Caller:
    """Runs calls one at a time on a daemon thread."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=f"bounded-{name}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, box, done = self._jobs.get()
            try:
                box.append(call())
            except Exception as error:  # noqa: BLE001 - handed to the caller, which raises it
                box.append(error)
            done.set()

    def call(self, call: Callable[[], Any], timeout: float) -> tuple[bool, Any]:
        box: list[Any] = []
        done = threading.Event()
        self._jobs.put((call, box, done))
        if not done.wait(timeout):
            return False, None
        return True, box[0]
