"""The agent's view of a stopped worker: the kernel's process state, confirmed over a moment, and
reported the moment it changes. Real processes (``sleep``) stopped with SIGSTOP; no controller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from undying.agent.node_agent import Agent
from undying.agent.stopped_workers import StoppedWorkers, process_stopped
from undying.config import JobSpec
from undying.protocol import WorkerState

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
WAIT_S = 20.0


def eventually(predicate: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    os.kill(process.pid, signal.SIGCONT)
    process.wait()


def test_a_stopped_process_reads_stopped_until_it_continues(sleeper: subprocess.Popen[bytes]) -> None:
    assert not process_stopped(sleeper.pid)
    os.kill(sleeper.pid, signal.SIGSTOP)
    assert eventually(lambda: process_stopped(sleeper.pid))
    os.kill(sleeper.pid, signal.SIGCONT)
    assert eventually(lambda: not process_stopped(sleeper.pid))


def test_a_gone_process_or_a_command_name_with_parentheses_is_read_right(tmp_path: Path) -> None:
    assert not process_stopped(2**22 + 7, proc=tmp_path)  # no such process
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text("42 (a) R (b) T 1 42 42 0 -1\n")
    assert process_stopped(42, proc=tmp_path)
    (tmp_path / "42" / "stat").write_text("42 (T) S) R 1 42 42 0 -1\n")
    assert not process_stopped(42, proc=tmp_path)


def test_a_stop_counts_once_seen_across_the_confirm_time_and_a_continue_at_once() -> None:
    stopped: set[int] = set()
    watch = StoppedWorkers(lambda pid: pid in stopped, confirm=0.5)
    assert watch.observe({0: 100, 1: 101}, now=0.0) == []
    stopped.add(101)
    assert watch.observe({0: 100, 1: 101}, now=0.25) == []  # seen once: not yet
    assert watch.observe({0: 100, 1: 101}, now=0.5) == []
    assert watch.observe({0: 100, 1: 101}, now=0.75) == [1]
    assert watch.is_stopped(101) and not watch.is_stopped(100)
    assert watch.observe({0: 100, 1: 101}, now=1.0) == []  # reported once
    stopped.clear()
    assert watch.observe({0: 100, 1: 101}, now=1.25) == [1]
    assert not watch.is_stopped(101)


def test_a_stop_seen_before_the_watcher_itself_paused_must_be_seen_again() -> None:
    """The agent stopped along with its workers (a frozen host, resumed): an old sighting is stale."""
    watch = StoppedWorkers(lambda pid: True, confirm=0.5)
    assert watch.observe({0: 100}, now=0.0) == []
    assert watch.observe({0: 100}, now=60.0) == []
    assert watch.observe({0: 100}, now=60.5) == [0]


def test_a_stopped_then_replaced_worker_is_forgotten() -> None:
    watch = StoppedWorkers(lambda pid: pid == 101, confirm=0.0)
    assert watch.observe({1: 101}, now=0.0) == [1]
    assert watch.observe({1: 201}, now=0.25) == []  # rank 1 is a new process now
    assert not watch.is_stopped(101) and not watch.is_stopped(201)


def test_the_agent_reports_its_worker_stopped_and_running_again_at_once(
        sleeper: subprocess.Popen[bytes], tmp_path: Path) -> None:
    """The agent's watcher, with a real worker process: each change is reported without a poll, and
    between changes it beats (a report of no worker) twice per heartbeat_interval."""
    agent = Agent(0, JobSpec(heartbeat_interval=0.4), "127.0.0.1:9", "token", tmp_path, ["true"])
    agent.workers, agent.local_ranks, agent.worker_generations = {3: sleeper}, {3: 1}, {3: 1}
    reports: list[list[str]] = []
    agent._report = lambda ranks, client=None: reports.append(  # type: ignore[method-assign]
        [s.state for s in agent._statuses() if s.rank in ranks])
    changes = lambda: [report for report in reports if report]  # noqa: E731
    watcher = threading.Thread(target=agent._watch_stopped, daemon=True)
    watcher.start()
    try:
        time.sleep(1.0)
        assert changes() == []
        assert 2 <= len(reports) <= 8, reports  # about 5 beats in 1 s
        os.kill(sleeper.pid, signal.SIGSTOP)
        assert eventually(lambda: changes() == [[WorkerState.STOPPED]])
        os.kill(sleeper.pid, signal.SIGCONT)
        assert eventually(lambda: changes() == [[WorkerState.STOPPED], [WorkerState.RUNNING]])
    finally:
        agent._stopping = True
        watcher.join(timeout=5)
