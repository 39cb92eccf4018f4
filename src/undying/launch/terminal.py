"""The ``undying run`` console while a job runs: every line printed whole, in order, above one live
progress line when stderr is a terminal, and never in the job's way.

Runs in the ``undying run`` process. One thread writes to the real stdout and stderr; everything
else hands it lines: the job's event lines and messages (anything printed to ``sys.stdout`` or
``sys.stderr`` while the job runs, taken line by line), and the workers' lines relayed by the
agents (``agent/output_relay.py``). On a terminal (stderr a tty, ``TERM`` not ``dumb``) the writer keeps
one progress line at the bottom (``progress.py``), cleared before other lines are written and
drawn again after them, at most every ``REDRAW_EVERY`` seconds otherwise; elsewhere (a file, a
pipe, a pod's log) lines are written plain, with no redraw and no escape sequences.

A slow or stopped terminal never blocks the job: the queue is bounded; worker lines beyond
``WORKER_BACKLOG`` bytes are dropped and counted (one line says how many; the rank logs hold them
all), other lines beyond ``LINE_BACKLOG``.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

from undying.agent.console_streams import STDERR, STDOUT

REDRAW_EVERY = 0.5  # seconds between two redraws of an unchanged progress line's clock
WORKER_BACKLOG = 1 << 20  # bytes of worker lines waiting for the terminal; more are dropped
LINE_BACKLOG = 16 << 20  # bytes of other lines (events, messages) waiting; more are dropped
CLOSE_WAIT = 5.0  # seconds ``close`` waits for the backlog to be written
CLEAR_LINE = "\r\x1b[K"


def is_live_terminal(stream: TextIO) -> bool:
    """Can a line be redrawn in place on ``stream``?"""
    try:
        return stream.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):
        return False


class Terminal:
    """The console of one ``undying run``; ``lines`` and ``line`` never block.

    Guarantees: each line is written whole and lines keep the order they were handed over in; a
    line handed over before ``close`` is written unless the terminal is too slow (dropped, counted)
    or the backlog is still unwritten ``CLOSE_WAIT`` seconds into ``close``."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None, live: bool | None = None,
                 capture_prints: bool = True) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.live = is_live_terminal(self.err) if live is None else live
        self.progress: Callable[[], str | None] | None = None  # the live line's text, when there is one
        self._capture_prints = capture_prints
        self._queue: deque[tuple[int, str, bool]] = deque()  # (stream, text, a worker's)
        self._queued = {True: 0, False: 0}  # bytes waiting, of worker lines and of the others
        self._dropped = 0
        self._closing = False
        self._broken = False
        self._wake = threading.Condition()
        self._drawn = ""  # the progress text on screen now ("" none)
        self._saved: tuple[TextIO, TextIO] | None = None
        self._thread = threading.Thread(target=self._write_forever, name="console", daemon=True)

    def __enter__(self) -> Terminal:
        self._thread.start()
        if self._capture_prints:
            self._saved = (sys.stdout, sys.stderr)
            sys.stdout = _LineStream(self, STDOUT, sys.stdout)
            sys.stderr = _LineStream(self, STDERR, sys.stderr)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def lines(self, batch: list[tuple[int, str]]) -> None:
        """Worker lines (console stream, text): dropped and counted when the terminal lags."""
        self._enqueue(batch, worker=True)

    def line(self, stream: int, text: str) -> None:
        """A line of the job's own (an event, a message)."""
        self._enqueue([(stream, text)], worker=False)

    def close(self) -> None:
        """Write what is queued (up to CLOSE_WAIT seconds), clear the progress line, give the
        process its stdout and stderr back."""
        if self._saved is not None:
            for stream in (sys.stdout, sys.stderr):
                if isinstance(stream, _LineStream):
                    stream.flush_partial()
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=CLOSE_WAIT)
        if self._saved is not None:
            sys.stdout, sys.stderr = self._saved
            self._saved = None

    def _enqueue(self, batch: list[tuple[int, str]], worker: bool) -> None:
        if not batch:
            return
        limit = WORKER_BACKLOG if worker else LINE_BACKLOG
        with self._wake:
            for stream, text in batch:
                if self._queued[worker] + len(text) > limit or self._broken:
                    self._dropped += 1
                    continue
                self._queued[worker] += len(text)
                self._queue.append((stream, text, worker))
            self._wake.notify()

    def _write_forever(self) -> None:
        while True:
            with self._wake:
                if not self._queue and not self._closing:
                    self._wake.wait(REDRAW_EVERY if self.live else None)
                items = list(self._queue)
                self._queue.clear()
                self._queued = {True: 0, False: 0}
                dropped, self._dropped = self._dropped, 0
                closing = self._closing
            try:
                self._write(items, dropped, closing)
            except (OSError, ValueError):
                with self._wake:
                    self._broken = True  # the terminal is gone: nothing more can be shown
            if closing:
                return

    def _write(self, items: list[tuple[int, str, bool]], dropped: int, closing: bool) -> None:
        if self._broken:
            return
        progress = self._progress_text() if self.live and not closing else ""
        if self._drawn and (items or dropped or closing):
            self.err.write(CLEAR_LINE)
            self.err.flush()
            self._drawn = ""
        current = self.err
        for stream, text, _ in items:
            target = self.out if stream == STDOUT else self.err
            if target is not current:
                current.flush()  # the two streams may share a terminal: keep the order
            current = target
            target.write(text + "\n")
        if dropped:
            current.flush()
            current = self.err
            self.err.write(f"[undying] {dropped} lines not shown: the console could not keep up "
                           "(every worker line is in the rank logs)\n")
        current.flush()
        if progress and progress != self._drawn:
            self.err.write(CLEAR_LINE + progress)
            self.err.flush()
            self._drawn = progress

    def _progress_text(self) -> str:
        if self.progress is None:
            return ""
        text = self.progress() or ""
        try:
            width = os.get_terminal_size(self.err.fileno()).columns
        except (OSError, ValueError, io.UnsupportedOperation):
            width = 80
        return text[:max(1, width - 1)]  # a wrapped line could not be redrawn in place


class _LineStream(io.TextIOBase):
    """Stands for ``sys.stdout``/``sys.stderr`` while a job runs: each line written to it goes to the
    terminal's queue whole (a thread's unfinished line waits for its newline)."""

    def __init__(self, terminal: Terminal, stream: int, real: TextIO) -> None:
        super().__init__()
        self._terminal = terminal
        self._stream = stream
        self._real = real
        self._partial: dict[int, str] = {}  # thread id -> its unfinished line
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        thread = threading.get_ident()
        with self._lock:
            pieces = (self._partial.pop(thread, "") + text).split("\n")
            if pieces[-1]:
                self._partial[thread] = pieces[-1]
        for piece in pieces[:-1]:
            self._terminal.line(self._stream, piece)
        return len(text)

    def flush_partial(self) -> None:
        with self._lock:
            partial, self._partial = list(self._partial.values()), {}
        for piece in partial:
            self._terminal.line(self._stream, piece)

    def flush(self) -> None:
        pass  # a line goes out when it is whole

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._real.isatty()

    def fileno(self) -> int:
        return self._real.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._real.encoding

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)
