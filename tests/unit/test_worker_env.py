"""The agent-to-worker environment: what the agent writes is what the worker reads, and a script
started without an agent gets a one-rank standalone job."""

from __future__ import annotations

from pathlib import Path

import pytest

from undying.config import JobSpec
from undying.worker_env import ENV_CONTROLLER, ENV_JOINING, ENV_NODE, ENV_SPEC, WorkerEnv


def test_what_the_agent_writes_the_worker_reads_back() -> None:
    written = WorkerEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, node=1, generation=3,
                        restart_count=2, joining=True, controller="10.0.0.1:7000", token="secret",
                        job_id="job-1", run_dir=Path("/runs/x"), spec=JobSpec(nproc_per_node=4),
                        injections_text="kill:rank=1:step=5", store_prefix="undying/job-1",
                        master_addr="10.0.0.1", master_port=29500)
    environ = written.to_environ()
    assert environ["RANK"] == "5" and environ["GROUP_RANK"] == "1" and environ[ENV_JOINING] == "1"
    assert WorkerEnv.from_environ(environ) == written
    assert written.store_address == ("10.0.0.1", 29500)


def test_no_agent_means_a_standalone_one_rank_job() -> None:
    env = WorkerEnv.from_environ({})
    assert (env.rank, env.world_size, env.generation, env.joining) == (0, 1, 1, False)
    assert env.controller is None and env.job_id is None and env.store_address is None
    assert env.spec == JobSpec()


def test_node_falls_back_to_torchruns_group_rank() -> None:
    assert WorkerEnv.from_environ({"GROUP_RANK": "2"}).node == 2
    assert WorkerEnv.from_environ({"GROUP_RANK": "2", ENV_NODE: "3"}).node == 3


def test_a_partial_spec_takes_the_defaults_for_the_rest() -> None:
    env = WorkerEnv.from_environ({ENV_SPEC: '{"checkpoint": {"interval": 7}}'})
    assert env.spec.checkpoint.interval == 7


def test_a_controller_without_a_store_address_is_refused() -> None:
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        _ = WorkerEnv.from_environ({ENV_CONTROLLER: "h:1"}).store_address


def test_the_members_of_a_shrunk_restart_travel_and_default_to_every_rank() -> None:
    written = WorkerEnv(rank=4, world_size=6, members=(0, 1, 4, 5))
    assert WorkerEnv.from_environ(written.to_environ()).members == (0, 1, 4, 5)
    assert WorkerEnv.from_environ(WorkerEnv(world_size=6).to_environ()).members == ()
