"""The node's warm standby: one interpreter with torch and undying imported, which forks the node's workers.

Runs as a child of the node agent (``python -u -m undying.agent.standby``); its handle in the agent
is ``warm_standby.WarmStandby``. A worker started as ``python train.py`` spends seconds
importing torch (and torch._dynamo, which the first optimizer step imports lazily) before it
can join, and on a node of N ranks N interpreters pay that at once. The standby pays it once
per node, at the agent's start; every worker of the node (the first generation, a replacement,
a job restart, a spare's adopted ranks) is then a ``fork`` of it that runs the training script
in the forked process, as ``python script.py`` would: its environment, ``sys.argv``,
``__main__``, its log as stdout and stderr, and the interpreter's own exit (atexit hooks,
non-daemon threads) at the end.

Protocol, one JSON object per line. From the agent on stdin: ``{"id", "env", "command", "log",
"err_log"}`` (``err_log``: stderr's own file, or null: stderr to ``log`` too).
To the agent on stdout: ``"ready"`` once imported; ``{"id", "pid"}`` for each fork;
``{"exit": pid, "code": c}`` when a forked worker ends (``c`` as ``Popen.returncode`` reads:
negative for a signal); ``{"unsafe": why}`` and exit when forking would not be safe (a GPU
driver initialised during the imports, its device files open, cannot be used by a forked child). Stdin closed: the
agent is done; any worker still running is killed, and the standby exits.

The standby is single-threaded (so a fork copies no lock another thread holds), ignores SIGINT
(the agent decides when the node's workers stop), and its children die with it
(PR_SET_PDEATHSIG), as it dies with the agent. A forked worker gets back the SIGINT and SIGTERM
dispositions the standby started with, as a ``python`` the agent started would have them (both
ignored where the agent stops the job on them: ``--sigterm stop``, a Slurm step).
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import sys
from typing import Any

from undying.agent.procs import die_with_parent


def _preload() -> None:
    import torch  # noqa: F401 - the point is to have paid for the import
    import torch.distributed  # noqa: F401

    import undying.runtime.core  # noqa: F401
    from undying._torch_compat.training import import_dynamo

    import_dynamo()  # imported lazily by the first optimizer step otherwise


# Device files a GPU driver opens when it initialises (NVIDIA's, AMD's ROCm): only mapping a driver
# library is harmless to a fork; a driver with its devices open is not.
GPU_DEVICE_FILES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/")


def fork_unsafe_reason(fd_dir: str = "/proc/self/fd") -> str | None:
    """Why a fork of this process could not use the GPU (the driver initialised here), or None."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised while importing"
    try:
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith(GPU_DEVICE_FILES):
                return f"a GPU device was opened while importing ({target})"
    except OSError:
        pass
    return None


def _say(message: Any) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve() -> dict | None:
    """Fork a worker per request. Returns in a forked child (its request), or None in the standby
    once the agent closed stdin."""
    _preload()
    unsafe = fork_unsafe_reason()
    if unsafe is not None:
        _say({"unsafe": unsafe})
        return None
    print("ready", file=sys.stderr, flush=True)  # for whoever reads the standby's log
    _say("ready")
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the select below
    children: set[int] = set()
    pending = b""
    try:
        while True:
            readable, _, _ = select.select([0, wake_read], [], [])
            if wake_read in readable:
                while _drain(wake_read):
                    pass
            _reap(children)
            if 0 not in readable:
                continue
            data = os.read(0, 1 << 16)
            if not data:
                return None
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if not line.strip():
                    continue
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _become_child(wake_read, wake_write)
                    return request
                children.add(pid)
                _say({"id": request["id"], "pid": pid})
    finally:
        if children and os.getpid() == _STANDBY_PID:
            for pid in children:
                _kill(pid)
            try:
                _reap(children, block=True)
            except OSError:
                pass  # the agent stopped reading: nobody to tell


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _reap(children: set[int], block: bool = False) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)  # a stopped process dies of SIGKILL too; this makes it immediate
    except ProcessLookupError:
        pass


def _become_child(wake_read: int, wake_write: int) -> None:
    """In a fresh fork: the signal handling and file descriptors a ``python`` process starts with,
    dying with the standby, and random state of its own."""
    signal.set_wakeup_fd(-1)
    os.close(wake_read)
    os.close(wake_write)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for signum, disposition in _STARTED_WITH.items():
        signal.signal(signum, signal.SIG_DFL if disposition is None else disposition)
    die_with_parent()
    if os.getppid() != _STANDBY_PID:  # the standby died before the line above took effect
        os._exit(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # as a fresh interpreter's numpy would be: seeded from the OS, per process


def become(assignment: dict) -> None:
    """Run ``assignment["command"]`` (``python [-u] script ...`` or ``python [-u] -m module ...``) in
    this process, with its environment and its log as stdout and stderr (its ``err_log`` as stderr
    when given)."""
    os.environ.clear()
    os.environ.update(assignment["env"])
    for fd, log in ((1, assignment["log"]), (2, assignment.get("err_log") or assignment["log"])):
        log_fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log_fd, fd)
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


_STANDBY_PID = os.getpid()
# SIGINT's and SIGTERM's dispositions as this interpreter started (before main() ignores SIGINT):
# Python's KeyboardInterrupt handler and the default, or SIG_IGN where the agent had them ignored.
_STARTED_WITH = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    assignment = serve()
    if assignment is None:
        sys.stdout.flush()
        return 0
    become(assignment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
