"""How a worker process ends: without a teardown that would hang or crash on a dropped group.

Runs in the worker, installed once by ``undying.init()`` (runtime/core.py). A group abandoned
after a fault may still be torn down by a reaper thread (runtime/reapers.py) stuck on a dead peer,
and an uncaught exception would otherwise wait for the interpreter's final garbage collection over
torch's objects: both delay (or crash) the exit the agent and controller are waiting to see. A
recovery that undying's own repair refuses (``ShardLost``: nothing holds a lost shard) ends the
process with its own exit status, ``protocol.WORKER_EXIT_REPAIR_REFUSED``, so the controller knows
the chain tried a strategy that cannot help, not that the script failed. A script that ran its
``ft.steps(n)`` loop to the end and exits without calling ``ft.finish()`` is finished at exit.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from undying.protocol import WORKER_EXIT_REPAIR_REFUSED
from undying.runtime.reapers import reapers_alive
from undying.runtime.sharded import ShardLost

_uncaught: list[BaseException] = []  # the exception that is ending this process, if one is


def install_exit_hooks(finished: Callable[[], bool], finish_at_exit: Callable[[], None] | None = None) -> None:
    """Register the exit hooks of this process; ``finished``: has the script called ``finish()``?
    ``finish_at_exit``: what ends training for a script that ran its steps to the end and exits
    without calling ``finish()`` (most scripts from torchrun end with their loop): called at exit
    unless an uncaught exception is ending the process. Registered last, so it runs first."""
    atexit.register(_exit_without_teardown_if_reaping, finished)
    if finish_at_exit is not None:
        atexit.register(_finish_unless_raised, finished, finish_at_exit)
    sys.excepthook = _excepthook_then_freeze(sys.excepthook)


def _finish_unless_raised(finished: Callable[[], bool], finish_at_exit: Callable[[], None]) -> None:
    if not finished() and not _uncaught:
        finish_at_exit()


def _exit_without_teardown_if_reaping(finished: Callable[[], bool]) -> None:
    """atexit: a group abandoned after a fault may still be joining threads stuck on a dead peer;
    tearing the interpreter down under it crashes the process (seen: SIGSEGV after a recovered
    hang). Only after ``finish()``: training is over and its result written, so leave at once with
    exit code 0; a script that failed keeps the normal teardown and its non-zero exit."""
    if finished() and reapers_alive():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _excepthook_then_freeze(previous: Any) -> Any:
    """An uncaught exception ends the worker: print it as usual, then spare the interpreter's final
    garbage collection over torch's objects (seconds on these machines), so the agent sees the
    exit, and the controller the real cause, at once."""

    def hook(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        _uncaught.append(value)
        previous(kind, value, traceback)
        sys.stderr.flush()
        gc.freeze()

    return hook


@contextmanager
def repair_refusal_exits() -> Iterator[None]:
    """Around a recovery: a ``ShardLost`` raised by the repair ends the process with the exit status
    ``WORKER_EXIT_REPAIR_REFUSED``, which its agent reports and the controller reads as a refusal
    (``Fault.repair_refused``). Its traceback is printed first, as an uncaught exception's would be:
    the agent reads the exception's line from the log for the fault's description. SystemExit, not
    ``os._exit``: the script's ``finally`` blocks and the atexit hooks run as after any exception,
    and no ``except Exception`` of the script takes a refusal for its own error."""
    try:
        yield
    except ShardLost as refusal:
        traceback.print_exception(refusal)
        sys.stdout.flush()
        sys.stderr.flush()
        if reapers_alive():
            # A teardown under a reaper stuck on the dropped group may crash the process, and its
            # status would then no longer say refusal (see _exit_without_teardown_if_reaping).
            os._exit(WORKER_EXIT_REPAIR_REFUSED)
        gc.freeze()  # as the excepthook does: no final garbage collection over torch's objects
        raise SystemExit(WORKER_EXIT_REPAIR_REFUSED) from refusal
