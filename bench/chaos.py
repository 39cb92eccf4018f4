"""The long chaos soak: one job on separate hosts for as many steps as asked, faults of every kind
drawn from a seed, then the fault-free run of the same job, and what must hold at the end.

The job: examples/gpt/train.py, 2 nodes x 2 workers (each node one `undying run --node-rank` in a
network namespace of its own, tests/faults/netns.py, where the machine allows it; else all on
loopback, without partitions), dropout on (every step draws random numbers) and five gradient
buckets, T2 every ``--checkpoint-interval`` steps, two spares kept in stock, the bitwise recovery
chain (retry, recover-in-place, recover, dump). The faults (tests/faults/chaos.py, which this runs,
not a copy): SIGKILL, SIGSTOP (hang), an exception (raise) and a blocked training thread (stall) at
a step's start and, the first three, at the three points inside the step (mid all-reduce, after the
commit vote, inside ``optimizer.step()``); a kill with a second kill during its recovery; a kill in
the persister mid-write; node 1's host SIGKILLed, sent SIGTERM (a planned leave) or cut off from the
network for 0.5 s or 5 s. Each kind comes as often as the others, in the seed's order, on ranks drawn
with it; ``--spacing`` steps at least between two faults.

Prints the plan, a table per kind of fault (planned, recoveries, the strategies that handled them,
MTTR from the fault to the job's first step after the recovery, detection) and the checks: the job
succeeded; every fault happened; every rank's parameters, optimizer state and RNG equal the
fault-free run's (their SHA-256); nothing left behind (processes of the job, its /dev/shm
directory, partial checkpoints and temporary files, unexpected files in the run directories, hosts
still running, the namespaces; on loopback the controller's and the store's ports). Exits 1 if a
check fails.

    python bench/chaos.py --seed 1 --steps 600 --out bench/results/chaos.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))
from tests.conftest import assert_ends_bitwise  # noqa: E402
from tests.faults.chaos import (  # noqa: E402
    CHECKPOINT_INTERVAL,
    KINDS,
    Soak,
    assert_nothing_left,
    draw_plan,
    hosts_needed,
    not_fired,
    reference,
    soak,
)
from tests.faults.chaos_table import fault_table, markdown  # noqa: E402
from tests.faults.netns import NetnsUnavailable, Network  # noqa: E402

PARTITION = "partition"


def parse_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown) or '(none given)'}; "
                                         f"allowed: {', '.join(KINDS)}")
    return kinds


def check(checks: dict[str, str], name: str, body: Callable[[], None]) -> None:
    """Record ``yes``, or ``NO`` with the first line of why."""
    try:
        body()
        checks[name] = "yes"
    except Exception as error:  # noqa: BLE001 - a failed check (or a run without its files) is the answer
        checks[name] = "NO: " + (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def run_checks(outcome: Soak, fault_free_root: Path, root: Path, steps: int, checkpoint_interval: int,
               network: Network | None) -> tuple[dict[str, str], float]:
    """The checks, with the fault-free run (and its seconds) in between: it starts once the soak's
    processes are gone, so that they are not counted as left behind by it, nor it by them."""
    run, checks = outcome.run, dict[str, str]()

    def succeeded() -> None:
        assert run.returncode == 0, f"the job exited {run.returncode}: {run.output[-300:]}"
        assert run.result["final_step"] == steps, f"final step {run.result['final_step']}"

    check(checks, "the job succeeded", succeeded)
    check(checks, "every fault happened", lambda: _empty(not_fired(outcome)))
    check(checks, "nothing left behind", lambda: nothing_left(outcome, root, network))
    started = time.monotonic()
    fault_free = reference(fault_free_root, steps, checkpoint_interval)
    fault_free_seconds = time.monotonic() - started
    check(checks, "every rank bitwise equal (parameters, optimizer state, RNG)",
          lambda: assert_ends_bitwise(run, fault_free, "-", rng=True))
    return checks, fault_free_seconds


def nothing_left(outcome: Soak, root: Path, network: Network | None) -> None:
    [start] = outcome.run.kinds("job_start")
    hosts = [root / f"node{index}" for index in range(outcome.hosts_started)]
    assert_nothing_left(outcome, [*hosts, root / "checkpoints"], start.details.get("store_port"), network)
    if network is not None:
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert network.tag not in namespaces, f"namespaces left: {namespaces}"


def _empty(missing: list[str]) -> None:
    assert not missing, f"never happened: {missing}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1, help="draws the faults' kinds, order and ranks")
    parser.add_argument("--steps", type=int, default=600, help="the job's training steps")
    parser.add_argument("--kinds", type=parse_kinds, default=KINDS, help=f"comma-separated, of: {', '.join(KINDS)}")
    parser.add_argument("--spacing", type=int, default=12, help="steps between two faults, at least")
    parser.add_argument("--node-spacing", type=int, default=60,
                        help="steps between two faults that take node 1's host, at least (a spare warms up)")
    parser.add_argument("--spares", type=int, default=2, help="spare hosts kept in stock")
    parser.add_argument("--checkpoint-interval", type=int, default=CHECKPOINT_INTERVAL)
    parser.add_argument("--keep", type=Path, help="keep the run directories here (default: a removed temporary one)")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args()
    for name in ("steps", "spacing", "node_spacing", "spares", "checkpoint_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")

    plan_args = {"first": args.spacing, "spacing": args.spacing, "node_spacing": args.node_spacing,
                 "checkpoint_interval": args.checkpoint_interval}
    kinds: tuple[str, ...] = args.kinds
    network: Network | None = None
    try:
        network = Network(hosts=hosts_needed(draw_plan(args.seed, args.steps, kinds, **plan_args), args.spares))
    except NetnsUnavailable as error:
        print(f"no network namespaces ({error}): every host on loopback, no partitions", flush=True)
        kinds = tuple(kind for kind in kinds if kind != PARTITION)
    plan = draw_plan(args.seed, args.steps, kinds, **plan_args)
    print(f"seed {args.seed}, {args.steps} steps, {len(plan)} faults:", flush=True)
    print(", ".join(f"{fault.step} {fault.label()}" for fault in plan), flush=True)

    base = args.keep or Path(tempfile.mkdtemp(prefix="undying-chaos-"))
    root = base / "soak"
    try:
        try:
            outcome = soak(root, plan, args.steps, spares=args.spares, network=network,
                           timeout=max(900.0, args.steps * 3.0), checkpoint_interval=args.checkpoint_interval)
        finally:
            if network is not None:
                network.close()
        table = fault_table(outcome)
        recoveries = sum(row["recoveries"] for row in table)
        print()
        print(markdown(table))
        print(f"\nsoak {outcome.seconds:.0f} s ({len(plan)} faults, {recoveries} recoveries, {outcome.hosts_started} "
              f"hosts started, {'network namespaces' if network is not None else 'loopback'})", flush=True)
        checks, fault_free_seconds = run_checks(outcome, base / "fault-free", root, args.steps,
                                                args.checkpoint_interval, network)
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"fault-free run {fault_free_seconds:.0f} s")
    for name, verdict in checks.items():
        print(f"{name}: {verdict}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": " ".join(["python", "bench/chaos.py", *sys.argv[1:]]), "seed": args.seed, "steps": args.steps,
            "faults": len(plan), "recoveries": recoveries, "plan": [[fault.step, fault.label(), list(fault.specs)]
                                                                     for fault in plan],
            "table": table, "checks": checks, "soak_seconds": round(outcome.seconds, 1),
            "fault_free_seconds": round(fault_free_seconds, 1), "hosts_started": outcome.hosts_started,
            "network_namespaces": network is not None, "load_average": round(os.getloadavg()[0], 2)}, indent=1))
    if any(verdict != "yes" for verdict in checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
