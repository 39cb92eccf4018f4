"""The TLS options of ``undying run``, ``status`` and ``stop``: declared, checked, handed on.

Runs in the user's shell process (the CLI). Each bad option is one line naming it and the file
(``undying: error: --tls-cert: cannot load ...``) before anything starts. What the files mean is
``tls.py``'s; docs/security.md says which node needs which.
"""

from __future__ import annotations

import argparse
import os

from undying.tls import ClientTls, ServerTls, TlsFileError, check_client, check_server, tls_environ


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every command that talks to a controller or etcd takes."""
    parser.add_argument("--tls-ca", metavar="FILE", help="the CA (PEM) that signed the controller's certificate: "
                        "HTTPS to the controller, TLS to its store, the certificate verified")
    parser.add_argument("--etcd-ca", metavar="FILE", help="with --etcd: the CA that signed etcd's certificate "
                        "(etcd reached over HTTPS)")
    parser.add_argument("--etcd-cert", metavar="FILE", help="with --etcd-ca: this node's client certificate for "
                        "etcd (etcd started with --client-cert-auth)")
    parser.add_argument("--etcd-key", metavar="FILE", help="the key of --etcd-cert")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", metavar="FILE", help="the controller's certificate (PEM, naming the address "
                        "clients dial): where a controller runs here it serves HTTPS and its store TLS; needs "
                        "--tls-key and --tls-ca")
    parser.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert")
    add_client_arguments(parser)


def etcd_tls(args: argparse.Namespace) -> ClientTls | None:
    """``--etcd-ca`` (and the client certificate) checked; None without it. Raises TlsFileError."""
    if (args.etcd_cert or args.etcd_key) and not args.etcd_ca:
        raise TlsFileError("--etcd-cert/--etcd-key: need --etcd-ca (the CA that verifies etcd)")
    if bool(args.etcd_cert) != bool(args.etcd_key):
        raise TlsFileError("--etcd-cert and --etcd-key: give both or neither")
    if not args.etcd_ca:
        return None
    tls = ClientTls(args.etcd_ca, args.etcd_cert or "", args.etcd_key or "")
    check_client("--etcd-ca" if not args.etcd_cert else "--etcd-cert", tls)
    return tls


def controller_ca(args: argparse.Namespace) -> str | None:
    """``--tls-ca`` checked; None without it. Raises TlsFileError."""
    if not args.tls_ca:
        return None
    check_client("--tls-ca", ClientTls(args.tls_ca))
    return str(args.tls_ca)


def server_tls(args: argparse.Namespace, hosts_controller: bool) -> ServerTls | None:
    """``--tls-cert``/``--tls-key`` checked against where a controller runs (``hosts_controller``: node
    0, a simulated job, every node of a failover job). Raises TlsFileError."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise TlsFileError("--tls-cert and --tls-key: give both or neither")
    if args.tls_cert and not args.tls_ca:
        raise TlsFileError("--tls-cert: needs --tls-ca too (this node's agent verifies the controller with it)")
    if args.tls_ca and not args.tls_cert and hosts_controller:
        raise TlsFileError("--tls-ca: a controller runs on this node and needs its certificate: add --tls-cert "
                           "and --tls-key")
    if not args.tls_cert:
        return None
    tls = ServerTls(args.tls_cert, args.tls_key)
    check_server("--tls-cert", tls)
    return tls


def use_for_clients(args: argparse.Namespace) -> None:
    """``status``/``stop``: this process's clients verify the controller and reach etcd with the
    files named (an option left out keeps what the environment says). Raises TlsFileError."""
    os.environ.update(tls_environ(controller_ca(args), etcd_tls(args)))
