"""The T2 root check and the checkpoint-failure reports, without processes."""

from __future__ import annotations

from pathlib import Path

from undying import events as ev
from undying.config import JobSpec
from undying.controller.persist_health import PersistHealth, failed_checkpoint_line
from undying.controller.state import JobState
from undying.protocol import AgentHello
from undying.root_probe import PROBE_PREFIX, remove_probe, t2_root, take_probe, write_probe, writes_t2


def test_a_probe_written_under_a_root_is_read_and_removed_under_the_same_root(tmp_path: Path) -> None:
    name, error = write_probe(str(tmp_path / "ckpt"))
    assert error == "" and name
    assert take_probe(str(tmp_path / "ckpt"), name) == ""
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_a_probe_under_another_root_is_not_found(tmp_path: Path) -> None:
    name, _ = write_probe(str(tmp_path / "host1" / "checkpoints"))
    problem = take_probe(str(tmp_path / "host0" / "checkpoints"), name)
    assert "not under the controller's checkpoint root" in problem
    remove_probe(str(tmp_path / "host1" / "checkpoints"), name)
    assert list((tmp_path / "host1" / "checkpoints").iterdir()) == []


def test_a_probe_under_a_url_root(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/ckpt/"
    name, error = write_probe(root)
    assert error == ""
    assert take_probe(root, name) == ""
    assert "not under" in take_probe(root, name)  # taken once
    assert not [path for path in (tmp_path / "ckpt").iterdir() if path.name.startswith(PROBE_PREFIX)]


def test_a_root_that_cannot_be_written_is_said_at_the_probe(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    name, error = write_probe(str(tmp_path / "file" / "ckpt"))
    assert name == "" and error.startswith(f"cannot write to checkpoint root {tmp_path}/file/ckpt")


def test_the_root_each_node_writes_and_whether_it_writes_one(tmp_path: Path) -> None:
    assert t2_root(JobSpec(), tmp_path) == str(tmp_path / "checkpoints")
    assert t2_root(JobSpec(checkpoint={"dir": "s3://b/x"}), tmp_path) == "s3://b/x"
    assert writes_t2(JobSpec())
    assert not writes_t2(JobSpec(checkpoint={"persist": False}))
    assert writes_t2(JobSpec(checkpoint={"persist": False}, process_recover=True, recover_strategy=["dump"]))


def test_a_node_without_the_shared_root_fails_a_job_that_has_not_started(make_job) -> None:
    job = make_job(nnodes=2, nproc_per_node=1)
    assert job.hello(0).accepted
    reply = job.controller._apply(lambda now: job.controller.machine.hello(
        now, AgentHello(1, 1001, "host1", 1), "its probe file is not under the controller's checkpoint root /r"))
    assert not reply.accepted and "--checkpoint-dir" in reply.reason
    assert job.controller.state is JobState.FAILED and job.controller.exit_code == 2
    assert job.controller.message.startswith("node 1 (host1) does not share the T2 checkpoint root: its probe")
    [unshared] = job.events(ev.CHECKPOINT_ROOT_UNSHARED)
    assert unshared.node == 1


def test_a_late_node_without_the_shared_root_is_refused_and_the_job_goes_on(make_job) -> None:
    job = make_job(nnodes=1, nproc_per_node=1)
    job.start_running()
    reply = job.controller._apply(lambda now: job.controller.machine.hello(
        now, AgentHello(1, 1001, "spare", 1, standby=True), "cannot write to checkpoint root /r: denied"))
    assert not reply.accepted and "node 1 (spare)" in reply.reason
    assert job.controller.state is JobState.RUNNING


def test_each_failed_checkpoint_is_said_once_and_repeated_failures_warn_with_the_newest_durable_step() -> None:
    health = PersistHealth()
    health.saved(10, now=100.0)
    first = health.failed(20, 2, "OSError: [Errno 28] No space left on device", now=110.0)
    assert first is not None and not first["warning"]
    assert health.failed(20, 0, "missing at commit", now=110.5) is None  # another rank, the same step
    second = health.failed(30, 0, "OSError: [Errno 28] No space left on device", now=400.0)
    assert second is not None
    assert (second["warning"], second["newest_durable_step"], second["newest_durable_age"]) == (True, 10, 300.0)
    line = failed_checkpoint_line(30, second)
    assert line.startswith("checkpoint of step 30 NOT persisted (rank 0: OSError")
    assert line.endswith("WARNING: 2 checkpoints in a row failed; the newest durable checkpoint is step 10, 5 min old")
    health.saved(40, now=410.0)
    assert health.failed(50, 1, "x", now=420.0)["failed_in_row"] == 1

    never = PersistHealth()
    never.failed(10, 0, "x", now=1.0)
    assert "starts from step 0" in failed_checkpoint_line(20, never.failed(20, 0, "x", now=2.0))
