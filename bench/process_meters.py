"""What a benchmark process measures of itself: its resident memory and its peak over a section,
the delays another thread's work gives this one's GIL, and a page cache settled between timed
methods. Used by bench/checkpoint.py."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
SETTLE_S = 1.0  # after os.sync(): the disk idle again before the next method is timed


class PeakRss:
    """Samples this process's resident memory (shared-memory pages it maps included) every 2 ms."""

    def __init__(self) -> None:
        self.base = rss_bytes()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def gil_waits(until: Callable[[], bool], at_least: float = 0.0) -> dict[str, float]:
    """How long this thread waits for the GIL while another thread works: sleep 1 ms in a loop and
    record each wake-up's delay beyond the 1 ms (a thread holding the GIL delays it)."""
    delays, started = [], time.perf_counter()
    while not until() or time.perf_counter() - started < at_least:
        before = time.perf_counter()
        time.sleep(0.001)
        delays.append(time.perf_counter() - before - 0.001)
    delays.sort()
    return {"max_s": delays[-1], "p99_s": delays[int(0.99 * (len(delays) - 1))], "samples": len(delays)}


def settle_page_cache() -> None:
    """Before each method: write back what the previous one left dirty (``async_save`` never fsyncs,
    and its files' writeback may still run when they are deleted), so that no method pays for
    another's writeback. Without it the method after a large unsynced write was up to 2x slower."""
    os.sync()
    time.sleep(SETTLE_S)
