"""Process helpers shared by the launcher and the agent: die-with-parent, signal names, stopping, memory.

Linux's PR_SET_PDEATHSIG makes a child die when the process that started it dies,
so a SIGKILLed launcher or agent never leaves orphans training on.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Protocol

PR_SET_PDEATHSIG = 1


class WorkerProcess(Protocol):
    """What the agent reads and does to a worker: a ``subprocess.Popen``, or a worker forked by the
    node's warm standby (``warm_standby.ForkedWorker``)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, signum: int) -> None: ...


def die_with_parent() -> None:
    """preexec_fn for Popen: SIGKILL this child when its parent dies (Linux only; no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return


def ignore_stop_signals() -> None:
    """Ignore SIGTERM and SIGINT, a disposition a child keeps through fork and exec (a Python program
    starts with them ignored unless it installs a handler): for the workers of a node whose agent
    stops the job on these signals (``--sigterm stop``), which Slurm sends every process of a step."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def child_setup(ignore_stop: bool) -> Callable[[], None]:
    """preexec_fn for an agent's child: dies with its parent, and with ``ignore_stop`` ignores
    SIGTERM and SIGINT (``ignore_stop_signals``)."""
    if not ignore_stop:
        return die_with_parent

    def setup() -> None:
        ignore_stop_signals()
        die_with_parent()

    return setup


def ignores_sigterm(pid: int) -> bool:
    """Does process ``pid`` ignore SIGTERM (its SigIgn mask in /proc; False when unreadable)?"""
    try:
        with open(f"/proc/{pid}/status") as lines:
            for line in lines:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def signal_name(returncode: int | None) -> str | None:
    """Popen's negative return code -> 'SIGKILL' etc.; None for a normal exit."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def stop_processes(processes: Sequence[WorkerProcess], grace: float) -> None:
    """SIGTERM (when grace > 0), wait up to ``grace`` s, then SIGKILL whatever is left, and reap all.
    A process that ignores SIGTERM (``ignore_stop_signals``, no handler of its own) is not waited for."""
    alive = [p for p in processes if p.poll() is None]
    if grace > 0:
        waited = [p for p in alive if not ignores_sigterm(p.pid)]
        for process in waited:
            _send(process, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in waited):
            time.sleep(0.02)
    for process in alive:
        if process.poll() is None:
            _send(process, signal.SIGKILL)
            # A SIGSTOPped process dies of SIGKILL too, but SIGCONT makes that immediate.
            _send(process, signal.SIGCONT)
    for process in alive:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (a simulated node: an agent and its workers)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _send(process: WorkerProcess, signum: int) -> None:
    try:
        process.send_signal(signum)
    except ProcessLookupError:
        pass


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of memory the kernel says new processes can use without swapping (None: not Linux)."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
