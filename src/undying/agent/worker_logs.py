"""A rank's log files, as the node agent opens them for each process of the rank it starts.

Runs in the node agent. ``RUN_DIR/logs/rankN.log`` (or ``--log-dir``) is the process's stdout and
stderr, appended to by every process the rank has in the job, each after a ``--- generation G
---`` line; where the console shows only one of the rank's streams, stderr has a file of its own,
``rankN.stderr.log`` (``output_relay.worker_log_paths``). The files are the complete record,
written by the worker itself; the agent's relay (``output_relay.py``) follows them from where the
new process starts writing, after the relay has passed on the rest of the previous process's.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from undying.agent.console_streams import BOTH
from undying.agent.output_relay import OutputRelay, worker_log_paths


class WorkerLogs:
    """The open log files of one process of a rank, until it has started (``started``)."""

    def __init__(self, log_dir: Path, rank: int, local_rank: int, relay: OutputRelay | None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.local_rank = local_rank
        self.relay = relay
        console = relay.console_of(local_rank) if relay is not None else BOTH
        self.stdout_path, self.stderr_path = worker_log_paths(log_dir, rank, console)
        if relay is not None:
            relay.release(rank)  # the previous process's last lines first: it has ended
        self.stdout: BinaryIO = open(self.stdout_path, "ab")  # noqa: SIM115 - handed to the child
        self.stderr: BinaryIO | None = open(self.stderr_path, "ab") if self.stderr_path else None  # noqa: SIM115

    def note(self, text: str) -> None:
        """A line of the agent's own in each file (which generation, how the process started)."""
        for handle in (self.stdout, self.stderr):
            if handle is not None:
                handle.write(f"--- {text} ---\n".encode())
                handle.flush()

    def started(self) -> None:
        """The process has its files: the relay follows them from here; the agent's copies close."""
        if self.relay is not None:
            self.relay.follow(self.rank, self.local_rank, (self.stdout_path, self.stdout.tell()),
                              None if self.stderr is None or self.stderr_path is None
                              else (self.stderr_path, self.stderr.tell()))
        self.stdout.close()
        if self.stderr is not None:
            self.stderr.close()
