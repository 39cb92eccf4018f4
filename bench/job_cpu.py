"""The CPU time a whole job spends per training step: every process under the job's launcher
(controller, agents, standbys, workers, or torchrun's agent and workers), every thread of each.

Used by bench/overhead.py. On a machine whose cores the job's processes share, CPU time per step
is steadier than the step time: the machine's own speed drifts between runs (other tenants, the
page cache), the work a step asks for does not. ``CpuSamples`` records the tree's CPU time (user +
system, from ``/proc/<pid>/stat``) with a timestamp while the job runs; ``per_step`` divides the
CPU spent between two samples inside a window of steps by the steps done between them;
``parts_per_step`` does the same for each part of the job (``thread_part``: the launcher, undying's
agent and standby, and the workers' training, communication and other threads), from every thread's
``/proc/<pid>/task/<tid>/stat``.
"""

from __future__ import annotations

import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


# The name of a worker thread's kind, by the start of its name (``/proc/<pid>/task/<tid>/comm``):
# gloo's and NCCL's threads are named by their libraries; Python's threads keep the process's name.
COMMUNICATION_THREADS = ("gloo", "pt_gloo", "pt_nccl", "pt_tcpstore")


def thread_part(role: str, pid: int, tid: int, name: str) -> str:
    """Where one thread's CPU is counted: the role of its process (``process_role``), and for a
    worker which of its threads: the main one (the training loop), its collectives' library
    threads, or the others (undying's heartbeat, persister and mirror threads, a DataLoader's)."""
    if role != "worker":
        return role
    if tid == pid:
        return "worker training threads"
    if name.startswith(COMMUNICATION_THREADS):
        return "worker communication threads"
    return "worker other threads"


def process_role(pid: int, root: int, parent_command: str, command: str) -> str:
    """``launcher`` (the tree's root: torchrun's agent, or ``undying run`` with its controller),
    ``agent`` (undying's node agent), ``standby`` (the agent's warm standby, which the workers are
    forked from), or ``worker`` (every other process: a training rank)."""
    if pid == root:
        return "launcher"
    if "undying.agent.node_agent" in command:
        return "agent"
    if "undying.agent.standby" in command and "undying.agent.node_agent" in parent_command:
        return "standby"
    return "worker"


def descendants(root: int) -> dict[int, int]:
    """``root`` and every process below it, each with its parent's pid (one scan of /proc)."""
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
    found, todo = {root: 0}, [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            found[child] = pid
            todo.append(child)
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stat_cpu(path: str) -> tuple[str, float] | None:
    """The name and user + system CPU seconds in a ``stat`` file of /proc (a process's or a
    thread's); None if it is gone."""
    try:
        name, fields = Path(path).read_text().split("(", 1)[1].rsplit(")", 1)
    except (OSError, ValueError):
        return None
    values = fields.split()
    return name, (int(values[11]) + int(values[12])) / TICKS


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of ``pid`` still there: its name and user + system CPU seconds."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    read = {int(tid): _stat_cpu(f"/proc/{pid}/task/{tid}/stat") for tid in tids}
    return {tid: found for tid, found in read.items() if found is not None}


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each process still there (all its threads)."""
    read = {pid: _stat_cpu(f"/proc/{pid}/stat") for pid in pids}
    return {pid: found[1] for pid, found in read.items() if found is not None}


def thread_parts(root: int, roles: dict[int, str]) -> dict[tuple[int, int], tuple[str, float]]:
    """Every thread of the tree under ``root``: its part (``thread_part``) and user + system CPU
    seconds, by (pid, tid). ``roles``: each process's role (``process_role``), filled in as new
    processes are met and kept by the caller across calls."""
    threads: dict[tuple[int, int], tuple[str, float]] = {}
    for pid, parent in descendants(root).items():
        if pid not in roles:
            roles[pid] = process_role(pid, root, _command(parent), _command(pid))
        for tid, (name, seconds) in thread_cpu_seconds(pid).items():
            threads[(pid, tid)] = (thread_part(roles[pid], pid, tid, name), seconds)
    return threads


class CpuSamples:
    """(wall time, CPU seconds of each process of the tree) every time ``sample`` is called."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.samples: list[tuple[float, dict[int, float]]] = []
        # Beside each sample: every thread's (part, CPU seconds), by (pid, tid).
        self.threads: list[dict[tuple[int, int], tuple[str, float]]] = []
        self._roles: dict[int, str] = {}

    def sample(self, now: float) -> None:
        self.samples.append((now, cpu_seconds(list(descendants(self.root)))))
        self.threads.append(thread_parts(self.root, self._roles))

    def parts_per_step(self, step_times: dict[int, float], first_step: int) -> dict[str, float] | None:
        """``per_step`` for each part of the job (``thread_part``): CPU seconds per step of the threads
        present in both samples."""
        window = self._window(step_times, first_step)
        if window is None:
            return None
        first, last, done = window
        spent: dict[str, float] = {}
        for key, (part, seconds) in self.threads[last].items():
            if key in self.threads[first]:
                spent[part] = spent.get(part, 0.0) + seconds - self.threads[first][key][1]
        return {part: total / done for part, total in sorted(spent.items())}

    def _window(self, step_times: dict[int, float], first_step: int) -> tuple[int, int, float] | None:
        """The indices of the first and last samples inside the window of steps from ``first_step``
        to the last recorded one, and the steps done between them; None if fewer than two samples
        fall inside or no step was done."""
        steps = sorted(step for step in step_times if step >= first_step)
        if len(steps) < 2:
            return None
        begin, end = step_times[steps[0]], step_times[steps[-1]]
        inside = [index for index, (at, _) in enumerate(self.samples) if begin <= at <= end]
        if len(inside) < 2:
            return None
        first, last = inside[0], inside[-1]
        done = step_at(step_times, self.samples[last][0]) - step_at(step_times, self.samples[first][0])
        return (first, last, done) if done > 0 else None

    def per_step(self, step_times: dict[int, float], first_step: int) -> float | None:
        """CPU seconds per step over the window from ``first_step`` to the last recorded step:
        between the first sample after the window begins and the last one before it ends, the
        steps done (interpolated in ``step_times``, step -> wall time of its end) and the CPU
        spent by the processes present in both samples (a process that began or ended in
        between is left out). None if fewer than two samples fall inside."""
        window = self._window(step_times, first_step)
        if window is None:
            return None
        first, last, done = window
        cpu_a, cpu_b = self.samples[first][1], self.samples[last][1]
        return sum(cpu_b[pid] - cpu_a[pid] for pid in cpu_b if pid in cpu_a) / done


def step_at(step_times: dict[int, float], at: float) -> float:
    """The (fractional) step reached at wall time ``at``, interpolated between recorded steps."""
    points = sorted((time, step) for step, time in step_times.items())
    for (time_a, step_a), (time_b, step_b) in zip(points, points[1:], strict=False):
        if time_a <= at <= time_b:
            return step_a + (step_b - step_a) * ((at - time_a) / (time_b - time_a) if time_b > time_a else 0.0)
    return float(points[0][1] if at < points[0][0] else points[-1][1])
