"""A real Slurm cluster on this machine for fault tests: munge, one slurmctld and three slurmd.

Runs in the test process (as root, with Debian's ``slurmctld``, ``slurmd``, ``munge`` and
``slurm-client``). Everything lives in a temporary directory of its own: a generated munge key and
socket, a ``slurm.conf`` on free ports, the daemons' state, spool, pid and log files. Every Slurm
command the tests run gets ``SLURM_CONF`` pointing there (``SlurmCluster.env``), so nothing of the
machine's own configuration is read or touched. The three nodes ``n1``..``n3`` are separate
``slurmd`` processes on this host (``slurmd -N NAME``), reachable at 127.0.0.1, each on its own
port: Slurm places one task of a step on each, as on three machines.

A node is killed (``kill_node``) the way a machine dies: its ``slurmd``, the ``slurmstepd`` of each
step on it and every process of the job's tasks there (they carry ``SLURMD_NODENAME``) get SIGKILL
at once; ``mark_down`` tells slurmctld at once what it finds out by itself about half a minute
later; ``revive_node`` starts its ``slurmd`` again and returns it to service.

The directory's name holds the creating process's pid: a cluster left running by a test process
that died is stopped by the next one (``remove_stale``), never a live process's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

NODES = ("n1", "n2", "n3")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED")
PARTITION = "debug"
PREFIX = "undying-slurm-"
# Seconds slurmctld waits for a silent slurmd before it marks the node DOWN: a step with a lost node
# (srun --no-kill) ends that long after the node died. Short here; Slurm's default is 300.
SLURMD_TIMEOUT = 6
PACKAGES = {"slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd", "munged": "/usr/sbin/munged",
            "sbatch": "sbatch", "srun": "srun", "scontrol": "scontrol", "sinfo": "sinfo", "scancel": "scancel"}


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the test cluster (not root, or a Slurm/munge binary is missing)."""


def why_unavailable() -> str | None:
    """Why the cluster cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the Slurm tests run slurmd and munged as root (run them as root)"
    missing = [name for name, binary in PACKAGES.items() if shutil.which(binary) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing; make test installs Debian's slurmctld, "
                "slurmd, slurm-client and munge where it can)")
    return None


def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def parse_record(line: str) -> dict[str, str]:
    """One ``scontrol show ... -o`` line as its KEY=VALUE fields (values may hold spaces only in the
    last few fields, which the tests do not read)."""
    return dict(re.findall(r"(\w[\w:/]*)=(\S*)", line))


class SlurmCluster:
    """munged, slurmctld and a slurmd per node, started in ``root``; ``close`` stops them all."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        self.own_root = root is None
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.conf = self.root / "slurm.conf"
        self.ctld_port, *node_ports = free_ports(1 + len(NODES))
        self.node_ports = dict(zip(NODES, node_ports, strict=True))

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 60) -> None:
        reason = why_unavailable()
        if reason:
            raise SlurmUnavailable(reason)
        remove_stale()
        for sub in ("munge", "state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self._check([PACKAGES["munged"], "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                     f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                     f"--log-file={self.root / 'munge' / 'munged.log'}", f"--seed-file={self.root / 'munge' / 'seed'}"])
        self.conf.write_text(self._slurm_conf())
        self._check([PACKAGES["slurmctld"], "-f", str(self.conf)])
        for node in NODES:
            self.start_slurmd(node)
        self.wait_idle(NODES, timeout)

    def start_slurmd(self, node: str) -> None:
        self._check([PACKAGES["slurmd"], "-f", str(self.conf), "-N", node])

    def close(self) -> None:
        """Cancel every job, then stop the daemons (SIGTERM, then SIGKILL) and remove the directory."""
        ours = [pid for pid in (self._pid(f"slurmd-{node}.pid") for node in NODES) if pid]
        ours += [pid for pid in (self._pid("slurmctld.pid"), self._pid("munge/munged.pid")) if pid]
        # A pid file may outlive its daemon (a stale cluster): only a process started on our files is ours.
        pids = [pid for pid in ours if str(self.root) in command_line(pid)]
        if self.conf.exists() and pids:
            for command in (["scancel", "--full", "--signal=KILL", f"--partition={PARTITION}"],
                            ["scancel", f"--partition={PARTITION}"]):
                try:
                    subprocess.run(command, env=self.env(), capture_output=True, timeout=30)
                except subprocess.TimeoutExpired:
                    break
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        if self.own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ commands

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for Slurm commands against this cluster (and nothing of an enclosing job's)."""
        env = {k: v for k, v in (base or os.environ).items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def command(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def node_states(self) -> dict[str, str]:
        lines = self.command("sinfo", "-h", "-N", "-o", "%N %T").stdout.split("\n")
        return dict(line.split() for line in lines if line.strip())

    def wait_idle(self, nodes: tuple[str, ...] = NODES, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        states: dict[str, str] = {}
        while time.time() < deadline:
            states = self.node_states()
            if all(states.get(node) == "idle" for node in nodes):
                return
            time.sleep(0.3)
        raise AssertionError(f"Slurm nodes not idle within {timeout} s: {states}\n{self.logs()}")

    def job(self, job_id: str) -> dict[str, str]:
        return parse_record(self.command("scontrol", "show", "job", "-o", job_id).stdout)

    def wait_job(self, job_id: str, reached: Callable[[dict[str, str]], bool], what: str,
                 timeout: float) -> dict[str, str]:
        """Wait until the job's record (``scontrol show job``) satisfies ``reached``; the record then."""
        deadline = time.time() + timeout
        record: dict[str, str] = {}
        while time.time() < deadline:
            record = self.job(job_id)
            if reached(record):
                return record
            time.sleep(0.3)
        raise AssertionError(f"job {job_id}: not {what} within {timeout} s: {record}\n{self.logs()}")

    def wait_ended(self, job_id: str, timeout: float) -> dict[str, str]:
        return self.wait_job(job_id, lambda record: record.get("JobState") in ENDED, "ended", timeout)

    # ------------------------------------------------------------------ faults

    def kill_node(self, node: str) -> list[int]:
        """SIGKILL everything of ``node`` at once, as the machine dying would: its slurmd, the
        slurmstepd of every step there and the job's processes on it. Returns the pids killed."""
        tasks = processes_with_env(f"SLURMD_NODENAME={node}", f"SLURM_CONF={self.conf}")
        stepds = {parent(pid) for pid in tasks} - {None, 1}
        stepds = {pid for pid in stepds if pid is not None and command_line(pid).startswith("slurmstepd")}
        victims = [pid for pid in (self._pid(f"slurmd-{node}.pid"), *stepds, *tasks) if pid]
        for pid in victims:
            _signal(pid, signal.SIGKILL)
        return victims

    def mark_down(self, node: str) -> None:
        """Tell slurmctld ``node`` is down now, as it decides by itself once the node was silent for
        SlurmdTimeout and a few pings (about half a minute here)."""
        self.command("scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=killed by a test")

    def revive_node(self, node: str, timeout: float = 60) -> None:
        """Start ``node``'s slurmd again, return it to service and wait until Slurm has it idle."""
        self.start_slurmd(node)
        deadline = time.time() + timeout
        while "down" in self.node_states().get(node, "down") and time.time() < deadline:
            self.command("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
            time.sleep(0.5)
        self.wait_idle((node,), max(1.0, deadline - time.time()))

    # ------------------------------------------------------------------ internals

    def logs(self) -> str:
        parts = []
        for log in ["slurmctld.log", *(f"slurmd-{node}.log" for node in NODES)]:
            path = self.root / log
            if path.exists():
                parts.append(f"===== {log}\n{path.read_text(errors='replace')[-2500:]}")
        return "\n".join(parts)

    def _pid(self, name: str) -> int | None:
        try:
            return int((self.root / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _check(self, command: list[str]) -> None:
        done = subprocess.run(command, env=self.env(), capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise AssertionError(f"{command[0]} did not start ({done.returncode}): {done.stderr.strip()}\n"
                                 f"{self.logs()}")

    def _slurm_conf(self) -> str:
        d = self.root
        lines = [
            "ClusterName=undytest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "CredType=cred/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d}/slurmd-%n.log",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "SelectType=select/linear",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "ReturnToService=2",
            f"SlurmdTimeout={SLURMD_TIMEOUT}",
            "InactiveLimit=0",
            "KillWait=5",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SlurmdParameters=config_overrides",
        ]
        for node, port in self.node_ports.items():
            lines.append(f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=1 "
                         "RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName={PARTITION} Nodes=n[1-{len(NODES)}] Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"


def remove_stale() -> None:
    """Stop the daemons of clusters whose creating process is gone, and remove their directories."""
    for root in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        creator = root.name[len(PREFIX):].split("-")[0]
        if creator.isdigit() and not _alive(int(creator)):
            SlurmCluster(root).close()
            shutil.rmtree(root, ignore_errors=True)


def processes_with_env(*entries: str) -> list[int]:
    """PIDs of live processes whose environment holds every one of ``entries`` (``KEY=VALUE``)."""
    found = []
    wanted = [entry.encode() for entry in entries]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(entry in environ for entry in wanted):
            found.append(int(proc.name))
    return found


def parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _signal(pid: int, signum: signal.Signals) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
