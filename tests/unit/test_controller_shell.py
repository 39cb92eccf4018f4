"""The controller's shell around the job machine: threads that wait there must not wake each other.

A real ``Controller`` with its loop in a thread (``ShellJob``); the test plays the agents and the
workers. Three survivors long-poll for a plan that cannot come yet (the replacement has not
started): they must sleep, not spin. Each check-in used to wake every waiting thread, which checked
in again and woke the others: the controller process ran at 100 % of a core for as long as a
recovery waited, and the replacements it waited for started seconds later on a 2-core machine.
"""

from __future__ import annotations

import resource
import threading
from pathlib import Path

from tests.unit.job_harness import ShellJob
from undying.protocol import (
    PlanAction,
    RecoverRequest,
)

RECOVERY = {"process_recover": True, "recover_strategy": ["recover-in-place"], "nnodes": 2, "nproc_per_node": 2,
            "heartbeat_timeout": 10.0}
# CPU seconds the whole process may use while three check-ins wait for 1.5 s (spinning used all of it).
CPU_BOUND_S = 0.5


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def test_check_ins_waiting_for_a_plan_do_not_spin(tmp_path: Path) -> None:
    job = ShellJob(tmp_path, **RECOVERY)
    controller = job.controller
    try:
        job.start_two_nodes_and_kill_rank3()

        plans: dict[int, PlanAction] = {}

        def survivor(rank: int) -> None:
            request = RecoverRequest(rank, rank // 2, 1, 7, 2000 + rank, "peer gone", wait=1.5)
            plans[rank] = PlanAction(controller.recover(request).action)

        started = cpu_seconds()
        threads = [threading.Thread(target=survivor, args=(rank,)) for rank in (0, 1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        used = cpu_seconds() - started
        assert plans == {0: PlanAction.WAIT, 1: PlanAction.WAIT, 2: PlanAction.WAIT}  # rank 3 never started
        assert used < CPU_BOUND_S, f"the controller used {used:.2f} CPU s while three check-ins waited 1.5 s"
    finally:
        job.close()
