"""A job that cannot checkpoint says so: nodes that do not share the T2 root are refused at start,
checkpoints that fail to persist (a disk that really fills) are on the console and resume once it
has room again, and node shared memory too small for a T1 snapshot leaves T1 in private memory.

Real processes: two `undying run --node-rank` hosts on loopback, or simulated nodes with the
checkpoint root (or the T1 root, UNDYING_SHM_DIR) on a small tmpfs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.conftest import MARK_ENV, REPO, STEPS, JobRun, run_job, undying_command, wait_no_processes
from tests.faults.test_process_recovery import PROCESS_LEVEL
from undying import events as ev
from undying.checkpoint import checkpoint_dirname, latest_verified, list_committed
from undying.events import read_events

pytestmark = pytest.mark.faults
FILL_DISK = REPO / "tests" / "scripts" / "fill_disk.py"
HOST_ARGS = ["--nnodes", "2", "--nproc-per-node", "1", "--monitor-interval", "0.3",
             "--set", "heartbeat_interval=0.5", "--set", "heartbeat_timeout=4", "--checkpoint-interval", "5"]


def run_two_hosts(root: Path, shared: bool, steps: int = 20) -> list[subprocess.CompletedProcess]:
    """Node 0 and node 1 as separate `undying run` processes, each with its own run directory; with
    ``shared``, both given one --checkpoint-dir (as on a cluster with shared storage)."""
    (root / "token").write_text("t" * 32)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mark = uuid.uuid4().hex
    env = dict(os.environ, **{MARK_ENV: mark, "PYTHONUNBUFFERED": "1"})
    processes = []
    for node in (0, 1):
        args = ["run", *HOST_ARGS, "--node-rank", str(node), "--controller", f"127.0.0.1:{port}",
                "--token-file", str(root / "token"), "--run-dir", str(root / f"host{node}")]
        if shared:
            args += ["--checkpoint-dir", str(root / "shared-checkpoints")]
        processes.append(subprocess.Popen(undying_command([*args, str(FILL_DISK), "--steps", str(steps)]),
                                          env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
    results = []
    for process in processes:
        output, _ = process.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, output))
    assert not wait_no_processes(mark)
    return results


def test_hosts_without_a_shared_checkpoint_root_are_refused_at_start(tmp_path: Path) -> None:
    """The README's two-host shape with a run directory per host and no --checkpoint-dir: node 1's
    probe is not where the controller reads, so the job fails at once (exit 2) with one line naming
    the node and the flag, before any worker starts."""
    node0, node1 = run_two_hosts(tmp_path, shared=False)
    assert node0.returncode == 2, node0.stdout
    [line] = [line for line in node0.stdout.splitlines() if line.startswith("undying: job failed")]
    assert "node 1" in line and "does not share the T2 checkpoint root" in line and "--checkpoint-dir" in line
    assert node1.returncode != 0 and "does not share the T2 checkpoint root" in node1.stdout
    events = read_events(tmp_path / "host0")
    assert [event.node for event in events if event.kind == ev.CHECKPOINT_ROOT_UNSHARED] == [1]
    assert not [event for event in events if event.kind == ev.GENERATION_START]


def test_hosts_with_a_shared_checkpoint_root_commit_every_checkpoint(tmp_path: Path) -> None:
    node0, node1 = run_two_hosts(tmp_path, shared=True)
    assert (node0.returncode, node1.returncode) == (0, 0), node0.stdout + node1.stdout
    events = read_events(tmp_path / "host0")
    assert {event.step for event in events if event.kind == ev.CHECKPOINT_SAVE} == {5, 10, 15, 20}
    assert not [event for event in events if event.kind in (ev.PERSIST_FAILED, ev.CHECKPOINT_FAILED)]
    assert not list((tmp_path / "shared-checkpoints").glob(".undying-probe*"))  # probes taken away


def tmpfs(mount: Path, size: str):
    """A tmpfs of ``size`` at ``mount``: a filesystem that really fills (skipped where mounting is refused)."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path):
    yield from tmpfs(tmp_path / "small-disk", "2m")


@pytest.fixture
def small_shm(tmp_path: Path):
    """Node shared memory of 1 MiB: no T1 slot fits (each keeps 1 MiB of room for its metadata)."""
    yield from tmpfs(tmp_path / "small-shm", "1m")


def test_node_memory_too_full_for_t1_snapshots_leaves_them_in_private_memory(reference_run: JobRun, tmp_path: Path,
                                                                               small_shm: Path) -> None:
    """Every rank's first T1 snapshot finds node shared memory full: each says so (event and console, with
    the cause) and keeps its snapshots in its own memory; training goes on. Rank 1 is killed at step 12:
    its replacement finds no snapshot of its node to load (nothing partial is ever taken), gets the
    state from a live replica, and the job ends bitwise equal to the fault-free run. Nothing is left in
    the node's shared memory."""
    # node_check off: the node's health check would refuse a node whose shared memory has no room for
    # a snapshot before it gets ranks (tests/faults/test_node_check.py); this is memory that fills later.
    run = run_job(tmp_path / "run", [*PROCESS_LEVEL, "--set", "node_check=false", "--inject", "kill:rank=1:step=12"],
                  env={"UNDYING_SHM_DIR": str(small_shm)})
    assert run.returncode == 0, run.output + run.logs()
    assert run.result["final_step"] == STEPS
    assert run.result["param_sha256"] == reference_run.result["param_sha256"]
    unavailable = run.kinds(ev.SNAPSHOT_UNAVAILABLE)
    assert {event.rank for event in unavailable} >= {0, 2, 3}, unavailable
    assert all("No space left on device" in event.details["reason"] for event in unavailable), unavailable
    assert "T1 snapshots in this process's private memory" in run.output
    [received] = [e for e in run.kinds(ev.STATE_RECEIVED) if e.rank == 1]
    assert received.details["source"] == "replica", received.details
    assert list(small_shm.iterdir()) == []


def test_checkpoints_that_fail_on_a_full_disk_are_on_the_console_and_resume_when_space_frees(
        tmp_path: Path, small_disk: Path) -> None:
    """Rank 0 fills the checkpoint disk at step 12 and frees it at step 22: the checkpoints of steps 15
    and 20 fail; each is one console line with its cause, the second a warning naming the newest
    durable checkpoint (step 10). The job trains on; the checkpoints of steps 25 and 30 commit. No
    failed checkpoint is ever listed (nor its staging left behind), and the newest verified one is 30."""
    root = small_disk / "ckpt"
    run = run_job(tmp_path / "run", ["--checkpoint-dir", str(root), "--checkpoint-interval", "5"],
                  steps=30, script=FILL_DISK, timeout=180,
                  script_args=["--fill", str(small_disk / "filler"), "--fill-at", "12", "--free-at", "22"])
    assert run.returncode == 0, run.output + run.logs()
    failed = run.kinds(ev.CHECKPOINT_FAILED)
    assert [event.step for event in failed] == [15, 20]
    assert "No space left on device" in failed[0].details["reason"]
    assert (failed[1].details["warning"], failed[1].details["newest_durable_step"]) == (True, 10)
    assert "checkpoint of step 15 NOT persisted" in run.output
    assert "WARNING: 2 checkpoints in a row failed; the newest durable checkpoint is step 10" in run.output
    assert {event.step for event in run.kinds(ev.CHECKPOINT_SAVE)} == {5, 10, 25, 30}
    assert sorted(checkpoint.step for checkpoint in list_committed(root)) == [25, 30]  # keep: 2
    assert latest_verified(root).step == 30
    assert sorted(path.name for path in root.iterdir() if not path.name.startswith(".undying-probe")) == \
        [checkpoint_dirname(25), checkpoint_dirname(30)]
