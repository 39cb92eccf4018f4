"""A warm standby worker: an interpreter with torch and undying already imported, waiting to be a rank.

Runs as a child of the node agent (``python -m undying.standby``). A cold replacement
spends seconds importing torch (and torch._dynamo, which the first optimizer step
imports lazily) before it can join; a standby has paid that already. When a rank on
this node must be replaced, the agent writes one JSON line to the standby's stdin
(the worker's environment, its command and its log file) and the standby becomes
that rank by running the training script in this same process.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def _preload() -> None:
    import torch  # noqa: F401 - the point is to have paid for the import
    import torch._dynamo  # noqa: F401 - imported lazily by the first optimizer step otherwise
    import torch.distributed  # noqa: F401

    import undying.runtime.core  # noqa: F401


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
    _preload()
    print("ready", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the agent closed our stdin: no rank for us
    _become(json.loads(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
