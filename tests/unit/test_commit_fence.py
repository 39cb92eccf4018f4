"""The fence before a step is applied: a worker whose last answered heartbeat is older than its
lease asks the controller before it applies a step, and learns there that its generation is gone.

A real ``Controller`` behind a real ``ControllerServer`` on 127.0.0.1 and a real worker
``Reporter`` (runtime/reporter.py); the test plays the agents. The case it stands for: a host frozen
(SIGSTOP) longer than heartbeat_timeout is replaced; woken, its worker's all-reduce can complete
from bytes its peers sent before they gave the step up, and it must not apply that step.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.unit.job_harness import ShellJob
from undying.controller.server import ControllerServer
from undying.protocol import Phase
from undying.runtime.reporter import Reporter

TOKEN = "fence-token"
SPEC = {"process_recover": True, "recover_strategy": ["recover-in-place"], "nnodes": 2, "nproc_per_node": 2,
        "heartbeat_timeout": 10.0}
QUIET = 600.0  # a heartbeat interval the test never waits out: only the first beat and confirms go out


def test_a_stale_lease_asks_the_controller_and_a_fresh_one_does_not(tmp_path: Path) -> None:
    job = ShellJob(tmp_path, **SPEC)
    server = ControllerServer(job.controller, TOKEN, "127.0.0.1", 0)
    serving = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    serving.start()
    reporter = Reporter(f"127.0.0.1:{server.port}", TOKEN, rank=2, node=1, generation=1, interval=QUIET)
    try:
        # The heartbeat thread's first beat is answered: the lease is fresh.
        assert job.wait_for(lambda: reporter._answered_sent_at is not None)
        job.start_two_nodes_and_kill_rank3()  # recover-in-place aborts generation 1
        assert reporter.abort_generation == 0  # the thread sleeps QUIET seconds: it has not heard yet

        assert not reporter.confirm_generation(lease=QUIET)  # fresh lease: no round trip, still unaware
        assert reporter.abort_generation == 0

        assert reporter.confirm_generation(lease=0.0)  # stale lease: one heartbeat from this thread
        assert reporter.abort_generation >= 1, "the fence must learn that generation 1 was aborted"
    finally:
        reporter.close()
        server.stop()
        job.close()


def test_a_fresh_beat_after_a_silence_does_not_renew_the_lease(tmp_path: Path) -> None:
    """A frozen host, woken: its heartbeat thread may be answered once before the training thread
    reaches the fence, which makes the newest answered beat fresh. A gap of ``lease`` or more between
    two answered beats since the step began still sends the fence to the controller; without such a
    gap (or with the gap before the step began) the fresh beat holds."""
    job = ShellJob(tmp_path, **SPEC)
    server = ControllerServer(job.controller, TOKEN, "127.0.0.1", 0)
    serving = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    serving.start()
    reporter = Reporter(f"127.0.0.1:{server.port}", TOKEN, rank=2, node=1, generation=1, interval=QUIET)
    lease = 0.3
    try:
        assert job.wait_for(lambda: reporter._answered_sent_at is not None)
        began = time.monotonic()
        reporter.report_now(0, Phase.COMPUTING)  # answered at once: no gap
        assert not reporter.confirm_generation(lease, since=began)
        time.sleep(lease + 0.1)  # silent past the lease (the thread sleeps QUIET seconds) ...
        reporter.report_now(0, Phase.COMPUTING)  # ... then one beat, answered: the newest is fresh
        assert not reporter.confirm_generation(lease)  # the newest beat alone would let the step go
        job.start_two_nodes_and_kill_rank3()  # recover-in-place aborts generation 1
        assert reporter.confirm_generation(lease, since=began), "a silence since the step began must ask"
        assert reporter.abort_generation >= 1
        assert not reporter.confirm_generation(lease, since=time.monotonic())  # the gap was before this step
    finally:
        reporter.close()
        server.stop()
        job.close()


def test_steps_longer_than_the_lease_do_not_ask_from_the_training_thread(tmp_path: Path) -> None:
    """Given the lease, the heartbeat thread keeps it fresh while a step is in flight: at the commit
    of a step that took longer than the lease, the fence finds an answered beat young enough and a
    heartbeat thread that beat all along, and does not ask (a beat per step, sent when the step moved,
    would be a step old)."""
    job = ShellJob(tmp_path, **SPEC)
    server = ControllerServer(job.controller, TOKEN, "127.0.0.1", 0)
    serving = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    serving.start()
    lease = 1.0
    reporter = Reporter(f"127.0.0.1:{server.port}", TOKEN, rank=2, node=1, generation=1, interval=QUIET,
                        fence_lease=lease)
    try:
        assert job.wait_for(lambda: reporter._answered_sent_at is not None)
        asked = []
        for step in range(1, 6):
            began = time.monotonic()
            reporter.update(step=step, phase=Phase.COMPUTING)
            time.sleep(lease * 1.2)
            asked.append(reporter.confirm_generation(lease, since=began))
        assert sum(asked) <= 1, asked  # one late wake on a loaded machine is allowed; without the thread's beats: 5
    finally:
        reporter.close()
        server.stop()
        job.close()


def test_no_controller_means_no_fence() -> None:
    """A standalone run (no controller) has nobody to replace it: the fence passes at once."""
    reporter = Reporter(None, "", rank=0, node=0, generation=1, interval=QUIET)
    reporter.confirm_generation(lease=0.0)
    assert reporter.abort_generation == 0
    reporter.close()
