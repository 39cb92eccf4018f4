"""A node's health check before it is given ranks: its devices, node memory, checkpoint storage, the store.

Runs in the agent (``check_node``); the device part runs in a child process (``python -m
undying.agent.node_check``, forked from the node's warm standby when it has one: torch is imported there,
never in the agent). The agent checks before each hello (its first, a spare's adoption of a lost
node's place, a hello it is told to say again) and once a job restart has stopped its workers; the
result travels in that hello or the next poll (protocol.AgentHello.check, AgentPoll.check), and the
controller gives a node that fails no ranks (controller/fitness.py). The T2 root probe
(root_probe.py) is one of its items: the probe the controller reads is written here.

What is checked, each a problem in one line when it fails:

- devices: a GPU job (``backend: nccl``, or ``auto`` with a GPU for every local rank, as
  runtime/devices.py chooses) sees ``nproc_per_node`` GPUs, and a small matmul on each gives finite
  numbers; a CPU job's small matmul does. Its time is reported (``timings.kernel_seconds``).
- node memory: the T1 root (``UNDYING_SHM_DIR``, else /dev/shm) takes a file, and has
  ``MIN_FREE_BYTES`` free (a full /dev/shm).
- checkpoint storage: the T2 root takes the probe file, and a local root has room for the newest
  committed checkpoint under it (``MIN_FREE_BYTES`` before the first).
- the store: a TCP connection to the job's store opens (once the agent knows its address).
- ``check:node=N`` (inject.py): every check of the agent started as node N fails.

Not checked: that the node reaches its peers (the generation's first collective does; a node that
cannot makes the job recover).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from undying.config import JobSpec
from undying.inject import CHECK, Injection
from undying.root_probe import t2_root, write_probe, writes_t2
from undying.shm import shm_root

MIN_FREE_BYTES = 1 << 20  # node memory or storage with less than this free is full
DEVICE_CHECK_TIMEOUT_S = 120.0  # the device check's child (a standby may still be importing torch)
STORE_CONNECT_TIMEOUT_S = 3.0
KERNEL_SIZE = 256  # the matmul's side: a few MFLOP, milliseconds on any device
PROBE_FILE = ".undying-node-check"


@dataclass
class NodeCheck:
    """One check's result: its problems (none: the node is fit) and how long its parts took."""

    problems: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    root_probe: str = ""  # the T2 probe written for the controller to read (root_probe.py), if any

    def to_dict(self) -> dict[str, Any]:
        return {"problems": list(self.problems), "timings": dict(self.timings)}


class Forker(Protocol):
    """The node's warm standby as the check uses it (warm_standby.WarmStandby)."""

    def fork(self, env: dict[str, str], command: list[str], log: Path, err_log: Path | None = None) -> Any: ...


def check_node(spec: JobSpec, run_dir: Path, log: Path, injections: list[Injection], launched_as: int,
               store: tuple[str, int] | None = None, standby: Forker | None = None, probe_root: bool = True
               ) -> NodeCheck:
    """Check this node (see the module's docstring). ``launched_as``: the node id the agent was started
    with (``check:`` injections aim at it); ``store``: the job's store, when known; ``probe_root``:
    write the T2 probe for the controller (at a hello), else only a file of its own."""
    check = NodeCheck()
    started = time.perf_counter()
    check.problems += _devices(spec, log, standby, check.timings)
    check.problems += _writable("node memory", shm_root(), MIN_FREE_BYTES)
    if writes_t2(spec):
        root = t2_root(spec, run_dir)
        if probe_root:
            check.root_probe, error = write_probe(root)
            if error:
                check.problems.append(error)
            elif "://" not in root:
                check.problems += _room("checkpoint storage", Path(root), _newest_checkpoint_bytes(Path(root)))
        elif "://" not in root:
            check.problems += _writable("checkpoint storage", Path(root), _newest_checkpoint_bytes(Path(root)))
    if store is not None:
        check.problems += _reachable(store)
    check.problems += [f"injected failing check ({injection.text()})" for injection in injections
                       if injection.kind == CHECK and injection.node == launched_as]
    check.timings["check_seconds"] = round(time.perf_counter() - started, 4)
    return check


def _writable(what: str, directory: Path, need: int) -> list[str]:
    """A file can be written (and synced) in ``directory``, which has ``need`` bytes free."""
    probe = directory / f"{PROBE_FILE}-{socket.gethostname()}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as handle:
            handle.write(b"undying")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        return [f"{what} {directory} is not writable: {error}"]
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass  # not there to remove (the directory is not one)
    return _room(what, directory, need)


def _room(what: str, directory: Path, need: int) -> list[str]:
    free = shutil.disk_usage(directory).free
    if free < need:
        return [f"{what} {directory} is full: {free >> 10} KiB free, {need >> 10} KiB needed"]
    return []


def _newest_checkpoint_bytes(root: Path) -> int:
    """The size of the newest committed checkpoint under a local T2 root (its room for the next one);
    ``MIN_FREE_BYTES`` when it holds none."""
    try:
        committed = sorted(entry for entry in root.iterdir() if entry.name.startswith("step_")
                           and "." not in entry.name and (entry / "MANIFEST.json").exists())
    except OSError:
        return MIN_FREE_BYTES
    if not committed:
        return MIN_FREE_BYTES
    return max(MIN_FREE_BYTES, sum(path.stat().st_size for path in committed[-1].rglob("*") if path.is_file()))


def _reachable(store: tuple[str, int]) -> list[str]:
    try:
        with socket.create_connection(store, timeout=STORE_CONNECT_TIMEOUT_S):
            return []
    except OSError as error:
        return [f"the job's store {store[0]}:{store[1]} is not reachable: {error}"]


def _devices(spec: JobSpec, log: Path, standby: Forker | None, timings: dict[str, float]) -> list[str]:
    """The device part, in a child process (torch); its result comes back in a file."""
    result = log.with_name(f"{log.stem}.result.json")
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", "undying.agent.node_check", "--result", str(result),
               "--nproc", str(spec.nproc_per_node), "--backend", spec.backend]
    log.parent.mkdir(parents=True, exist_ok=True)
    process = standby.fork(dict(os.environ), command, log) if standby is not None else None
    if process is None:
        with open(log, "ab") as output:
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        code = process.wait(DEVICE_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        return [f"the device check did not finish within {DEVICE_CHECK_TIMEOUT_S:g} s"]
    try:
        found = json.loads(result.read_text())
    except (OSError, ValueError):
        return [f"the device check failed (exit code {code}; its output: {log})"]
    timings.update(found.get("timings", {}))
    return [str(problem) for problem in found.get("problems", [])]


def device_check(nproc: int, backend: str) -> dict[str, Any]:
    """In the child: the devices the job's ranks will use, each with a small timed matmul."""
    import torch

    from undying.runtime.devices import choose_backend

    problems: list[str] = []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    chosen = choose_backend(backend, nproc)
    if chosen == "nccl" and gpus < nproc:
        problems.append(f"{gpus} GPU(s) visible, backend nccl needs one for each of the {nproc} local ranks")
    devices = [torch.device("cuda", index) for index in range(min(nproc, gpus))] if chosen == "nccl" \
        else [torch.device("cpu")]
    slowest = 0.0
    for device in devices:
        try:
            matrix = torch.ones(KERNEL_SIZE, KERNEL_SIZE, device=device) / KERNEL_SIZE
            started = time.perf_counter()
            product = matrix @ matrix
            total = float(product.sum().item())  # a sync on a GPU
            slowest = max(slowest, time.perf_counter() - started)
        except Exception as error:  # noqa: BLE001 - whatever a broken device raises is the problem
            problems.append(f"device {device} failed a small matmul: {type(error).__name__}: {error}")
            continue
        if not math.isclose(total, KERNEL_SIZE, rel_tol=1e-3):
            problems.append(f"device {device} computed a wrong matmul (sum {total}, expected {KERNEL_SIZE})")
    return {"problems": problems, "timings": {"kernel_seconds": round(slowest, 6), "devices": len(devices)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="undying-node-check", description="the device part of a node's check")
    parser.add_argument("--result", required=True)
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args(argv)
    Path(args.result).write_text(json.dumps(device_check(args.nproc, args.backend)))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not the interpreter's own exit: its teardown of torch's objects takes seconds (the result is written).
    os._exit(code)
