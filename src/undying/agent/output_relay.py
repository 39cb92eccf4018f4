"""Worker output on the console: the agent follows each worker's log file and relays its new lines,
prefixed ``[rank N]``, to the ``undying run`` console.

Runs in the node agent. A worker writes its stdout and stderr to its log file itself (the file is
its stdout and stderr), so the log is complete whatever happens to the agent, and a worker never
waits on the console: a pipe to the agent would block a worker whose reader lags, and break it
(EPIPE, SIGPIPE) when the reader dies. The relay reads each followed file from where the rank's
current process started writing, every ``RELAY_EVERY`` seconds, and hands whole lines on (a line
still being written waits for its newline; the rest of a dead process's last line is flushed when
the rank's next process starts or the relay closes), so lines never interleave mid-line.

Bounded, never blocking: at most ``READ_CHUNK`` bytes per file per pass; a file that grows more
than ``MAX_LAG`` bytes ahead of the relay is skipped ahead, with one line saying how much (the log
has it all); a sink that cannot take lines drops them and says how many.

Where a rank's console shows only one of its streams (``console_streams.py``), its stderr goes to
``rankN.stderr.log`` beside ``rankN.log`` (a file cannot tell its writers apart); otherwise both
streams share ``rankN.log``, shown on the console's stdout.
"""

from __future__ import annotations

import os
import select
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from undying.agent.console_streams import BOTH, NONE, STDERR, STDOUT, ConsoleStreams

RELAY_EVERY = 0.1  # seconds between two reads of the followed files
READ_CHUNK = 256 << 10  # bytes read from one file in one pass
MAX_LAG = 4 << 20  # unread bytes of one file beyond which the relay skips ahead
MAX_LINE = 16 << 10  # a line longer than this is cut into pieces of this size
PIPE_BACKLOG = 256 << 10  # bytes a PipeSink holds while the pipe is full; lines beyond it are dropped
CLOSE_WAIT = 2.0  # seconds a closing PipeSink waits for its reader to take the backlog


class LineSink(Protocol):
    """Where relayed lines go: each (console stream, text) whole, in order. Never blocks."""

    def lines(self, batch: list[tuple[int, str]]) -> None: ...


def worker_log_paths(log_dir: Path, rank: int, console: int) -> tuple[Path, Path | None]:
    """The files a rank's process writes: its stdout's, and its stderr's when that is another one
    (the console shows only one of the two streams: ``console`` is STDOUT or STDERR)."""
    stdout_log = log_dir / f"rank{rank}.log"
    if console in (STDOUT, STDERR):
        return stdout_log, log_dir / f"rank{rank}.stderr.log"
    return stdout_log, None


@dataclass
class _Followed:
    """One log file the relay reads: whose, which console stream it goes to, how far it has read."""

    rank: int
    console_stream: int
    path: Path
    handle: BinaryIO
    offset: int
    partial: bytes = b""


class OutputRelay:
    """Follows the log files of one node's workers; ``follow`` when a rank's process starts.

    Lines are read and handed to the sink under one lock, from the relay's thread and from the
    caller of ``follow`` and ``close`` alike: a sink is called by one thread at a time (a
    ``PipeSink`` is not thread-safe: its backlog cannot be cut while another thread writes from it),
    and a rank's lines reach it in the order they were read."""

    def __init__(self, sink: LineSink, streams: ConsoleStreams, relay_every: float = RELAY_EVERY) -> None:
        self.sink = sink
        self.streams = streams
        self.relay_every = relay_every
        self._followed: dict[int, list[_Followed]] = {}  # rank -> its files
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._relay_forever, name="output-relay", daemon=True)
        self._thread.start()

    def console_of(self, local_rank: int) -> int:
        """The streams of this local rank shown on the console."""
        return self.streams.of(local_rank)

    def release(self, rank: int) -> None:
        """Relay the rest of what the rank's previous process wrote (it has ended), then stop
        following its files: called before the rank's next process starts."""
        with self._lock:
            followed = self._followed.pop(rank, [])
            self.sink.lines(self._read_all(followed, final=True))

    def follow(self, rank: int, local_rank: int, stdout_log: tuple[Path, int],
               stderr_log: tuple[Path, int] | None) -> None:
        """Relay the rank's new process's output: each log (path, offset it starts writing at) whose
        stream the console shows. A single log (``stderr_log`` None) holds both streams."""
        console = self.console_of(local_rank)
        files = [(stdout_log, STDOUT if stderr_log is not None else BOTH)]
        if stderr_log is not None:
            files.append((stderr_log, STDERR))
        followed = []
        for (path, offset), holds in files:
            if console & holds == NONE:
                continue
            handle = open(path, "rb")  # noqa: SIM115 - held while the rank's process writes the file
            followed.append(_Followed(rank, STDERR if holds == STDERR else STDOUT, path, handle, offset))
        self.release(rank)
        with self._lock:
            self._followed[rank] = followed

    def close(self) -> None:
        """Relay what is left in every followed file, then stop."""
        self._closed.set()
        self._thread.join(timeout=5.0)
        with self._lock:
            followed = [one for files in self._followed.values() for one in files]
            self._followed = {}
            self.sink.lines(self._read_all(followed, final=True))

    def _relay_forever(self) -> None:
        while not self._closed.wait(self.relay_every):
            with self._lock:  # also when empty: a sink with a backlog sends it on
                self.sink.lines(self._read_all([one for files in self._followed.values() for one in files],
                                               final=False))

    def _read_all(self, followed: list[_Followed], final: bool) -> list[tuple[int, str]]:
        batch: list[tuple[int, str]] = []
        for one in followed:
            batch.extend(_read_lines(one, until_end=final))
            if final:
                if one.partial:
                    batch.append((one.console_stream, _prefixed(one.rank, one.partial)))
                    one.partial = b""
                one.handle.close()
        return batch


def _read_lines(one: _Followed, until_end: bool) -> list[tuple[int, str]]:
    """The whole lines written to ``one`` since the last read (at most READ_CHUNK bytes unless
    ``until_end``), after skipping ahead if it is more than MAX_LAG behind."""
    lines: list[tuple[int, str]] = []
    try:
        size = os.fstat(one.handle.fileno()).st_size
    except OSError:
        return lines
    if size - one.offset > MAX_LAG:
        skipped = size - one.offset
        lines.append((STDERR, f"[rank {one.rank}] [undying] {skipped} bytes of output not shown: written faster "
                              f"than the console shows them; all of it is in {one.path}"))
        one.offset, one.partial = size, b""
    while one.offset < size:
        try:
            data = os.pread(one.handle.fileno(), min(size - one.offset, READ_CHUNK), one.offset)
        except OSError:
            break  # the log's disk failed: the worker's own writes will say so; the relay goes on
        if not data:
            break
        one.offset += len(data)
        pieces = (one.partial + data).split(b"\n")
        one.partial = pieces.pop()
        while len(one.partial) > MAX_LINE:
            pieces.append(one.partial[:MAX_LINE])
            one.partial = one.partial[MAX_LINE:]
        lines.extend((one.console_stream, _prefixed(one.rank, piece)) for piece in pieces)
        if not until_end:
            break
    return lines


def _prefixed(rank: int, raw: bytes) -> str:
    # A carriage return redraws a terminal line (progress bars): the console shows what it would.
    text = raw.rstrip(b"\r").rsplit(b"\r", 1)[-1].decode("utf-8", errors="replace")
    return f"[rank {rank}] {text}"


class PipeSink:
    """Lines to the ``undying run`` process that started this agent, through a pipe it reads (one
    ``STREAM TEXT`` line each). The write end is non-blocking: while the pipe is full, lines wait in
    a backlog of at most PIPE_BACKLOG bytes; beyond it they are dropped, and a line says how many.
    A reader that is gone (EPIPE) ends the relaying; the agent and its workers go on."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.backlog = bytearray()
        self.dropped = 0
        self.broken = False

    def lines(self, batch: list[tuple[int, str]]) -> None:
        if self.broken:
            return
        for stream, text in batch:
            encoded = f"{stream} {text}\n".encode()
            if len(self.backlog) + len(encoded) > PIPE_BACKLOG:
                self.dropped += 1
                continue
            self.backlog += encoded
        self._send()
        if self.dropped and len(self.backlog) < PIPE_BACKLOG // 2:
            self.backlog += (f"{STDERR} [undying] {self.dropped} lines of worker output not shown: the console "
                             f"could not keep up; every line is in the rank logs\n").encode()
            self.dropped = 0
            self._send()

    def _send(self) -> None:
        while self.backlog and not self.broken:
            try:
                written = os.write(self.fd, self.backlog)
            except BlockingIOError:
                return
            except OSError:
                self.broken = True
                self.backlog.clear()
                return
            del self.backlog[:written]

    def close(self) -> None:
        """Send what the backlog holds (waiting up to CLOSE_WAIT seconds for the reader), then close
        the pipe."""
        deadline = time.monotonic() + CLOSE_WAIT
        while self.backlog and not self.broken and time.monotonic() < deadline:
            select.select([], [self.fd], [], max(0.0, deadline - time.monotonic()))
            self._send()
        try:
            os.close(self.fd)
        except OSError:
            pass
