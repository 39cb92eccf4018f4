"""A warm standby worker: an interpreter with torch and undying already imported, waiting to be a rank.

Runs as a child of the node agent (``python -m undying.standby``). A cold replacement
spends seconds importing torch (and torch._dynamo, which the first optimizer step
imports lazily) before it can join; a standby has paid that already. When a rank on
this node must be replaced, the agent writes one JSON line to the standby's stdin
(the worker's environment, its command and its log file) and the standby becomes
that rank by running the training script in this same process.

The agent starts its standbys together with the workers, so that a fault in the first steps
already finds one. Their imports then run on a thread of low CPU priority (``PRELOAD_NICE``;
Linux sets the nice value per thread): on a machine whose cores the workers fill, a standby
takes little from their start. The rank itself runs on the main thread, at normal priority; an
assignment that arrives during the import waits for it, after raising that thread's priority
back where the system allows it.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading

PRELOAD_NICE = 10  # nice value of the importing thread (0 is normal, 19 the lowest priority)


def _preload() -> None:
    import torch  # noqa: F401 - the point is to have paid for the import
    import torch._dynamo  # noqa: F401 - imported lazily by the first optimizer step otherwise
    import torch.distributed  # noqa: F401

    import undying.runtime.core  # noqa: F401


def _set_thread_nice(thread_id: int, value: int) -> bool:
    try:
        os.setpriority(os.PRIO_PROCESS, thread_id, value)
        return True
    except (OSError, AttributeError):
        return False  # not Linux, or lowering the nice value needs a privilege this process lacks


class Preload:
    """The imports, on a thread of low CPU priority."""

    def __init__(self) -> None:
        self.thread_id: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="undying-preload", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        self.thread_id = threading.get_native_id()
        _set_thread_nice(self.thread_id, PRELOAD_NICE)
        try:
            _preload()
        except BaseException as error:  # re-raised on the main thread, which owns the process
            self.error = error
            return
        print("ready", flush=True)

    def finish(self) -> None:
        """Wait for the imports, and give the rank normal priority: the importing thread and the
        threads it started (torch starts one of its own) get the main thread's nice value back,
        where the system allows lowering it (root, CAP_SYS_NICE, RLIMIT_NICE); elsewhere they stay
        low, and the training itself, on the main thread and the threads it starts, is unaffected."""
        normal = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        if self.thread.is_alive() and self.thread_id is not None:
            _set_thread_nice(self.thread_id, normal)
        self.thread.join()
        for task in _threads_of_this_process():
            if task != threading.get_native_id():
                _set_thread_nice(task, normal)
        if self.error is not None:
            raise self.error


def _threads_of_this_process() -> list[int]:
    try:
        return [int(task) for task in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _become(assignment: dict) -> None:
    os.environ.clear()
    os.environ.update(assignment["env"])
    log_fd = os.open(assignment["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
    arguments = list(assignment["command"][1:])  # drop the interpreter
    while arguments and arguments[0] == "-u":
        arguments.pop(0)
    if arguments[:1] == ["-m"]:
        sys.argv = [arguments[1], *arguments[2:]]
        runpy.run_module(arguments[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = arguments
        sys.path.insert(0, os.path.dirname(os.path.abspath(arguments[0])))
        runpy.run_path(arguments[0], run_name="__main__")


def can_serve(command: list[str]) -> bool:
    """A standby can run ``python [-u] script ...`` or ``python [-u] -m module ...`` commands."""
    return len(command) >= 2 and command[0] == sys.executable and any(
        part.endswith(".py") or part == "-m" for part in command[1:3])


def main() -> int:
    preload = Preload()
    preload.start()
    line = sys.stdin.readline()
    if not line.strip():
        # The agent closed our stdin: no rank for us. Not a normal exit, which could find the
        # importing thread half way and tear the interpreter down under it.
        sys.stdout.flush()
        os._exit(0)
    preload.finish()
    _become(json.loads(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
