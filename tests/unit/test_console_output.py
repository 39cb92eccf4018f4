"""Worker output and the live line, piece by piece: the agent's relay passes whole lines of the rank
logs, prefixed, from where each process starts; it and the console never block, dropping with a
count instead; the progress line follows the job's events."""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from undying import events as ev
from undying.agent import output_relay
from undying.agent.console_streams import BOTH, STDERR, STDOUT, ConsoleStreams
from undying.agent.output_relay import OutputRelay, PipeSink
from undying.agent.worker_logs import WorkerLogs
from undying.events import Event
from undying.launch.progress import Progress
from undying.launch.terminal import CLEAR_LINE, Terminal


class ListSink:
    def __init__(self) -> None:
        self.received: list[tuple[int, str]] = []
        self.lock = threading.Lock()

    def lines(self, batch: list[tuple[int, str]]) -> None:
        with self.lock:
            self.received.extend(batch)

    def texts(self) -> list[str]:
        with self.lock:
            return [text for _, text in self.received]


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def append(path: Path, data: str) -> None:
    with open(path, "a") as log:
        log.write(data)


def test_relay_passes_whole_lines_of_each_process_from_where_it_starts(tmp_path: Path) -> None:
    sink = ListSink()
    relay = OutputRelay(sink, ConsoleStreams((BOTH, BOTH)), relay_every=0.01)
    first = WorkerLogs(tmp_path, rank=3, local_rank=1, relay=relay)
    first.note("generation 1")
    first.started()
    log = tmp_path / "rank3.log"
    append(log, "hel")
    append(log, "lo\nwor")
    wait_for(lambda: sink.texts() == ["[rank 3] hello"])
    time.sleep(0.05)
    assert sink.texts() == ["[rank 3] hello"], "a line is passed on only once whole"
    append(log, "ld\nlast words, no newline")
    wait_for(lambda: len(sink.texts()) == 2)
    second = WorkerLogs(tmp_path, rank=3, local_rank=1, relay=relay)  # the rank's next process
    second.note("generation 2 (replacement)")
    second.started()
    append(log, "again\n")
    relay.close()
    assert sink.texts() == ["[rank 3] hello", "[rank 3] world", "[rank 3] last words, no newline",
                            "[rank 3] again"]
    assert all(stream == STDOUT for stream, _ in sink.received)
    assert log.read_text().count("--- generation") == 2, "the log keeps everything, unprefixed"


def test_a_rank_showing_one_stream_gets_a_stderr_log(tmp_path: Path) -> None:
    sink = ListSink()
    relay = OutputRelay(sink, ConsoleStreams((STDERR,)), relay_every=0.01)
    logs = WorkerLogs(tmp_path, rank=0, local_rank=0, relay=relay)
    assert logs.stderr_path == tmp_path / "rank0.stderr.log"
    logs.started()
    append(tmp_path / "rank0.log", "to stdout\n")
    append(tmp_path / "rank0.stderr.log", "to stderr\r\n")
    relay.close()
    assert sink.received == [(STDERR, "[rank 0] to stderr")]


def test_a_file_far_ahead_is_skipped_with_a_line_saying_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output_relay, "MAX_LAG", 1000)
    sink = ListSink()
    relay = OutputRelay(sink, ConsoleStreams((BOTH,)), relay_every=3600)  # reads only when closed
    logs = WorkerLogs(tmp_path, rank=1, local_rank=0, relay=relay)
    logs.started()
    append(tmp_path / "rank1.log", "z" * 99 + "\n" * 1901)
    relay.close()
    assert sink.received == [(STDERR, f"[rank 1] [undying] 2000 bytes of output not shown: written faster than "
                                      f"the console shows them; all of it is in {tmp_path / 'rank1.log'}")]


def test_pipe_sink_never_blocks_and_counts_what_it_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output_relay, "PIPE_BACKLOG", 4096)
    read_end, write_end = os.pipe()
    sink = PipeSink(write_end)
    sent = 5000
    started = time.monotonic()
    for index in range(sent):
        sink.lines([(STDOUT, f"[rank 0] line {index} " + "x" * 80)])
    assert time.monotonic() - started < 5, "a full pipe must not block the relay"
    assert sink.dropped > 0
    received = b""
    os.set_blocking(read_end, False)
    for _ in range(100):
        sink.lines([])  # the relay's empty passes send the backlog, then the count
        try:
            received += os.read(read_end, 1 << 20)
        except BlockingIOError:
            pass
    lines = received.decode().splitlines()
    shown = [line for line in lines if line.startswith("1 [rank 0] line ")]
    notices = [line for line in lines if line.startswith("2 [undying] ")]
    assert len(notices) == 1 and notices[0].split()[2] == str(sent - len(shown)), notices
    assert all(line.endswith("x" * 80) for line in shown), "every line shown is whole"
    os.close(read_end)
    sink.lines([(STDOUT, "after the reader went away")])  # EPIPE: no error, no more relaying
    assert sink.broken
    sink.close()


def test_plain_console_writes_lines_to_their_streams_without_escapes() -> None:
    out, err = io.StringIO(), io.StringIO()
    with Terminal(out, err, live=False, capture_prints=False) as terminal:
        terminal.progress = lambda: "[undying] step 1/2"
        terminal.lines([(STDOUT, "[rank 0] out"), (STDERR, "[rank 0] err")])
        terminal.line(STDERR, "[undying] an event")
    assert out.getvalue() == "[rank 0] out\n"
    assert err.getvalue() == "[rank 0] err\n[undying] an event\n"


def test_live_console_keeps_the_progress_line_below_the_others() -> None:
    out = err = io.StringIO()
    with Terminal(out, err, live=True, capture_prints=False) as terminal:
        terminal.progress = lambda: "[undying] step 7/9"
        terminal.line(STDERR, "[undying] first")
        wait_for(lambda: err.getvalue().endswith("step 7/9"))
        terminal.lines([(STDOUT, "[rank 1] second")])
        wait_for(lambda: "second" in err.getvalue() and err.getvalue().endswith("step 7/9"))
    screen = err.getvalue()
    assert screen.endswith(CLEAR_LINE), "the progress line is cleared at the end"
    assert screen.index("first") < screen.index(CLEAR_LINE + "[undying] step 7/9") < screen.index(
        CLEAR_LINE + "[rank 1] second")


class StuckStream(io.StringIO):
    """A terminal that stops taking output until ``release`` is set (Ctrl-S, a stalled ssh)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.release.wait()
        return super().write(text)


def test_a_stuck_console_drops_worker_lines_with_a_count_and_blocks_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("undying.launch.terminal.WORKER_BACKLOG", 10_000)
    stuck = StuckStream()
    with Terminal(stuck, stuck, live=False, capture_prints=False) as terminal:
        started = time.monotonic()
        terminal.lines([(STDOUT, "first")])
        time.sleep(0.1)  # the writer takes it and blocks on the stuck stream
        for index in range(2000):
            terminal.lines([(STDOUT, f"[rank 0] {index:04d} " + "y" * 20)])
        terminal.line(STDERR, "[undying] an event is kept")
        assert time.monotonic() - started < 2
        stuck.release.set()
    lines = stuck.getvalue().splitlines()
    shown = [line for line in lines if line.startswith("[rank 0] ")]
    [notice] = [line for line in lines if "lines not shown" in line]
    assert int(notice.split()[1]) == 2000 - len(shown) and 0 < len(shown) < 2000
    assert "[undying] an event is kept" in lines


def heartbeat(rank: int, step: int, loss: float, max_steps: int = 100) -> Event:
    return Event(ev.HEARTBEAT, rank=rank, step=step, details={"phase": "computing", "loss": loss,
                                                              "max_steps": max_steps})


def test_progress_line_from_events() -> None:
    progress = Progress()
    assert progress.line() == "[undying] starting"
    progress.on_event(heartbeat(0, 10, 2.5), now=100.0)
    progress.on_event(heartbeat(1, 20, 2.25), now=105.0)
    assert progress.line() == "[undying] step 20/100 (20%) | 2.00 steps/s | ETA 0:00:40 | loss 2.25"
    progress.on_event(Event(ev.FAULT_DETECTED, rank=1, details={"description": "rank 1 exited"}), now=106.0)
    assert progress.line().endswith("| 1 fault | recovering")
    progress.on_event(heartbeat(0, 21, 2.0), now=107.0)
    assert progress.line().endswith("| loss 2 | 1 fault")
    progress.on_event(Event(ev.RESTART_BEGIN), now=108.0)
    progress.on_event(heartbeat(0, 10, 2.5), now=109.0)  # a job restart from the checkpoint of step 10
    assert progress.line() == "[undying] step 10/100 (10%) | loss 2.5 | 1 fault"
    progress.on_event(Event(ev.JOB_END, details={"outcome": "succeeded"}), now=110.0)
    assert progress.line().endswith("| succeeded")


def test_a_recovery_handover_is_one_console_line_naming_both_strategies(capsys: pytest.CaptureFixture[str]) -> None:
    from undying import events as ev
    from undying.events import Event
    from undying.launch.console import print_event

    print_event(Event(ev.RECOVERY_HANDOVER, step=12, generation=3,
                      details={"from": "retry", "to": "recover-in-place", "why": "rank 3's process is gone"}))
    [line] = capsys.readouterr().err.splitlines()
    assert line.endswith("step 12 gen 3: recovery handed from retry to recover-in-place: rank 3's process is gone"), line


class OverlapSink:
    """A sink that takes its time over each batch and notes whether a second thread came in meanwhile."""

    def __init__(self) -> None:
        self.inside = 0
        self.overlaps = 0
        self.calls = 0
        self.count_lock = threading.Lock()

    def lines(self, batch: list[tuple[int, str]]) -> None:
        with self.count_lock:
            self.inside += 1
            self.calls += 1
            self.overlaps += self.inside > 1
        time.sleep(0.002)  # as a PipeSink's os.write, with the GIL released
        with self.count_lock:
            self.inside -= 1


def test_the_sink_is_called_by_one_thread_at_a_time(tmp_path: Path) -> None:
    """The relay's thread and a rank's restart (``follow``) both hand lines to the sink: never at once,
    since a PipeSink cannot cut its backlog while another thread writes from it (BufferError)."""
    sink = OverlapSink()
    relay = OutputRelay(sink, ConsoleStreams((BOTH,)), relay_every=0.001)
    log = tmp_path / "rank0.log"
    log.touch()
    for generation in range(200):
        append(log, f"line {generation}\n")
        relay.follow(0, 0, (log, log.stat().st_size), None)  # the rank's next process starts
    relay.close()
    assert sink.calls > 200
    assert sink.overlaps == 0, f"{sink.overlaps} of {sink.calls} sink calls overlapped another"
