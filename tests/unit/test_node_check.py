"""Health checks before a node is used: each item of a node's check (agent/node_check.py), and a node that
fails it never given ranks (the job machine on a fake clock: controller/fitness.py)."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from tests.unit.job_harness import Job
from undying import events as ev
from undying.agent.node_check import check_node, device_check
from undying.config.loading import validate_job_spec
from undying.controller.state import JobState
from undying.inject import parse_injection
from undying.protocol import AgentHello, AgentPoll, OrderKind, WorkerState

SPEC = validate_job_spec({"nnodes": 2, "nproc_per_node": 2})


class Forked:
    """The device check in this process (a warm standby's fork, without the process)."""

    def fork(self, env: dict, command: list[str], log: Path, err_log: Path | None = None) -> Forked:
        from undying.agent.node_check import main

        self.code = main(command[command.index("--result"):])
        return self

    def wait(self, timeout: float | None = None) -> int:
        return self.code


def checked(tmp_path: Path, **options: object) -> list[str]:
    defaults: dict = {"spec": SPEC, "run_dir": tmp_path / "run", "log": tmp_path / "run" / "logs" / "check1.log",
                      "injections": [], "launched_as": 1, "standby": Forked()}
    return check_node(**{**defaults, **options}).problems


def test_a_healthy_node_passes_and_writes_the_t2_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("UNDYING_SHM_DIR", str(tmp_path / "shm"))
    result = check_node(SPEC, tmp_path / "run", tmp_path / "run" / "logs" / "check1.log", [], 1, standby=Forked())
    assert result.problems == []
    assert result.root_probe and (tmp_path / "run" / "checkpoints" / f".undying-probe-{result.root_probe}").exists()
    assert result.timings["devices"] == 1 and result.timings["kernel_seconds"] >= 0


def test_an_unwritable_checkpoint_root_and_node_memory_are_problems(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("UNDYING_SHM_DIR", str(blocker / "shm"))
    spec = validate_job_spec({"nnodes": 2, "nproc_per_node": 2, "checkpoint": {"dir": str(blocker / "ckpt")}})
    problems = checked(tmp_path, spec=spec)
    assert any(problem.startswith(f"node memory {blocker / 'shm'} is not writable") for problem in problems)
    assert any(f"cannot write to checkpoint root {blocker / 'ckpt'}" in problem for problem in problems)


@pytest.fixture
def full_tmpfs(tmp_path: Path):
    """A 1 MiB tmpfs, filled: node memory that really is full."""
    mount = tmp_path / "full"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    subprocess.run(["dd", "if=/dev/zero", f"of={mount / 'filler'}", "bs=64k"], capture_output=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_node_memory_is_a_problem(tmp_path, monkeypatch, full_tmpfs):
    monkeypatch.setenv("UNDYING_SHM_DIR", str(full_tmpfs))
    [problem] = checked(tmp_path)
    assert problem.startswith(f"node memory {full_tmpfs}") and ("No space left" in problem or "is full" in problem)


def test_an_unreachable_store_and_an_injected_failure_are_problems(tmp_path, monkeypatch):
    monkeypatch.setenv("UNDYING_SHM_DIR", str(tmp_path / "shm"))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    injections = [parse_injection("check:node=1", 0), parse_injection("check:node=0", 1)]
    problems = checked(tmp_path, store=("127.0.0.1", port), injections=injections)
    assert problems == [f"the job's store 127.0.0.1:{port} is not reachable: [Errno 111] Connection refused",
                        "injected failing check (check:node=1)"]
    assert checked(tmp_path, injections=injections, launched_as=2) == []  # a spare that adopts node 1: not it


def test_a_gpu_job_needs_a_gpu_for_every_local_rank():
    cpu = device_check(nproc=2, backend="gloo")
    assert cpu["problems"] == [] and cpu["timings"]["devices"] == 1
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this host has the GPUs")
    [problem] = device_check(nproc=2, backend="nccl")["problems"]
    assert problem.endswith("backend nccl needs one for each of the 2 local ranks")


FAILED = {"problems": ["node memory /dev/shm is full: 0 KiB free, 1024 KiB needed"], "timings": {}}


def hello(job: Job, node: int, pid: int, check: dict | None = None, standby: bool = False):
    return job.controller.hello(AgentHello(node, pid, f"host{node}", 2, standby=standby, check=check or {}))


def test_a_node_that_fails_its_check_holds_no_ranks_and_a_spare_takes_its_place(make_job):
    job = make_job(nnodes=2, nproc_per_node=2, node_check=True)
    job.start()
    assert hello(job, 0, 1000).accepted
    reply = hello(job, 1, 1001, FAILED)
    assert reply.accepted and reply.node == 2 and reply.reason.startswith("not given ranks: node memory")
    [failed] = job.events(ev.NODE_CHECK_FAILED)
    assert (failed.node, failed.details["when"], failed.details["problems"]) == (1, "hello", FAILED["problems"])
    job.advance(0.5)
    assert job.controller.state is JobState.WAITING_FOR_NODES  # node 1's place waits for a fit agent
    assert hello(job, 3, 1003, {"problems": [], "timings": {}}, standby=True).accepted
    adopt = job.next_order(3)
    assert (adopt.kind, adopt.node) == (OrderKind.ADOPT, 1)
    assert hello(job, 1, 1003, {"problems": [], "timings": {}}).accepted
    assert job.next_order(1).ranks == [2, 3]
    assert job.next_order(2).kind == OrderKind.NONE  # the unfit agent: a spare never given ranks
    assert job.controller.state is JobState.RUNNING


def test_a_node_whose_check_fails_after_a_job_restart_is_replaced_by_a_spare(make_job):
    job = make_job(nnodes=2, nproc_per_node=2, node_check=True)
    assert hello(job, 2, 1002, {"problems": []}, standby=True).accepted
    job.start_running()
    job.poll(1, 1, job.statuses(1, 1, WorkerState.EXITED, 1))
    assert job.next_order(0, 1).kind == OrderKind.STOP
    assert job.next_order(1, 1).kind == OrderKind.STOP
    # Both stop their workers and check again; node 1's check fails.
    job.controller.poll(AgentPoll(0, 1, job.statuses(0, 1, WorkerState.EXITED, -15), 0.0, check={"problems": []}))
    job.controller.poll(AgentPoll(1, 1, job.statuses(1, 1, WorkerState.EXITED, -15), 0.0, check=FAILED))
    [failed] = job.events(ev.NODE_CHECK_FAILED)
    assert (failed.node, failed.details["when"]) == (1, "restart")
    assert job.poll(1, 1).reason == "hello"  # its agent says hello again, with a new check
    assert job.next_order(2).kind == OrderKind.STOP  # every agent's stop, the spare's too
    adopt = job.next_order(2)
    assert (adopt.kind, adopt.node) == (OrderKind.ADOPT, 1)
    assert hello(job, 1, 1002, {"problems": []}).accepted
    start = job.next_order(1)
    assert (start.kind, start.generation, start.ranks) == (OrderKind.START, 2, [2, 3])
    reply = hello(job, 1, 1001, FAILED)  # the old agent's new check fails too: it waits as an unfit spare
    assert reply.node == 3 and job.controller.status()["nodes"]["3"]["standby"]


def test_a_job_restart_waits_for_every_nodes_new_check(make_job):
    job = make_job(nnodes=1, nproc_per_node=2, node_check=True)
    job.start_running()
    job.poll(0, 1, job.statuses(0, 1, WorkerState.EXITED, 1))
    assert job.next_order(0, 1).kind == OrderKind.STOP
    assert job.poll(0, 1, job.statuses(0, 1, WorkerState.EXITED, -15), wait=0.5).kind == OrderKind.NONE
    assert job.controller.state is JobState.STOPPING  # its workers are gone, its check not in yet
    job.controller.poll(AgentPoll(0, 1, [], 0.0, check={"problems": []}))
    assert job.next_order(0, 1).kind == OrderKind.START


def test_a_failed_over_controller_keeps_unfit_and_switched_out_agents_out(make_job):
    job = make_job(nnodes=2, nproc_per_node=2, node_check=True)
    assert hello(job, 2, 1002, FAILED, standby=True).node == 2  # a spare that failed its check
    job.start_running()
    job.controller.machine.membership.retired[("host5", 1005)] = "rank 3 is a straggler"
    successor = make_job(nnodes=2, nproc_per_node=2, node_check=True)
    successor.controller.resume(job.controller.export_state(), why="test")
    membership = successor.controller.machine.membership
    assert membership.nodes[2].unfit.startswith("node memory") and membership.idle_spare() is None
    reply = successor.controller.hello(AgentHello(1, 1005, "host5", 2, check={"problems": []}))
    assert reply.node != 1 and "switched out of the job: rank 3 is a straggler" in reply.reason
