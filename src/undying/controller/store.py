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
import sys
import threading
from datetime import timedelta
from typing import Any


class JobStore:
    """A TCPStore server bound to one address; lives as long as the controller.

    The socket is bound and listening when the constructor returns, so ``port`` is known and
    clients may connect at once (the kernel queues them); the TCPStore that answers them is built
    on a helper thread, since importing torch takes a second or two that the agents and workers,
    starting meanwhile, need not wait for."""

    def __init__(self, bind_host: str, port: int = 0, timeout: float = 300.0) -> None:
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((bind_host, port))
        self._socket.listen(1024)
        self.port: int = self._socket.getsockname()[1]
        self.store: Any = None  # the TCPStore, once built
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, args=(bind_host, timeout), daemon=True,
                                        name="undying-job-store")
        self._thread.start()

    def _serve(self, bind_host: str, timeout: float) -> None:
        try:
            import torch.distributed as dist  # heavy import; only the controller process pays it

            self.store = dist.TCPStore(
                bind_host,
                self.port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout),
                master_listen_fd=self._socket.fileno(),
            )
        except Exception as error:  # noqa: BLE001 - the workers' store connections then time out, said here
            self.error = error
            print(f"undying: the job's store on {bind_host}:{self.port} could not start: {error}", file=sys.stderr)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Until the TCPStore serves (or failed to start); True once it serves."""
        self._thread.join(timeout)
        return self.store is not None
