"""undying under a real Slurm (slurmctld + three slurmd on this machine, tests/faults/slurm_cluster.py).

The batch scripts are the ones `undying slurm sbatch` writes; each node's `undying run` takes its
place from the step's environment. Shown: a node killed with its slurmd moves its ranks to the
allocation's spare, the job finishing in the same allocation, bitwise equal to the fault-free run;
`scancel --signal=TERM` persists the newest committed step and the requeued job (same id, same run
directory) resumes there, bitwise; a request the partition or the allocation cannot hold is one
error line, and a job refused for it is not requeued.

Skipped, with the reason, only where the cluster cannot run (not root, Slurm or munge not installed);
an error instead where UNDYING_REQUIRE_SLURM=1 (CI).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import EXAMPLE, MARK_ENV, STEPS, JobRun, wait_no_processes
from tests.faults.slurm_cluster import PARTITION, SlurmCluster, why_unavailable
from undying import events as ev
from undying.events import Event, read_events
from undying.slurm.hostlist import expand

pytestmark = pytest.mark.faults

# The fault tests' job (tests/conftest.py BASE_ARGS) as a spec file; the node count comes from the
# batch script's --nodes.
BASE_SPEC = """\
nproc_per_node: 2
monitor_interval: 0.3
heartbeat_interval: 0.5
heartbeat_timeout: 4
node_return_timeout: 60
comm_timeout: 20
sample_log: true
checkpoint:
  interval: 10
"""
RECOVER_SPEC = BASE_SPEC + """\
process_recover: true
pod_rescheduling: "on"
recover_strategy: [recover-in-place, recover]
"""


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    reason = why_unavailable()
    if reason is not None:
        if os.environ.get("UNDYING_REQUIRE_SLURM") == "1":
            raise AssertionError(reason)
        print(f"skipping the Slurm tests: {reason}")
        pytest.skip(reason)
    cluster = SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@dataclass
class SlurmJob:
    """A job submitted from ``workdir``; its run directory is undying's default in a step."""

    cluster: SlurmCluster
    workdir: Path
    job_id: str
    mark: str

    @property
    def run_dir(self) -> Path:
        return self.workdir / "runs" / f"slurm-{self.job_id}"

    def output(self) -> str:
        path = self.workdir / f"slurm-{self.job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self) -> list[Event]:
        return read_events(self.run_dir) if (self.run_dir / ev.EVENTS_FILE).exists() else []

    def wait_for_event(self, what: str, found: Callable[[Event], bool], timeout: float = 120) -> Event:
        deadline = time.time() + timeout
        while time.time() < deadline:
            match = next((event for event in self.events() if found(event)), None)
            if match is not None:
                return match
            time.sleep(0.2)
        raise AssertionError(f"no {what} within {timeout} s:\n{self.output()}")

    def story(self) -> str:
        return f"{self.output()}\n{self.cluster.logs()}"


def job_env(mark: str, cluster: SlurmCluster) -> dict[str, str]:
    # sbatch exports this environment to the job (PYTHONPATH included), and with it the test's mark.
    return cluster.env({**os.environ, MARK_ENV: mark, "PYTHONUNBUFFERED": "1"})


# Each step sleeps a little (the numbers are unchanged, so the fault-free reference holds): the
# fault lands mid-run however fast the machine trains.
STEP_SLEEP = ["--step-sleep", "0.2"]


def sbatch_command(workdir: Path, spec: str, options: list[str]) -> list[str]:
    (workdir / "job.yaml").write_text(spec)
    return [sys.executable, "-m", "undying.cli", "slurm", "sbatch", "job.yaml", *options, "--",
            str(EXAMPLE), "--steps", str(STEPS), "--final-state", "final_state.pt", *STEP_SLEEP]


def submit(cluster: SlurmCluster, workdir: Path, spec: str, options: list[str]) -> SlurmJob:
    """`undying slurm sbatch job.yaml OPTIONS --submit -- train.py ...` from ``workdir``."""
    mark = uuid.uuid4().hex
    done = subprocess.run(sbatch_command(workdir, spec, [*options, "--submit"]), cwd=workdir,
                          env=job_env(mark, cluster), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.split("submitted batch job ")[1].split()[0]
    return SlurmJob(cluster, workdir, job_id, mark)


def test_host_lists_expand_as_scontrol_does(slurm: SlurmCluster) -> None:
    for hostlist in ("n[1-3,5]", "gpu-[01-10]", "a[1-2]-b[3-4]", "x1,y[2-3]", "n[3,1]", "n[8-10]", "n[009-011]",
                     "rack[1-2]-node[01-02],login", "n[1-2][3-4]"):
        shown = slurm.command("scontrol", "show", "hostnames", hostlist).stdout.split()
        assert expand(hostlist) == shown, hostlist


def test_a_request_larger_than_the_partition_is_one_line_and_nothing_is_submitted(slurm: SlurmCluster,
                                                                                   tmp_path: Path) -> None:
    done = subprocess.run(sbatch_command(tmp_path, BASE_SPEC, ["--nodes", "3", "--standby", "1", "--submit"]),
                          cwd=tmp_path, env=job_env("none", slurm), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("undying: error: "), done.stderr
    assert f"= 4 nodes: partition {PARTITION} holds at most 3" in done.stderr, done.stderr
    assert not list(tmp_path.glob("*.sbatch"))
    assert slurm.command("squeue", "-h").stdout.strip() == ""


def test_an_allocation_smaller_than_the_job_is_refused_on_every_node_and_not_requeued(slurm: SlurmCluster,
                                                                                       tmp_path: Path) -> None:
    """The script asks for 2 nodes + 1 spare; submitted on 2 nodes (sbatch's --nodes wins over the
    script's), every node's `undying run` refuses with one line and exits 2, and the batch script
    ends the job there instead of requeueing it."""
    slurm.wait_idle()
    mark = uuid.uuid4().hex
    written = subprocess.run(sbatch_command(tmp_path, BASE_SPEC, ["--nodes", "2", "--standby", "1", "--out",
                                                                  "job.sbatch"]),
                             cwd=tmp_path, env=job_env(mark, slurm), capture_output=True, text=True, timeout=60)
    assert written.returncode == 0, written.stderr
    done = subprocess.run(["sbatch", "--parsable", "--nodes=2", "job.sbatch"], cwd=tmp_path,
                          env=job_env(mark, slurm), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    job = SlurmJob(slurm, tmp_path, done.stdout.strip(), mark)
    record = slurm.wait_ended(job.job_id, timeout=120)
    output = job.output()
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("FAILED", "2:0", "0"), job.story()
    refusal = ("undying: error: the job needs 2 nodes + 1 spare = 3, the Slurm step has 2 (SLURM_STEP_NUM_NODES): "
               "allocate 3 (sbatch --nodes 3)")
    assert [line for line in output.splitlines() if line.startswith("undying: error")] == [refusal] * 2, output
    assert "requeueing" not in output
    assert wait_no_processes(mark) == []


def test_scancel_signal_term_persists_the_newest_step_and_the_requeued_job_resumes_there_bitwise(
        reference_run: JobRun, slurm: SlurmCluster, tmp_path: Path) -> None:
    """`scancel --signal=TERM` reaches every task of the step (and every process, workers included):
    node 0 and node 1 each ask for the graceful stop, the workers ignore the signal and persist the
    newest committed step, every `undying run` exits 75 and the batch script requeues the job. Slurm
    holds a requeued job back for a while (BeginTime); released, it runs again with the same id and
    run directory, loads that step and ends bitwise equal to the fault-free run."""
    slurm.wait_idle()
    job = submit(slurm, tmp_path, BASE_SPEC, ["--nodes", "2"])
    job.wait_for_event("a heartbeat at step 13", lambda e: e.kind == ev.HEARTBEAT and (e.step or 0) >= 13)
    slurm.command("scancel", "--signal=TERM", job.job_id)
    slurm.wait_job(job.job_id, lambda r: r.get("JobState") == "PENDING" and r.get("Restarts") == "1", "requeued",
                   timeout=120)
    first = job.events()
    [end] = [event for event in first if event.kind == ev.JOB_END]
    assert (end.details["outcome"], end.details["exit_code"]) == ("stopped", 75), job.story()
    persisted = [event.step for event in first if event.kind == ev.CHECKPOINT_SAVE and event.step % 10]
    assert len(persisted) == 1 and persisted[0] >= 13, job.story()  # the newest step, not a periodic one
    assert not [event for event in first if event.kind in (ev.FAULT_DETECTED, ev.AGENT_LOST)], job.story()
    output = job.output()
    assert "undying agent 1: SIGTERM: asking the controller to stop the job" in output, job.story()
    assert output.count("Exited with exit code 75") == 2 and "requeueing job" in output, job.story()

    slurm.command("scontrol", "update", f"JobId={job.job_id}", "StartTime=now")
    record = slurm.wait_ended(job.job_id, timeout=180)
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "1"), job.story()
    assert wait_no_processes(job.mark) == []
    second = job.events()[len(first):]
    loads = [event for event in second if event.kind == ev.CHECKPOINT_LOAD and event.rank == 0]
    assert [(event.step, event.details["source"]) for event in loads] == [(persisted[0], "storage")], job.story()
    run = JobRun(0, output, job.run_dir, job.mark)
    assert run.result["final_step"] == STEPS
    assert run.result["param_sha256"] == reference_run.result["param_sha256"], job.story()


def test_a_killed_node_moves_its_ranks_to_the_spare_in_the_same_allocation(reference_run: JobRun,
                                                                           slurm: SlurmCluster,
                                                                           tmp_path: Path) -> None:
    """SIGKILL of everything of the job's node 1 at once (its slurmd, its slurmstepd, its `undying run`
    and workers), and slurmctld told the node is down: the controller sees node 1's agent gone, the
    spare (the allocation's third node) takes its ranks, the survivors keep their processes, and the
    job finishes in the same allocation (no requeue), bitwise equal to the fault-free run."""
    slurm.wait_idle()
    job = submit(slurm, tmp_path, RECOVER_SPEC, ["--nodes", "2", "--standby", "1"])
    job.wait_for_event("a heartbeat of node 1 at step 5",
                       lambda e: e.kind == ev.HEARTBEAT and e.rank in (2, 3) and (e.step or 0) >= 5)
    nodes = expand(slurm.job(job.job_id)["NodeList"])
    assert len(nodes) == 3, nodes
    assert slurm.kill_node(nodes[1]), "no process of node 1 found"
    slurm.mark_down(nodes[1])
    try:
        record = slurm.wait_ended(job.job_id, timeout=180)
        assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "0"), \
            job.story()
        assert wait_no_processes(job.mark) == []
    finally:
        slurm.revive_node(nodes[1])
    run = JobRun(0, job.output(), job.run_dir, job.mark)
    assert run.result["final_step"] == STEPS
    assert run.result["param_sha256"] == reference_run.result["param_sha256"], job.story()
    [lost] = [event for event in run.kinds(ev.AGENT_LOST) if event.node == 1]
    assert "connection closed" in lost.details["why"], job.story()
    [decision] = run.kinds(ev.DECISION)
    assert (decision.details["strategy"], decision.details["lost_ranks"]) == ("recover", [2, 3]), job.story()
    assert [event.details["spare"] for event in run.kinds(ev.STANDBY_ADOPT)] == [2], job.story()
    assert not run.kinds(ev.RESTART_BEGIN), job.story()
    first = {e.rank: e.details["pid"] for e in run.kinds(ev.WORKER_READY) if e.generation == 1}
    recovered = {e.rank: e.details["pid"] for e in run.kinds(ev.RECOVERED)}
    assert recovered[0] == first[0] and recovered[1] == first[1], "survivors must keep their processes"
    assert recovered[2] != first[2] and recovered[3] != first[3]

