"""TLS certificates a rendered pod mounts from existing Secrets: the controller's (``--tls-secret``:
its certificate, key and CA, as cert-manager writes a ``kubernetes.io/tls`` Secret) and etcd's
(``--etcd-tls-secret``: its CA, and this job's client certificate with ``--etcd-client-cert``),
each a read-only volume whose files become ``undying run``'s ``--tls-*`` / ``--etcd-*`` options.

Runs in the ``undying k8s render`` process. Only the keys named here are projected into the pod, so
every file an option points at is one the Secret must hold: a Secret without it fails the pod's
mount, and the kubelet's event names the key (docs/kubernetes.md, "TLS").
"""

from __future__ import annotations

from typing import Any

from undying.k8s.names import RenderError
from undying.k8s.options import RenderOptions

# cert-manager's keys (and kubectl create secret tls's, plus ca.crt).
CERT_KEY = "tls.crt"
PRIVATE_KEY_KEY = "tls.key"
CA_KEY = "ca.crt"
TLS_DIR = "/etc/undying/tls"  # the controller's certificate (every pod: any may host it or dial it)
ETCD_TLS_DIR = "/etc/undying/etcd-tls"
TLS_VOLUME = "controller-tls"
ETCD_TLS_VOLUME = "etcd-tls"
SECRET_FILE_MODE = 0o400  # the keys are secrets: readable by the container's user only


def check_certificates(options: RenderOptions) -> list[str]:
    """Refuse certificate options that do not go together (one ``RenderError`` line); return notes."""
    if options.etcd_tls_secret is not None and not options.etcd:
        raise RenderError(f"--etcd-tls-secret: etcd's CA, used only with --etcd (allowed with --etcd HOST:PORT; "
                          f"got --etcd-tls-secret {options.etcd_tls_secret!r} without --etcd)")
    if options.etcd_client_cert and options.etcd_tls_secret is None:
        raise RenderError("--etcd-client-cert: the client certificate's tls.crt and tls.key are read from "
                          "--etcd-tls-secret (allowed with --etcd-tls-secret SECRET; got none)")
    if options.tls_secret is not None and options.etcd:
        return [f"--tls-secret {options.tls_secret!r} with --etcd: each candidate pod serves the controller at "
                "its own pod IP and clients check that IP against the certificate's IP addresses (no wildcards "
                "or ranges): the certificate must list every address the pods may get (docs/kubernetes.md, TLS)"]
    return []


def _secret_volume(name: str, secret: str, keys: list[str]) -> dict[str, Any]:
    return {"name": name, "secret": {"secretName": secret, "defaultMode": SECRET_FILE_MODE,
                                     "items": [{"key": key, "path": key} for key in keys]}}


def certificate_volumes(options: RenderOptions) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the container's mounts for the Secrets asked for (none: two empty lists)."""
    volumes, mounts = [], []
    if options.tls_secret is not None:
        volumes.append(_secret_volume(TLS_VOLUME, options.tls_secret, [CERT_KEY, PRIVATE_KEY_KEY, CA_KEY]))
        mounts.append({"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True})
    if options.etcd_tls_secret is not None:
        keys = [CA_KEY, CERT_KEY, PRIVATE_KEY_KEY] if options.etcd_client_cert else [CA_KEY]
        volumes.append(_secret_volume(ETCD_TLS_VOLUME, options.etcd_tls_secret, keys))
        mounts.append({"name": ETCD_TLS_VOLUME, "mountPath": ETCD_TLS_DIR, "readOnly": True})
    return volumes, mounts


def certificate_arguments(options: RenderOptions) -> list[str]:
    """`undying run`'s options naming the mounted files (every pod the same: any may host the
    controller, with --etcd, and every pod's clients verify it)."""
    arguments = []
    if options.tls_secret is not None:
        arguments += ["--tls-cert", f"{TLS_DIR}/{CERT_KEY}", "--tls-key", f"{TLS_DIR}/{PRIVATE_KEY_KEY}",
                      "--tls-ca", f"{TLS_DIR}/{CA_KEY}"]
    if options.etcd_tls_secret is not None:
        arguments += ["--etcd-ca", f"{ETCD_TLS_DIR}/{CA_KEY}"]
        if options.etcd_client_cert:
            arguments += ["--etcd-cert", f"{ETCD_TLS_DIR}/{CERT_KEY}", "--etcd-key", f"{ETCD_TLS_DIR}/{PRIVATE_KEY_KEY}"]
    return arguments
