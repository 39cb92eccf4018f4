"""Health checks before a node is used, with real processes: a node whose check fails (an injected
failing check; a full /dev/shm and an unwritable checkpoint directory on a host of its own) is never
given ranks, and a spare takes its place; the run ends with the fault-free run's parameters."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import STEPS, JobRun, run_job
from tests.faults.test_real_hosts import Hosts
from undying import events as ev
from undying.events import Event, read_events

pytestmark = pytest.mark.faults


def assert_spare_served_node1(events: list) -> Event:
    [failed] = [event for event in events if event.kind == ev.NODE_CHECK_FAILED]
    assert (failed.node, failed.details["when"]) == (1, "hello")
    # The spare's id: the one the fit standby agent registered under (the unfit node 1 agent is a
    # spare too, never given ranks; whichever of the two says hello first takes the lower id).
    [spare] = [event.node for event in events if event.kind == ev.AGENT_REGISTERED and event.details["standby"]
               and not event.details.get("unfit")]
    [adopt] = [event for event in events if event.kind == ev.STANDBY_ADOPT]
    assert (adopt.node, adopt.details["spare"]) == (1, spare)
    spare_pid = next(event.details["pid"] for event in events
                     if event.kind == ev.AGENT_REGISTERED and event.node == spare and event.details["standby"])
    served = [event.details["pid"] for event in events
              if event.kind == ev.AGENT_REGISTERED and event.node == 1 and not event.details["standby"]]
    assert served == [spare_pid]  # node 1's place was only ever held by the spare
    assert [event.generation for event in events if event.kind == ev.GENERATION_START] == [1]
    return failed


def test_an_injected_failing_check_gives_the_node_no_ranks(reference_run: JobRun, tmp_path: Path) -> None:
    run = run_job(tmp_path, ["--standby", "1", "--inject", "check:node=1"])
    assert run.returncode == 0, run.output + run.logs()
    failed = assert_spare_served_node1(run.events)
    assert failed.details["problems"] == ["injected failing check (check:node=1)"]
    assert "node 1 (" in run.output and "failed its health check: injected failing check" in run.output
    assert run.result["param_sha256"] == reference_run.result["param_sha256"]


@pytest.fixture
def full_tmpfs(tmp_path: Path):
    """A 1 MiB tmpfs, filled: a node's /dev/shm that really is full."""
    mount = tmp_path / "full-shm"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    subprocess.run(["dd", "if=/dev/zero", f"of={mount / 'filler'}", "bs=64k"], capture_output=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


class BrokenNode1(Hosts):
    """Node 1's host has a full /dev/shm (UNDYING_SHM_DIR on a full tmpfs) and sees the shared
    checkpoint directory read-only (a read-only bind mount in a mount namespace of its own)."""

    def __init__(self, root: Path, shm: Path) -> None:
        super().__init__(root, [])
        self.shm = shm

    def start(self, node: int, spare: bool = False) -> None:
        if node != 1:
            super().start(node, spare)
            return
        checkpoints = self.root / "checkpoints"
        checkpoints.mkdir(exist_ok=True)
        wrap = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"', "sh",
                str(checkpoints)]
        self.wrap, self.extra_env = wrap, {"UNDYING_SHM_DIR": str(self.shm)}
        super().start(node, spare)


def test_a_host_with_a_full_shm_and_a_read_only_checkpoint_dir_gives_its_place_to_a_spare(
        reference_run: JobRun, tmp_path: Path, full_tmpfs: Path) -> None:
    cluster = BrokenNode1(tmp_path, full_tmpfs)
    try:
        for node in (0, 1):
            cluster.start(node)
        cluster.start(2, spare=True)
        code, output = cluster.wait(0)
        codes = [cluster.wait(node, timeout=60)[0] for node in (1, 2)]
    finally:
        cluster.close()
    assert code == 0 and codes == [0, 0], output
    events = read_events(cluster.run_dir(0))
    failed = assert_spare_served_node1(events)
    problems = failed.details["problems"]
    assert any(problem.startswith(f"node memory {full_tmpfs}") for problem in problems), problems
    assert any("cannot write to checkpoint root" in problem and "Read-only file system" in problem
               for problem in problems), problems
    result = json.loads((cluster.run_dir(0) / "result.json").read_text())
    assert (result["final_step"], result["param_sha256"]) == (STEPS, reference_run.result["param_sha256"])
