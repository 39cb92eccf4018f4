"""The T2 root check: every node proves, before it is given ranks, that it writes where the controller reads.

A T2 checkpoint is committed by one rank from the files every rank wrote under the checkpoint
root (``checkpoint.dir``, else ``RUN_DIR/checkpoints`` of each node's own run directory). Nodes
that do not share that root (each host with its own run directory, a path on a node's local
disk) would fail every commit. So each agent writes a probe file under its root before its
hello (``write_probe``, in the agent process) and the controller reads it under its own
(``take_probe``, in the controller process, before the hello reaches the job machine): a node
whose probe the controller cannot read is refused, with the flag that fixes it.

Local paths and fsspec URLs alike; torch is not imported (the agent and the controller do not).
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from undying.config import JobSpec
from undying.strategy_names import StrategyName

PROBE_PREFIX = ".undying-probe-"  # a probe is a file of the root itself: nothing is left once it is taken
FIX = ("set --checkpoint-dir (checkpoint.dir) to a directory on storage every node mounts, or to an "
       "fsspec URL (s3://...), or opt out of T2 with --set checkpoint.persist=false")


def t2_root(spec: JobSpec, run_dir: Path) -> str:
    """Where this node writes T2: ``checkpoint.dir`` (a path or URL), else its run directory's."""
    return spec.checkpoint.dir or str(run_dir / "checkpoints")


def writes_t2(spec: JobSpec) -> bool:
    """Does the job write T2 at all: periodic checkpoints (``checkpoint.persist``) or a dying checkpoint?"""
    return spec.checkpoint.persist or (spec.process_recover and StrategyName.DUMP in spec.recover_strategy)


def _probe_path(root: str, name: str) -> str:
    file = PROBE_PREFIX + name
    return root + file if root.endswith("/") else f"{root}/{file}"


def write_probe(root: str) -> tuple[str, str]:
    """Write a probe file under ``root``: (its name, "") or ("", why it could not be written)."""
    name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(8)}"
    location = _probe_path(root, name)
    try:
        if "://" in root:
            from fsspec.core import url_to_fs

            fs, path = url_to_fs(location)
            fs.makedirs(fs._parent(path), exist_ok=True)
            fs.pipe_file(path, name.encode())
        else:
            path = Path(location)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as probe:
                probe.write(name.encode())
                probe.flush()
                os.fsync(probe.fileno())
    except (OSError, ValueError, ImportError) as error:
        return "", f"cannot write to checkpoint root {root}: {error}"
    return name, ""


def take_probe(root: str, name: str) -> str:
    """Read (and remove) the probe ``name`` under ``root``: "" if it is there as written, else the problem."""
    location = _probe_path(root, name)
    try:
        if "://" in root:
            from fsspec.core import url_to_fs

            fs, path = url_to_fs(location)
            data = fs.cat_file(path)
            fs.rm_file(path)
        else:
            data = Path(location).read_bytes()
            Path(location).unlink()
    except FileNotFoundError:
        return f"its probe file is not under the controller's checkpoint root {root}"
    except (OSError, ValueError, ImportError) as error:
        return f"its probe file under {root} cannot be read: {error}"
    if data != name.encode():
        return f"its probe file under {root} holds other bytes than it wrote"
    return ""


def remove_probe(root: str, name: str) -> None:
    """The agent's own clean-up of a probe the controller could not see (on a root only it writes)."""
    location = _probe_path(root, name)
    try:
        if "://" in root:
            from fsspec.core import url_to_fs

            fs, path = url_to_fs(location)
            fs.rm_file(path)
        else:
            Path(location).unlink()
    except (OSError, ValueError, ImportError):
        pass


def refusal(node: int, host: str, problem: str) -> str:
    """One line: which node cannot share the T2 root, why, and what to set."""
    return f"node {node} ({host}) does not share the T2 checkpoint root: {problem}; {FIX}"
