"""Separate hosts on one machine for fault tests: each host a Linux network namespace with its own
address on a private subnet, all joined by a bridge that lives in a namespace of its own.

Runs in the test process (needs root and iproute2's ``ip``). Nothing is created in the machine's own
namespace: its interfaces and routes are never touched. A host's link is its bridge port, so cutting
it drops that host's packets silently in both directions, as a pulled cable or a dead switch port
does (its sockets stay open, nothing is reset). Every namespace's name starts with ``PREFIX`` and
the creating process's pid, so a crashed run's leftovers are found and removed by a later run
without touching a concurrent one's.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid

PREFIX = "undying-net"
SUBNET = "10.213.0"  # hosts are SUBNET.1, SUBNET.2, ... /24; only ever inside our own namespaces
HOST_INTERFACE = "eth0"  # each host's end of its link (a name is private to its namespace)
BRIDGE = "br0"
# Extra variables for every worker on a host. None are needed: a worker finds the interface that
# reaches the job's store itself (runtime/gloo_interface.py), though the hostname, which every
# namespace shares, resolves to loopback here.
WORKER_ENV: dict[str, str] = {}


class NetnsUnavailable(RuntimeError):
    """This machine cannot create network namespaces (not root, no ``ip``, no permission)."""


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_and_delete(namespace: str) -> None:
    """SIGKILL whatever runs in ``namespace`` (a namespace outlives its bind mount while a process
    is in it), then delete it; its links go with it."""
    for _ in range(50):
        pids = [int(pid) for pid in _ip("netns", "pids", namespace, check=False).split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    _ip("netns", "delete", namespace, check=False)


def remove_leftovers() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone (a crashed test run); returns them."""
    removed = []
    for namespace in _namespaces():
        if not namespace.startswith(PREFIX + "-"):
            continue
        owner = namespace[len(PREFIX) + 1:].split("-", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            _kill_and_delete(namespace)
            removed.append(namespace)
    return removed


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (one line), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip` (not found)"
    return None


class Network:
    """``hosts`` namespaces, host i at ``address(i)``, each linked to one bridge. ``close()`` kills
    every process inside them and removes them all; use it in a ``finally`` or fixture finalizer.

    Guarantees: hosts reach each other only through the bridge, by their ``SUBNET`` addresses;
    127.0.0.1 in a host is that host's alone. Not guaranteed: anything about the file system or
    the pid space, which the hosts share with the machine (as shared storage would be shared)."""

    def __init__(self, hosts: int) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        self.tag = f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.tag}-switch"
        self.hosts = [f"{self.tag}-host{index}" for index in range(hosts)]
        self._made: list[str] = []
        try:
            remove_leftovers()
            self._build()
        except (RuntimeError, OSError, subprocess.SubprocessError) as error:
            self.close()
            raise NetnsUnavailable(f"cannot build network namespaces: {error}") from None

    def _build(self) -> None:
        for namespace in (self.switch, *self.hosts):
            _ip("netns", "add", namespace)
            self._made.append(namespace)
        _ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", self.switch, "link", "set", BRIDGE, "up")
        for index, namespace in enumerate(self.hosts):
            # Both ends are created inside our namespaces: the machine's own never sees a link.
            _ip("link", "add", HOST_INTERFACE, "netns", namespace, "type", "veth",
                "peer", "name", self.port(index), "netns", self.switch)
            _ip("-n", self.switch, "link", "set", self.port(index), "master", BRIDGE, "up")
            _ip("-n", namespace, "addr", "add", f"{self.address(index)}/24", "dev", HOST_INTERFACE)
            _ip("-n", namespace, "link", "set", HOST_INTERFACE, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")

    @staticmethod
    def address(index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    @staticmethod
    def port(index: int) -> str:
        """Host ``index``'s port on the bridge (in the switch namespace)."""
        return f"port{index}"

    def command(self, index: int, argv: list[str]) -> list[str]:
        """``argv`` run on host ``index`` (it execs in place: the pid Popen sees is argv's)."""
        return ["ip", "netns", "exec", self.hosts[index], *argv]

    def cut(self, index: int) -> None:
        """Host ``index`` loses its link: from now on its packets are dropped, both ways."""
        _ip("-n", self.switch, "link", "set", self.port(index), "down")

    def restore(self, index: int) -> None:
        _ip("-n", self.switch, "link", "set", self.port(index), "up")

    def pids(self, index: int) -> list[int]:
        return [int(pid) for pid in _ip("netns", "pids", self.hosts[index], check=False).split()]

    def close(self) -> None:
        for namespace in reversed(self._made):
            _kill_and_delete(namespace)
        self._made = []
