"""Shared fixtures: run ``undying run`` as a user would, and prove nothing was left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from undying.etcd import EtcdClient

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gpt" / "train.py"
MARK_ENV = "UNDYING_TEST_MARK"
FINAL_STATE = "final_state.pt"  # where a test run's rank 0 saves its final parameters
# `undying` with elastic training's reschedule wait below the spec's floor (see undying_command).
SHORT_RESCHEDULE = REPO / "tests" / "short_reschedule.py"

# The job every fault test runs: 2 simulated nodes x 2 workers, checkpoints every 10 steps.
STEPS = 30
BASE_ARGS = ["--nnodes", "2", "--nproc-per-node", "2", "--monitor-interval", "0.3",
             "--checkpoint-interval", "10",
             "--set", "heartbeat_interval=0.5", "--set", "heartbeat_timeout=4",
             "--set", "node_return_timeout=60", "--set", "comm_timeout=20",
             # Workers are forked from each node's warm standby (the default); the tests of plain
             # `python` workers set warm_standby=false.
             # Every committed step's sample indices, per rank: exactly-once checks read them.
             "--set", "sample_log=true",
             # Every rank's digests of its parameters, optimizer state and RNG at the end, in its
             # worker_done event: assert_ends_bitwise compares every rank, not rank 0 alone.
             "--set", "state_digests=true",
             # A T1 snapshot every step (the default, auto, picks the interval from measured costs,
             # so the step a job restart resumes from would depend on the machine's load): the
             # tests' resume points are exact. tests/faults/test_snapshot_auto.py runs auto.
             "--set", "checkpoint.snapshot_interval=1"]
# What assert_ends_bitwise compares of each rank by default (``rng_sha256`` on request).
RANK_DIGESTS = ("params_sha256", "optimizer_sha256")


@dataclass
class JobRun:
    returncode: int
    output: str
    run_dir: Path
    mark: str

    @property
    def result(self) -> dict:
        return json.loads((self.run_dir / "result.json").read_text())

    @property
    def events(self) -> list:
        from undying.events import read_events

        return read_events(self.run_dir)

    def kinds(self, kind: str) -> list:
        return [event for event in self.events if event.kind == kind]

    def samples(self) -> dict[int, list[dict]]:
        """The sample log (``sample_log: true``): step -> one record per rank that committed it."""
        by_step: dict[int, list[dict]] = {}
        for log in sorted((self.run_dir / "samples").glob("*.jsonl")):
            for line in log.read_text().splitlines():
                record = json.loads(line)
                by_step.setdefault(record["step"], []).append(record)
        return by_step

    def rank_digests(self) -> dict[int, dict[str, str]]:
        """Each rank's digests of its state at the end of the run (``state_digests: true``): from its
        last ``worker_done`` event (a job restart's ranks finish once more, after the first ones)."""
        digests: dict[int, dict[str, str]] = {}
        from undying import events as ev

        for event in self.kinds(ev.WORKER_DONE):
            if "params_sha256" in event.details:
                digests[event.rank] = {key: value for key, value in event.details.items() if key.endswith("_sha256")}
        return digests

    def logs(self) -> str:
        parts = []
        for log in sorted((self.run_dir / "logs").glob("*.log")):
            parts.append(f"===== {log.name}\n{log.read_text()[-3000:]}")
        return "\n".join(parts)


def assert_ends_bitwise(run: JobRun, reference: JobRun, story: str = "", rng: bool = False) -> None:
    """``run`` ended where the fault-free ``reference`` ended, bit for bit, on every rank: rank 0's
    whole parameters (``param_sha256`` in result.json) and each rank's own parameters and optimizer
    state (its shards in a sharded job), and with ``rng`` its torch RNG state, as their digests say."""
    context = story or run.output + run.logs()
    assert run.result["param_sha256"] == reference.result["param_sha256"], context
    ours, theirs = run.rank_digests(), reference.rank_digests()
    assert theirs, f"the reference run {reference.run_dir} has no per-rank digests (state_digests: true)"
    assert sorted(ours) == sorted(theirs), f"ranks that finished: {sorted(ours)}, in the reference: {sorted(theirs)}"
    keys = (*RANK_DIGESTS, "rng_sha256") if rng else RANK_DIGESTS
    differ = [(rank, key) for rank in sorted(theirs) for key in keys if ours[rank].get(key) != theirs[rank][key]]
    assert not differ, f"these ranks' state differs from the fault-free run's: {differ}\n{context}"


def processes_with_mark(mark: str) -> list[int]:
    """PIDs of live processes whose environment carries this test's mark."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            status = (entry / "stat").read_text()
        except OSError:
            continue
        if f"{MARK_ENV}={mark}".encode() in environ.split(b"\0") and ") Z " not in status:
            found.append(int(entry.name))
    return found


def wait_no_processes(mark: str, timeout: float = 10.0) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        left = processes_with_mark(mark)
        if not left:
            return []
        time.sleep(0.1)
    return processes_with_mark(mark)


def undying_command(args: list[str], reschedule_wait: float | None = None) -> list[str]:
    """``undying ARGS``; with ``reschedule_wait``, its controller waits that many seconds for a lost
    node instead of the spec's ``wait_reschedule_timeout`` (30 s at least)."""
    if reschedule_wait is not None:
        return [sys.executable, str(SHORT_RESCHEDULE), str(reschedule_wait), *args]
    return [sys.executable, "-m", "undying.cli", *args]


def start_job(run_dir: Path, extra: list[str], steps: int = STEPS,
              script_args: list[str] | None = None, env: dict[str, str] | None = None,
              reschedule_wait: float | None = None, script: Path = EXAMPLE) -> tuple[subprocess.Popen, str]:
    mark = uuid.uuid4().hex
    env = dict(os.environ, **(env or {}), **{MARK_ENV: mark, "PYTHONUNBUFFERED": "1"})
    command = undying_command(["run", *BASE_ARGS, "--run-dir", str(run_dir), *extra, str(script),
                               "--steps", str(steps), *(script_args or [])], reschedule_wait)
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=REPO)
    return process, mark


def run_job(run_dir: Path, extra: list[str] | None = None, steps: int = STEPS, timeout: float = 240,
            script_args: list[str] | None = None, env: dict[str, str] | None = None,
            reschedule_wait: float | None = None, script: Path = EXAMPLE) -> JobRun:
    process, mark = start_job(run_dir, extra or [], steps, script_args, env, reschedule_wait, script)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
        raise AssertionError(f"job did not finish in {timeout} s:\n{output}") from None
    leftovers = wait_no_processes(mark)
    assert not leftovers, f"processes left behind: {leftovers}"
    return JobRun(process.returncode, output, run_dir, mark)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    """The fault-free run every recovered run must match bit for bit."""
    return fault_free_run(tmp_path_factory, "reference", [])


def fault_free_run(tmp_path_factory: pytest.TempPathFactory, name: str, script_args: list[str]) -> JobRun:
    run_dir = tmp_path_factory.mktemp(name)
    run = run_job(run_dir, script_args=[*script_args, "--final-state", str(run_dir / FINAL_STATE)])
    assert run.returncode == 0, run.output + run.logs()
    return run


# The fault-free runs of the sharded example (once per session, shared by the modules that compare
# with them): HSDP on a 2 x 2 mesh (rows are replicas: node 0 holds replica 0, ranks 0 and 1; node 1
# replica 1) and pure FSDP on 1 x 4.
@pytest.fixture(scope="session")
def hsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    return fault_free_run(tmp_path_factory, "hsdp-reference", ["--mesh", "2x2"])


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    return fault_free_run(tmp_path_factory, "fsdp-reference", ["--mesh", "1x4"])


# Dropout draws random numbers every step: bitwise equality needs each replaced rank's exact RNG
# state (tests/faults/test_controller_failover.py, test_network_failover.py).
DROPOUT_ARGS = ["--dropout", "0.1"]


@pytest.fixture(scope="session")
def dropout_reference(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    return fault_free_run(tmp_path_factory, "dropout-reference", DROPOUT_ARGS)


@pytest.fixture(scope="session")
def hsdp_dropout_reference(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    """HSDP on 2 x 2 with dropout: what an elastic run with dropout is compared with."""
    return fault_free_run(tmp_path_factory, "hsdp-dropout-reference", ["--mesh", "2x2", *DROPOUT_ARGS])


@pytest.fixture
def url_root():
    """A fresh checkpoint root behind an fsspec URL (the in-process memory:// filesystem)."""
    from fsspec.core import url_to_fs

    root = f"memory://undying-test-{uuid.uuid4().hex}/ckpt"
    yield root
    fs, path = url_to_fs(root)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@dataclass
class EtcdServer:
    endpoint: str
    process: subprocess.Popen


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def etcd_binary() -> str:
    """The etcd binary; a test that needs it is skipped without it (an error where
    UNDYING_REQUIRE_ETCD=1, as in CI)."""
    import shutil

    binary = shutil.which("etcd")
    if binary is None:
        message = "etcd is not installed (make test installs Debian's etcd-server where it can)"
        if os.environ.get("UNDYING_REQUIRE_ETCD") == "1":
            raise AssertionError(message)
        pytest.skip(message)
    return binary


def wait_for_etcd(client: EtcdClient, process: subprocess.Popen, log: Path) -> None:
    """Until the started etcd answers ``client`` (30 s at most; it is killed if it does not), then close it."""
    from undying.etcd import EtcdUnavailable

    deadline = time.time() + 30
    while True:
        try:
            client.get("/health-probe")
            break
        except EtcdUnavailable:
            if time.time() > deadline or process.poll() is not None:
                process.kill()
                raise AssertionError(f"etcd did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.2)
    client.close()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory):
    """A single-member etcd on loopback for controller-failover tests (Debian's etcd-server)."""

    from undying.etcd import EtcdClient

    binary = etcd_binary()
    data = tmp_path_factory.mktemp("etcd")
    client_port, peer_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{client_port}"
    process = subprocess.Popen(
        [binary, "--name", "undying-test", "--data-dir", str(data / "data"),
         "--listen-client-urls", f"http://{endpoint}", "--advertise-client-urls", f"http://{endpoint}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"undying-test=http://127.0.0.1:{peer_port}"],
        stdout=open(data / "etcd.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115 - the child's
    client = EtcdClient(endpoint)
    wait_for_etcd(client, process, data / "etcd.log")
    yield EtcdServer(endpoint, process)
    process.terminate()
    process.wait(timeout=10)
