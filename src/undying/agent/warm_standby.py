"""The agent's handle on its node's warm standby (``standby.py``), and the workers it forks.

Runs in the node agent. ``WarmStandby`` starts the standby process, reads its replies on a
thread of its own, and asks it for a worker; a ``ForkedWorker`` is such a worker as the agent
sees it, with the part of ``subprocess.Popen`` the agent uses (``pid``, ``poll``, ``wait``,
``send_signal``), its exit code arriving from the standby, which reaps it. When the standby is
gone (killed, out of memory), its workers died with it: each reads SIGKILL, and the agent
starts the next ones as plain ``python`` processes until it has a standby again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from undying.agent.procs import child_setup, stop_processes

READY_TIMEOUT_S = 300.0  # the standby's imports, on a machine as busy as a job's start makes it
FORK_TIMEOUT_S = 30.0  # from a request to the forked worker's pid


class ForkedWorker:
    """A worker forked by the standby: what the agent reads and does to a ``Popen``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # as Popen: never signal a pid that may be another process's now
            os.kill(self.pid, signum)

    def ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._ended.set()


class WarmStandby:
    """One standby process per agent; ``fork`` returns a new worker, or None when it cannot."""

    def __init__(self, log: Path, ignore_stop_signals: bool = False) -> None:
        # With ``ignore_stop_signals`` the standby, and so each worker it forks, ignores SIGTERM and
        # SIGINT (procs.ignore_stop_signals): the agent stops the job on them (--sigterm stop).
        with open(log, "ab") as stderr:
            self.process = subprocess.Popen([sys.executable, "-u", "-m", "undying.agent.standby"], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=stderr,
                                            preexec_fn=child_setup(ignore_stop_signals))
        self.ready = threading.Event()
        self.gone = threading.Event()
        self.unsafe: str | None = None
        self._workers: dict[int, ForkedWorker] = {}
        self._replies: dict[int, int] = {}  # request id -> forked pid
        self._replied = threading.Condition()
        self._next_id = 0
        self._lock = threading.Lock()  # one request at a time
        threading.Thread(target=self._read, name="warm-standby", daemon=True).start()

    def usable(self) -> bool:
        return not self.gone.is_set()

    def fork(self, env: dict[str, str], command: list[str], log: Path,
             err_log: Path | None = None) -> ForkedWorker | None:
        """A worker running ``command`` with ``env``, ``log`` its stdout and stderr (``err_log`` its
        stderr when given), forked from the standby; None if the standby is gone or did not answer
        (then the caller starts the worker itself)."""
        with self._lock:
            if not self._wait_ready():
                return None
            self._next_id += 1
            request_id = self._next_id
            request = {"id": request_id, "env": env, "command": command, "log": str(log),
                       "err_log": str(err_log) if err_log is not None else None}
            assert self.process.stdin is not None
            try:
                self.process.stdin.write((json.dumps(request) + "\n").encode())
                self.process.stdin.flush()
            except OSError:
                self.close()
                return None
            with self._replied:
                self._replied.wait_for(lambda: request_id in self._replies or self.gone.is_set(), FORK_TIMEOUT_S)
                pid = self._replies.pop(request_id, None)
            if pid is None:
                self.close()
                return None
            return self._workers[pid]

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.ready.wait(0.1):
            if self.gone.is_set():
                return False
            if time.monotonic() > deadline:
                self.close()
                return False
        return not self.gone.is_set()

    def _read(self) -> None:
        assert self.process.stdout is not None
        try:
            for raw in self.process.stdout:
                message = json.loads(raw)
                if message == "ready":
                    self.ready.set()
                elif "pid" in message:
                    with self._replied:
                        self._workers[message["pid"]] = ForkedWorker(message["pid"])
                        self._replies[message["id"]] = message["pid"]
                        self._replied.notify_all()
                elif "exit" in message:
                    worker = self._workers.pop(message["exit"], None)
                    if worker is not None:
                        worker.ended(message["code"])
                elif "unsafe" in message:
                    self.unsafe = message["unsafe"]
        finally:
            self._end()

    def _end(self) -> None:
        """The standby is gone, and its workers with it (PR_SET_PDEATHSIG): each reads SIGKILL. They are
        not signalled from here: once the standby is gone nobody reaps them for us, and a pid may be
        another process's by now."""
        with self._replied:
            self.gone.set()
            self._replied.notify_all()
            workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            worker.ended(-signal.SIGKILL)

    def close(self) -> None:
        """Stop the standby; its workers die with it."""
        stop_processes([self.process], grace=0.0)
        self.gone.set()
