"""Hosts the c10d TCPStore that every process-group generation rendezvous through.

Runs in the controller. torch's TCPStore listens on every interface when it opens
its own socket; we hand it a socket already bound to the controller's bind address,
so a loopback job's store is not reachable from other hosts at all. Keys carry no
secret protection of their own: a PrefixStore only namespaces them, anyone who can
connect can read and write every key. What protects the store is that nobody else
can connect: loopback binding here, and on multi-node jobs a network policy or
firewall that admits only the job's nodes to the store port (docs/security.md).
"""

from __future__ import annotations

import socket
from datetime import timedelta


class JobStore:
    """A TCPStore server bound to one address; lives as long as the controller."""

    def __init__(self, bind_host: str, port: int = 0, timeout: float = 300.0) -> None:
        import torch.distributed as dist  # heavy import; only the controller process pays it

        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((bind_host, port))
        self._socket.listen(1024)
        self.port: int = self._socket.getsockname()[1]
        self.store = dist.TCPStore(
            bind_host,
            self.port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
            master_listen_fd=self._socket.fileno(),
        )
