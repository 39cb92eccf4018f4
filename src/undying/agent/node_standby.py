"""The node's warm standby, kept by its agent: started when due, again after it died, never where memory is short.

Runs in the agent process, on its main thread (PR_SET_PDEATHSIG follows the thread that started a
child). The standby itself (an interpreter with torch imported that forks the node's workers) is
``standby.py``; its handle in the agent is ``warm_standby.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from undying.agent.procs import available_memory
from undying.agent.standby import can_serve
from undying.agent.warm_standby import WarmStandby

# Host memory the warm standby needs free before it is started (it is about 0.3 GB resident with
# CPU torch; more with a GPU build): a node short of memory starts plain ``python`` workers.
STANDBY_MIN_AVAILABLE = 1 << 30
STANDBY_MEMORY_RECHECK_S = 10.0
STANDBY_RETRY_S = 5.0  # after the standby died: until then, workers start as plain ``python`` processes


class StandbyKeeper:
    """The node's warm standby (``warm_standby`` in the spec), if it has one now."""

    def __init__(self, node: int, enabled: bool, command: list[str], log_dir: Path,
                 ignore_stop_signals: bool) -> None:
        self.node = node  # the agent's node id (a spare's changes when it adopts a node)
        self.command = command
        self.log_dir = log_dir
        self.ignore_stop_signals = ignore_stop_signals  # --sigterm stop: its workers ignore SIGTERM/SIGINT
        self.standby: WarmStandby | None = None
        self.due: float | None = time.monotonic() if enabled else None  # when to start one (None: never)
        self.short_of_memory = False  # said once that memory was too short for one

    def keep(self) -> None:
        """Start the standby when one is due and there is none (or it died)."""
        if self.standby is not None and not self.standby.usable():
            if self.standby.unsafe:
                print(f"undying agent {self.node}: workers start without the warm standby: {self.standby.unsafe}",
                      file=sys.stderr, flush=True)
                self.due = None  # a fork would be no safer next time
            else:
                self.due = time.monotonic() + STANDBY_RETRY_S
            self.standby = None
        if self.standby is None and self.due is not None and time.monotonic() >= self.due \
                and can_serve(self.command) and self._memory_for_standby():
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.standby = WarmStandby(self.log_dir / f"standby{self.node}.log",
                                       ignore_stop_signals=self.ignore_stop_signals)
            self.due = None

    def ready(self) -> WarmStandby | None:
        """The standby to fork a worker from (started first if due), or None: start a plain process."""
        self.keep()
        return self.standby if self.standby is not None and self.standby.usable() else None

    def drop(self) -> None:
        if self.standby is not None:
            self.standby.close()
            self.standby = None

    def _memory_for_standby(self) -> bool:
        """Is there room for the standby? If not, look again in a while."""
        available = available_memory()
        if available is None or available >= STANDBY_MIN_AVAILABLE:
            return True
        if not self.short_of_memory:
            print(f"undying agent {self.node}: no warm standby for now: {available >> 20} MiB of memory "
                  f"available, the standby needs {STANDBY_MIN_AVAILABLE >> 20} MiB",
                  file=sys.stderr, flush=True)
        self.short_of_memory = True
        self.due = time.monotonic() + STANDBY_MEMORY_RECHECK_S
        return False
