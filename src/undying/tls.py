"""TLS from files: the controller's certificate, the CA its clients verify it with, etcd's.

Runs in every process. ``undying run --tls-cert/--tls-key`` make the controller serve HTTPS and
its store gate speak TLS (``controller/server.py``, ``controller/store.py``); ``--tls-ca`` is the CA
every client verifies them with: the agents, the workers (their heartbeats and their store link,
``store_link.py``), ``undying status``. ``--etcd-ca`` (with ``--etcd-cert``/``--etcd-key`` when etcd
asks for client certificates) is how every process of a failover job reaches etcd (``etcd.py``).
``undying run`` hands the files' paths to its agents and workers in the environment (``tls_environ``),
as it hands them the etcd endpoint; the files themselves are read where they are used (a mounted
Secret: the same paths on every node).

Guarantees: a client with a CA never talks to a server whose certificate that CA did not sign or
that does not name the address the client dialled (hostname checked); TLS 1.2 at least. Not
guaranteed: revocation (no CRL or OCSP is read); a certificate replaced on disk is read again
only by processes started after the change.
"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

ENV_TLS_CA = "UNDYING_TLS_CA"  # the CA that verifies the controller and its store gate
ENV_ETCD_CA = "UNDYING_ETCD_CA"  # the CA that verifies etcd's members
ENV_ETCD_CERT = "UNDYING_ETCD_CERT"  # this process's client certificate for etcd ("": none)
ENV_ETCD_KEY = "UNDYING_ETCD_KEY"
HANDSHAKE_TIMEOUT_S = 10.0  # a peer that does not finish its TLS handshake within this is dropped


class TlsFileError(ValueError):
    """A certificate, key or CA file that cannot be used (one line: the file and why)."""


@dataclass(frozen=True)
class ServerTls:
    """The certificate (chain) and key a server presents."""

    cert: str
    key: str

    def context(self) -> ssl.SSLContext:
        return _server_context(self.cert, self.key)


@dataclass(frozen=True)
class ClientTls:
    """What a client verifies its server with (``ca``), and its own certificate where the server
    asks for one (``cert``/``key``; etcd started with ``--client-cert-auth``)."""

    ca: str
    cert: str = ""
    key: str = ""

    def context(self) -> ssl.SSLContext:
        return _client_context(self.ca, self.cert, self.key)


def controller_tls_from_environ(env: Mapping[str, str] | None = None) -> ClientTls | None:
    """How this process verifies the controller: the CA ``undying run`` named, or None (plain HTTP)."""
    ca = (os.environ if env is None else env).get(ENV_TLS_CA, "")
    return ClientTls(ca) if ca else None


def etcd_tls_from_environ(env: Mapping[str, str] | None = None) -> ClientTls | None:
    """How this process reaches etcd over TLS, or None (plain HTTP)."""
    env = os.environ if env is None else env
    ca = env.get(ENV_ETCD_CA, "")
    return ClientTls(ca, env.get(ENV_ETCD_CERT, ""), env.get(ENV_ETCD_KEY, "")) if ca else None


def tls_environ(controller_ca: str | None, etcd: ClientTls | None) -> dict[str, str]:
    """The variables that tell agents and workers (and their clients) the files above."""
    environ = {}
    if controller_ca:
        environ[ENV_TLS_CA] = os.path.abspath(controller_ca)
    if etcd is not None:
        environ[ENV_ETCD_CA] = os.path.abspath(etcd.ca)
        environ[ENV_ETCD_CERT] = os.path.abspath(etcd.cert) if etcd.cert else ""
        environ[ENV_ETCD_KEY] = os.path.abspath(etcd.key) if etcd.key else ""
    return environ


def check_server(option: str, tls: ServerTls) -> None:
    """Raise TlsFileError naming ``option`` when the certificate and key do not load together."""
    try:
        _server_context(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as error:
        raise TlsFileError(f"{option}: cannot load the certificate {tls.cert!r} with the key {tls.key!r}: "
                           f"{_reason(error)}") from None


def check_client(option: str, tls: ClientTls) -> None:
    """Raise TlsFileError naming ``option`` when the CA (or the client certificate) does not load."""
    try:
        _client_context(tls.ca, tls.cert, tls.key)
    except (OSError, ssl.SSLError) as error:
        raise TlsFileError(f"{option}: cannot load {tls.ca!r}"
                           f"{f' with the certificate {tls.cert!r}' if tls.cert else ''}: {_reason(error)}") from None


def _reason(error: OSError | ssl.SSLError) -> str:
    if isinstance(error, ssl.SSLError):
        return error.reason or str(error)
    return error.strerror or str(error)


# Built once per process and file set: a context is safe to share between threads and
# connections, and loading a CA bundle costs milliseconds that every new client would pay.
@functools.lru_cache(maxsize=8)
def _server_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


@functools.lru_cache(maxsize=8)
def _client_context(ca: str, cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the hostname
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key or None)
    return context
