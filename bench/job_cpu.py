"""The CPU time a whole job spends per training step: every process under the job's launcher
(controller, agents, standbys, workers, or torchrun's agent and workers), every thread of each.

Used by bench/overhead.py. On a machine whose cores the job's processes share, CPU time per step
is steadier than the step time: the machine's own speed drifts between runs (other tenants, the
page cache), the work a step asks for does not. ``CpuSamples`` records the tree's CPU time (user +
system, from ``/proc/<pid>/stat``) with a timestamp while the job runs; ``per_step`` divides the
CPU spent between two samples inside a window of steps by the steps done between them.
"""

from __future__ import annotations

import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (one scan of /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each process still there (all its threads)."""
    seconds: dict[int, float] = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[pid] = (int(fields[11]) + int(fields[12])) / TICKS
    return seconds


class CpuSamples:
    """(wall time, CPU seconds of each process of the tree) every time ``sample`` is called."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.samples: list[tuple[float, dict[int, float]]] = []

    def sample(self, now: float) -> None:
        self.samples.append((now, cpu_seconds(descendants(self.root))))

    def per_step(self, step_times: dict[int, float], first_step: int) -> float | None:
        """CPU seconds per step over the window from ``first_step`` to the last recorded step:
        between the first sample after the window begins and the last one before it ends, the
        steps done (interpolated in ``step_times``, step -> wall time of its end) and the CPU
        spent by the processes present in both samples (a process that began or ended in
        between is left out). None if fewer than two samples fall inside."""
        steps = sorted(step for step in step_times if step >= first_step)
        if len(steps) < 2:
            return None
        begin, end = step_times[steps[0]], step_times[steps[-1]]
        inside = [(at, cpu) for at, cpu in self.samples if begin <= at <= end]
        if len(inside) < 2:
            return None
        (at_a, cpu_a), (at_b, cpu_b) = inside[0], inside[-1]
        done = step_at(step_times, at_b) - step_at(step_times, at_a)
        spent = sum(cpu_b[pid] - cpu_a[pid] for pid in cpu_b if pid in cpu_a)
        return spent / done if done > 0 else None


def step_at(step_times: dict[int, float], at: float) -> float:
    """The (fractional) step reached at wall time ``at``, interpolated between recorded steps."""
    points = sorted((time, step) for step, time in step_times.items())
    for (time_a, step_a), (time_b, step_b) in zip(points, points[1:], strict=False):
        if time_a <= at <= time_b:
            return step_a + (step_b - step_a) * ((at - time_a) / (time_b - time_a) if time_b > time_a else 0.0)
    return float(points[0][1] if at < points[0][0] else points[-1][1])
