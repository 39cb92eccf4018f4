"""The files through which ``undying status RUN_DIR`` finds a running job's controller.

Written by the ``undying run`` process whose controller leads (``launcher.py``; for a failover job
``ha_node.py``, where the file also names etcd and the job, so a reader finds the current leader);
read by ``undying status`` in the user's shell. ``controller.json`` holds the controller's address;
``controller.token`` the job's token, created with mode 0600 under a temporary name and renamed into
place, so no other user can read it at any moment. Both are removed when the job ends here.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

CONTROLLER_FILE = "controller.json"
TOKEN_FILE = "controller.token"
TOKEN_MODE = 0o600


@dataclass(frozen=True)
class ControllerRecord:
    """Where a run directory's job is served."""

    address: str  # HOST:PORT of the controller that wrote the record
    job_id: str
    pid: int  # the ``undying run`` process that wrote it
    etcd: str | None = None  # a failover job: its leader is looked up here (the address may be stale)
    job_name: str | None = None
    # TLS (tls.py): the CA that verifies the controller, and how etcd is reached; paths, not secrets.
    tls_ca: str | None = None
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only: created 0600 under a new name (never an
    existing file, never through a link), fsynced, then renamed over ``path``."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.partial")
    staging.unlink(missing_ok=True)
    descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, TOKEN_MODE)
    try:
        os.fchmod(descriptor, TOKEN_MODE)  # a umask cannot narrow it to unreadable either
        os.write(descriptor, text.encode())
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    os.replace(staging, path)


def write_controller_files(run_dir: Path, record: ControllerRecord, token: str) -> None:
    """Record where the job's controller is and the token it wants, in ``run_dir``."""
    write_private(run_dir / TOKEN_FILE, token + "\n")
    staging = run_dir / f".{CONTROLLER_FILE}.{os.getpid()}.partial"
    staging.write_text(json.dumps(asdict(record)) + "\n")
    os.replace(staging, run_dir / CONTROLLER_FILE)


def remove_controller_files(run_dir: Path) -> None:
    """The job ended here: nobody is to look for its controller any more."""
    for name in (CONTROLLER_FILE, TOKEN_FILE):
        (run_dir / name).unlink(missing_ok=True)


def read_controller_record(run_dir: Path) -> ControllerRecord:
    """The record ``run_dir`` holds; FileNotFoundError when there is none (no job runs from it),
    ValueError when it is not one."""
    data = json.loads((run_dir / CONTROLLER_FILE).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("address"), str):
        raise ValueError(f"{run_dir / CONTROLLER_FILE}: not a controller record")
    known = {name: data[name] for name in ("address", "job_id", "pid", "etcd", "job_name", "tls_ca", "etcd_ca",
                                          "etcd_cert", "etcd_key") if name in data}
    return ControllerRecord(**known)
