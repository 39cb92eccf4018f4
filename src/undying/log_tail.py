"""The end of a worker's log, read when the worker ended badly: what the console and the report show.

Runs in the agent (a worker that exited with a non-zero code or a signal: its last lines and its
exception travel with the exit report) and in the worker (the traceback of an exception that a
``with step:`` guard kept from ending the process).
"""

from __future__ import annotations

import traceback
from pathlib import Path

from undying.faults import exception_line

TAIL_LINES = 12  # lines of a failed worker's output shown with its fault
TAIL_LINE_CHARS = 1000  # ... each cut to this many characters
# Read this much of the end of a log to find the last traceback's start (torch's can be long).
TAIL_WINDOW_BYTES = 64 * 1024


def read_tail(path: Path, lines: int = TAIL_LINES) -> tuple[list[str], str]:
    """The last ``lines`` lines of the file at ``path`` and the exception line of the last traceback
    in its final ``TAIL_WINDOW_BYTES`` ("" if none); ([], "") if it cannot be read."""
    try:
        with open(path, "rb") as log:
            log.seek(0, 2)
            size = log.tell()
            log.seek(max(0, size - TAIL_WINDOW_BYTES))
            window = log.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return [], ""
    if size > TAIL_WINDOW_BYTES and window:
        window = window[1:]  # the first line of the window may be cut
    return clip(window[-lines:]), exception_line(window)


def clip(lines: list[str]) -> list[str]:
    return [line.rstrip()[:TAIL_LINE_CHARS] for line in lines]


def exception_tail(error: BaseException, lines: int = TAIL_LINES) -> tuple[list[str], str]:
    """An exception's traceback as its last ``lines`` lines, and its exception line."""
    text = "".join(traceback.format_exception(error)).splitlines()
    return clip(text[-lines:]), exception_line(text)
