"""The overhead benchmark's CPU meter (bench/job_cpu.py) on real processes: a tree's CPU time counts
its grandchildren, and CPU per step over a window is the CPU spent between two samples inside it
divided by the steps done between them, and split by part of the job: the launcher, undying's
agent and standby, a worker's training, communication and other threads."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from job_cpu import CpuSamples, process_role, step_at, thread_part  # noqa: E402

# A parent that starts a busy child and waits: the busy loop is the grandchild of this test.
TREE = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
        "'import time\\nend = time.time() + 3\\nwhile time.time() < end: pass'])")


def test_a_busy_grandchild_is_counted_and_divided_by_the_steps_done() -> None:
    job = subprocess.Popen([sys.executable, "-c", TREE])
    samples = CpuSamples(job.pid)
    started = time.time()
    try:
        time.sleep(0.8)  # both interpreters started
        while time.time() - started < 2.6:
            samples.sample(time.time())
            time.sleep(0.2)
    finally:
        job.wait(timeout=30)
    first = samples.samples[0][0]
    assert len(samples.samples[-1][1]) == 2  # the parent and its busy child
    # A step every 0.1 s, recorded over the whole run: 10 steps a second, the busy loop one core.
    steps = {index: started + index / 10 for index in range(31)}
    per_step = samples.per_step(steps, first_step=0)
    assert per_step is not None and 0.05 < per_step <= 0.11, per_step
    assert abs(step_at(steps, first) - (first - started) * 10) < 1e-6
    assert samples.per_step(steps, first_step=30) is None  # one step: no window
    # The busy child is a worker (not the tree's root) whose main thread does the work.
    parts = samples.parts_per_step(steps, first_step=0)
    assert parts is not None and set(parts) <= {"launcher", "worker training threads", "worker other threads"}, parts
    assert parts["worker training threads"] > 0.8 * per_step, parts
    assert abs(sum(parts.values()) - per_step) < 1e-9, (parts, per_step)
    assert samples.parts_per_step(steps, first_step=30) is None


def test_the_parts_of_a_job() -> None:
    agent = "python -m undying.agent.node_agent --node 0"
    standby = "python -u -m undying.agent.standby"
    assert process_role(10, 10, "bash", "python -m undying.cli run") == "launcher"
    assert process_role(11, 10, "python -m undying.cli run", agent) == "agent"
    assert process_role(12, 10, agent, standby) == "standby"
    assert process_role(13, 10, standby, standby) == "worker"  # forked from the standby
    assert process_role(14, 10, "python -m torch.distributed.run", "python train.py") == "worker"
    assert thread_part("worker", 13, 13, "python") == "worker training threads"
    assert thread_part("worker", 13, 20, "pt_gloo_runloop") == "worker communication threads"
    assert thread_part("worker", 13, 21, "gloo_tcp_loop") == "worker communication threads"
    assert thread_part("worker", 13, 22, "python") == "worker other threads"
    assert thread_part("agent", 11, 23, "python") == "agent"


def test_step_at_holds_the_ends_outside_the_recorded_steps() -> None:
    steps = {5: 100.0, 7: 101.0}
    assert step_at(steps, 99.0) == 5 and step_at(steps, 102.0) == 7 and step_at(steps, 100.5) == 6
