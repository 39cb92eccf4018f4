"""Certificates for the TLS tests, made with the ``openssl`` command: a CA, a server certificate
naming the addresses clients dial, and a client certificate (etcd's --client-cert-auth).

Runs in the test process. Each call makes a fresh CA, so a second set is "another job's" or
"an attacker's": nothing of one verifies against the other.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path  # the server's, for every address in ``make_tls_files(addresses)``
    key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise AssertionError(f"openssl {' '.join(args)}: {done.stderr}")


def make_tls_files(directory: Path, addresses: tuple[str, ...] = ("127.0.0.1",)) -> TlsFiles:
    """A CA and the certificates it signs, in ``directory``; skips the test without ``openssl``."""
    if shutil.which("openssl") is None:
        pytest.skip("the TLS tests make their certificates with the `openssl` command (not found)")
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=undying test CA", cwd=directory)
    names = ",".join(f"IP:{address}" if address[0].isdigit() else f"DNS:{address}" for address in addresses)
    # The server certificate is a client one too: etcd's JSON gateway presents it to etcd itself.
    for name, usage, subject in (("server", "serverAuth,clientAuth", "/CN=undying controller"),
                                 ("client", "clientAuth", "/CN=undying node")):
        (directory / f"{name}.ext").write_text(
            f"subjectAltName={names}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n")
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=directory)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=directory)
    return TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key",
                    directory / "client.pem", directory / "client.key")
