"""A short chaos soak (tests/faults/chaos.py; the long one is bench/chaos.py): one seeded run on
separate hosts with one fault of each of seven kinds, inside the step (mid all-reduce, after the
commit vote, inside ``optimizer.step()``) and around it (a kill with a second kill during its
recovery, a kill in the persister), a planned leave and a network partition, each at a step of its
own. It ends where the fault-free run ends on every rank (parameters, optimizer state, RNG), every
fault happened, and nothing of the job is left: no process, no /dev/shm directory, no partial
checkpoint (the staging directory the persister's kill left is removed at the end) or temporary
file, no network namespace."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import assert_ends_bitwise
from tests.faults.chaos import (
    assert_nothing_left,
    draw_plan,
    hosts_needed,
    not_fired,
    reference,
    soak,
)
from tests.faults.chaos_table import fault_table, markdown
from tests.faults.netns import NetnsUnavailable, Network

pytestmark = pytest.mark.faults

# Seed 8 deals the seven kinds, one each, within 60 steps, the partition one that loses the host
# (5 s, past detection): kill@after_vote 5, hang@optimizer 11, kill+recovery 20, partition 25,
# raise@allreduce 33, leave 41, kill@persist 50.
SEED = 8
STEPS = 60
SPARES = 2
CHECKPOINT_INTERVAL = 10
PLAN = {"first": 5, "spacing": 5, "node_spacing": 10, "checkpoint_interval": CHECKPOINT_INTERVAL}
KINDS: tuple[str, ...] = ("raise@allreduce", "kill@after_vote", "hang@optimizer", "kill+recovery", "kill@persist", "leave",
         "partition")


def test_a_seeded_chaos_soak_ends_bitwise_with_nothing_left(tmp_path: Path) -> None:
    try:
        network: Network | None = Network(hosts=hosts_needed(draw_plan(SEED, STEPS, KINDS, **PLAN), SPARES))
        kinds = KINDS
    except NetnsUnavailable:
        network, kinds = None, tuple(kind for kind in KINDS if kind != "partition")
    plan = draw_plan(SEED, STEPS, kinds, **PLAN)
    assert {fault.kind for fault in plan} == set(kinds), plan
    try:
        outcome = soak(tmp_path / "soak", plan, STEPS, spares=SPARES, network=network, timeout=300,
                       checkpoint_interval=CHECKPOINT_INTERVAL)
    finally:
        if network is not None:
            network.close()
    run = outcome.run
    story = f"{plan}\n{markdown(fault_table(outcome))}\n{run.output[-4000:]}"
    assert run.returncode == 0, story + run.logs()
    assert run.result["final_step"] == STEPS, story
    assert not_fired(outcome) == [], story
    assert_ends_bitwise(run, reference(tmp_path / "reference", STEPS, CHECKPOINT_INTERVAL), story, rng=True)
    hosts = [tmp_path / "soak" / f"node{index}" for index in range(outcome.hosts_started)]
    [start] = run.kinds("job_start")
    assert_nothing_left(outcome, [*hosts, tmp_path / "soak" / "checkpoints"], start.details.get("store_port"), network)
    if network is not None:
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert network.tag not in left, left
