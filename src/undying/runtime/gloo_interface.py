"""The network interface gloo uses in this worker: the one through which this host reaches the
job's store, set as ``GLOO_SOCKET_IFNAME`` before the worker's first gloo group is built.

Runs in the worker (``Membership`` calls it once). Without it gloo advertises the address the
hostname resolves to, which on many machines (an ``/etc/hosts`` line ``127.0.1.1 <hostname>``) is
loopback, so peers on other hosts cannot connect.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
from collections.abc import MutableMapping
from pathlib import Path

GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"  # read by every gloo group as it is built
SIOCGIFADDR = 0x8915  # Linux <linux/sockios.h>: an interface's (primary) IPv4 address
IPV6_ADDRESSES = Path("/proc/net/if_inet6")  # Linux: one line per IPv6 address, interface name last


def choose_gloo_interface(backend: str, store_address: tuple[str, int] | None,
                          environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Point gloo at the interface holding the local address this host uses to reach the store at
    ``store_address``; returns its name, or None when ``environ`` was left unchanged.

    Guarantees: a non-empty ``GLOO_SOCKET_IFNAME`` of the user's is never replaced; nothing changes
    for nccl, a standalone run (no store) or a store reached over loopback (one machine); nothing is
    sent to the store (a UDP ``connect`` only asks the kernel for a route); when no interface can be
    found, nothing changes and one line says so on stderr. Not guaranteed: that peers reach this
    host on the interface that reaches the store (a store on a separate management network)."""
    if backend != "gloo" or store_address is None or environ.get(GLOO_SOCKET_IFNAME):
        return None
    host, port = store_address
    try:
        local_address = local_address_towards(host, port)
    except OSError as error:
        _say_unchanged(f"cannot tell this host's address towards the store at {host}:{port} ({error})")
        return None
    if ipaddress.ip_address(local_address).is_loopback:
        return None
    interface = _interface_holding(local_address)
    if interface is None:
        _say_unchanged(f"no interface holds {local_address}, this host's address towards the store at {host}:{port}")
        return None
    environ[GLOO_SOCKET_IFNAME] = interface
    return interface


def local_address_towards(host: str, port: int) -> str:
    """This host's address on its route towards ``host:port`` (a UDP ``connect`` only asks the kernel)."""
    family, kind, protocol, _, destination = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, protocol) as probe:
        probe.connect(destination)
        # An IPv6 link-local address comes back as "fe80::1%eth0": the scope is not part of it.
        return str(probe.getsockname()[0]).split("%", 1)[0]


def _interface_holding(address: str) -> str | None:
    wanted = ipaddress.ip_address(address)
    return _ipv6_interface_holding(wanted) if wanted.version == 6 else _ipv4_interface_holding(address)


def _ipv4_interface_holding(address: str) -> str | None:
    try:
        import fcntl  # not on every platform; the ioctl below is Linux's
        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as query:
        for name in names:
            try:
                answer = fcntl.ioctl(query.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == address:  # struct ifreq: name[16], then sockaddr_in
                return name
    return None


def _ipv6_interface_holding(wanted: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    try:
        lines = IPV6_ADDRESSES.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and ipaddress.ip_address(bytes.fromhex(fields[0])) == wanted:
            return fields[5]
    return None


def _say_unchanged(why: str) -> None:
    print(f"[undying] gloo interface: {why}; {GLOO_SOCKET_IFNAME} left unset, so gloo uses the address "
          f"the hostname resolves to (set {GLOO_SOCKET_IFNAME} if peers on other hosts cannot connect)",
          file=sys.stderr)
