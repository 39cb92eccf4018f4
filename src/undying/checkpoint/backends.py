"""Which ``StorageBackend`` serves a checkpoint location: one local backend, one URL backend.

Runs in the worker processes, the only ones that read or write checkpoints. A ``CheckpointRoot``
(root.py) asks once, when it is built, and holds the answer. Both backends are stateless, so one
of each serves every root of the process.
"""

from __future__ import annotations

from undying.checkpoint.backend import PathLike, StorageBackend, is_url
from undying.checkpoint.local_backend import LocalBackend
from undying.checkpoint.url_backend import UrlBackend

_LOCAL = LocalBackend()
_URL = UrlBackend()


def backend_for(location: PathLike) -> StorageBackend:
    """The backend of a root or checkpoint directory: ``UrlBackend`` for an fsspec URL (``is_url``),
    ``LocalBackend`` for anything else."""
    return _URL if is_url(location) else _LOCAL
