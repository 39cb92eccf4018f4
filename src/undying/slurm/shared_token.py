"""The job's token in its shared directory: created once by whichever node comes first, read by all.

Runs in ``undying run`` on every node of a Slurm step, each at about the same moment. A node writes
a fresh token to a private file of its own (mode 0600 from its creation, never through a link),
fsyncs it and ``link()``s it to the token's name: the link either creates the name with the whole
token in it or fails because another node's link won, on a local or an NFS file system alike.
Every node then reads the token the name holds, so all of them hold the winner's. A requeued job
(same job id, same directory) reads the token it made the first time.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from undying.slurm.errors import SlurmError

TOKEN_MODE = 0o600
MIN_TOKEN_LENGTH = 16  # as `--token-file` requires


class SharedTokenError(SlurmError):
    """The token file cannot be made or read; the message names the file."""


def shared_token(path: Path) -> str:
    """The token at ``path``, which this call creates (0600) unless some node did first."""
    if not path.exists():
        _create(path)
    try:
        token = path.read_text().strip()
    except OSError as error:
        raise SharedTokenError(f"cannot read the job's token {path}: {error.strerror}") from None
    if len(token) < MIN_TOKEN_LENGTH:
        raise SharedTokenError(f"the job's token {path} holds fewer than {MIN_TOKEN_LENGTH} characters: "
                               "remove it to have a new one made")
    return token


def _create(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.partial")
        descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, TOKEN_MODE)
        try:
            os.fchmod(descriptor, TOKEN_MODE)  # whatever the umask
            os.write(descriptor, (secrets.token_hex(32) + "\n").encode())
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        try:
            os.link(staging, path)
        except FileExistsError:
            pass  # another node's token is the job's
        finally:
            staging.unlink(missing_ok=True)
    except OSError as error:
        raise SharedTokenError(f"cannot create the job's token {path}: {error.strerror}") from None
