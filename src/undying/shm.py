"""Node shared memory for T1 snapshots: where a job's directory lives, who owns it, and its cleanup.

Runs in the agent (claims its node's directory before starting workers, removes it when
it exits, removes crashed jobs' leftovers at start), in the launcher (a simulated node
that is lost loses its memory with it; the job's directory goes when the job ends) and in
the worker (finds its snapshot files). Imports nothing heavy: the agent never loads torch.

Layout::

    /dev/shm/undying-<job>/node<N>/owner            "<pid> <start time>" of the owning process
    /dev/shm/undying-<job>/node<N>/rank00003.slot0  a rank's snapshot slots (checkpoint/snapshot.py)

A directory is stale when its owner process is gone (pid and start time together, so a
reused pid does not keep it alive) and it belongs to another job; ``remove_stale`` deletes
those. ``UNDYING_SHM_DIR`` moves the root (tests, or hosts where /dev/shm is small).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

ENV_SHM_DIR = "UNDYING_SHM_DIR"
DEFAULT_SHM_ROOT = "/dev/shm"
JOB_DIR_PREFIX = "undying-"
OWNER_FILE = "owner"
# A directory this young without an owner file is being created by a starting agent right now.
UNOWNED_GRACE_S = 60.0

_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def shm_root() -> Path:
    return Path(os.environ.get(ENV_SHM_DIR) or DEFAULT_SHM_ROOT)


def job_dir(job_id: str, root: Path | None = None) -> Path:
    """``<root>/undying-<job>``; the job id must be a plain name (it becomes a path component)."""
    if not _SAFE_NAME.fullmatch(job_id) or job_id in (".", ".."):
        raise ValueError(f"job id {job_id!r} is not a plain name")
    return (root or shm_root()) / f"{JOB_DIR_PREFIX}{job_id}"


def node_dir(job_id: str, node: int, root: Path | None = None) -> Path:
    return job_dir(job_id, root) / f"node{int(node)}"


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/PID/stat), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its last ')'.
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def claim_node_dir(job_id: str, node: int, pid: int | None = None, root: Path | None = None) -> Path:
    """Create (or take over) this node's directory of the job and record ``pid`` as its owner."""
    directory = node_dir(job_id, node, root)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    owner_pid = os.getpid() if pid is None else pid
    tmp = directory / f"{OWNER_FILE}.{owner_pid}.tmp"
    tmp.write_text(f"{owner_pid} {process_start_time(owner_pid) or '?'}\n")
    os.replace(tmp, directory / OWNER_FILE)
    return directory


def owner_alive(directory: Path) -> bool:
    """Is the process recorded in ``directory/owner`` still the one that wrote it?"""
    try:
        pid_text, start = (directory / OWNER_FILE).read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return False
    return process_start_time(pid) == start


def remove_node_dir(job_id: str, node: int, root: Path | None = None) -> None:
    """Release one node's snapshots; the job's directory goes too once no node is left in it."""
    directory = node_dir(job_id, node, root)
    shutil.rmtree(directory, ignore_errors=True)
    try:
        directory.parent.rmdir()
    except OSError:
        pass  # another node of this job still holds its directory, or it is already gone


def remove_job_dir(job_id: str, root: Path | None = None) -> None:
    shutil.rmtree(job_dir(job_id, root), ignore_errors=True)


def remove_stale(keep_job: str | None = None, root: Path | None = None) -> list[Path]:
    """Delete the directories of other jobs whose every owner is gone (a crashed job's leftovers).

    A job directory is kept while any of its node directories has a live owner, or is
    younger than ``UNOWNED_GRACE_S`` and has no owner file yet (its agent is starting).
    """
    base = root or shm_root()
    removed: list[Path] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(JOB_DIR_PREFIX) or entry.name == f"{JOB_DIR_PREFIX}{keep_job}":
            continue
        try:
            if not entry.is_dir() or entry.owner() != _current_user():
                continue
            nodes = [child for child in entry.iterdir() if child.is_dir()]
            young = now - entry.stat().st_mtime < UNOWNED_GRACE_S
        except (OSError, KeyError):
            continue
        if any(owner_alive(node) for node in nodes):
            continue
        if young and any(not (node / OWNER_FILE).exists() for node in nodes):
            continue
        if young and not nodes:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def _current_user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name
