"""Nobody in who does not belong, in one process: the controller over HTTPS and the job's store
behind its gate (controller/store.py, store_link.py), with certificates made by ``openssl``.

A client that trusts the job's CA and holds its token is served; a client of another CA, a plain
HTTP client, a client with another token, and a raw TCPStore client get nothing, and the refusals
are logged. The cross-host version (another network namespace) is tests/faults/test_job_isolation.py.
"""

from __future__ import annotations

import datetime
import http.client
import os
import socket
import ssl
import struct
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.tls_files import TlsFiles, make_tls_files
from undying import events as ev
from undying.client import ControllerClient, ControllerUnreachable, Unauthorized
from undying.config import JobSpec
from undying.controller.core import Controller
from undying.controller.server import ControllerServer
from undying.controller.store import JobStore
from undying.events import EventLog, read_events
from undying.protocol import ROUTE_STATUS
from undying.runtime.pg import connect_store
from undying.store_link import ENV_TOKEN, StoreLink, StoreRefused
from undying.tls import ENV_TLS_CA, ClientTls, ServerTls

TOKEN = "tls-test-token-0123456789abcdef"
OTHER_TOKEN = "another-jobs-token-0123456789ab"
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def other_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """Another CA's certificates: another job's, or an impostor's."""
    return make_tls_files(tmp_path_factory.mktemp("tls-other"))


@pytest.fixture
def https(tmp_path: Path, files: TlsFiles):
    events = EventLog(tmp_path)
    controller = Controller(JobSpec(nnodes=2), events, "job-tls", 29555)
    server = ControllerServer(controller, TOKEN, HOST, 0, tls=ServerTls(str(files.cert), str(files.key)).context())
    thread = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield server, tmp_path
    server.stop()
    events.close()


def refusals(run_dir: Path) -> list[dict]:
    return [event.details for event in read_events(run_dir) if event.kind == ev.AUTH_REFUSED]


def test_the_controller_serves_https_to_a_client_that_trusts_its_ca(https, files: TlsFiles) -> None:
    server, run_dir = https
    client = ControllerClient(server.address, TOKEN, tls=ClientTls(str(files.ca)))
    try:
        assert client.get(ROUTE_STATUS)["state"] == "waiting_for_nodes"
    finally:
        client.close()
    assert refusals(run_dir) == []


def test_https_refuses_other_cas_plain_http_and_other_tokens(https, files: TlsFiles, other_files: TlsFiles) -> None:
    server, run_dir = https
    impostor = ControllerClient(server.address, TOKEN, timeout=2.0, tls=ClientTls(str(other_files.ca)))
    with pytest.raises(ControllerUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
        impostor.get(ROUTE_STATUS)  # the client will not talk to a controller its CA did not sign
    plain = http.client.HTTPConnection(HOST, server.port, timeout=2.0)
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        plain.request("GET", ROUTE_STATUS, headers={"Authorization": f"Bearer {TOKEN}"})
        plain.getresponse().read()
    plain.close()
    other_job = ControllerClient(server.address, OTHER_TOKEN, tls=ClientTls(str(files.ca)))
    with pytest.raises(Unauthorized):
        other_job.get(ROUTE_STATUS)
    other_job.close()
    logged = refusals(run_dir)
    assert any("TLS handshake failed" in details.get("why", "") for details in logged), logged
    assert any(details.get("path") == ROUTE_STATUS for details in logged), logged


@pytest.fixture
def store(request: pytest.FixtureRequest, files: TlsFiles, monkeypatch: pytest.MonkeyPatch):
    """The job's store behind its gate; with ``request.param`` true, the gate speaks TLS and this
    process (as a worker would) verifies it with the job's CA."""
    tls = request.param
    refused: list[tuple[str, str]] = []
    job_store = JobStore(HOST, TOKEN, tls=ServerTls(str(files.cert), str(files.key)).context() if tls else None)
    job_store.on_refused = lambda client, why: refused.append((client, why))
    assert job_store.wait_ready(60)
    monkeypatch.setenv(ENV_TOKEN, TOKEN)
    if tls:
        monkeypatch.setenv(ENV_TLS_CA, str(files.ca))
    else:
        monkeypatch.delenv(ENV_TLS_CA, raising=False)
    yield job_store, refused
    job_store.close()


@pytest.mark.parametrize("store", [False, True], ids=["token", "token+tls"], indirect=True)
def test_a_worker_with_the_token_uses_the_store_and_others_cannot(store, files: TlsFiles,
                                                                 other_files: TlsFiles) -> None:
    job_store, refused = store
    worker = connect_store(HOST, job_store.port, 10.0)
    worker.set("secret/key", b"value")
    assert worker.get("secret/key") == b"value"
    assert worker.add("counter", 2) == 2
    tls = ClientTls(str(files.ca)) if job_store.tls is not None else None

    with pytest.raises(StoreRefused):  # another job's token
        StoreLink(OTHER_TOKEN, tls).open(HOST, job_store.port, 5.0)
    if tls is not None:
        with pytest.raises(StoreRefused):  # a gate it cannot verify: another CA
            StoreLink(TOKEN, ClientTls(str(other_files.ca))).open(HOST, job_store.port, 5.0)
    # torch's own client, which knows nothing of the handshake, never reaches a key.
    with pytest.raises(Exception):  # noqa: B017 - torch raises its own DistNetworkError/timeout types
        raw = dist.TCPStore(HOST, job_store.port, is_master=False, wait_for_workers=False,
                            timeout=datetime.timedelta(seconds=2))
        raw.get("secret/key")
    # The store itself listens on loopback only, on another port than the gate's.
    assert job_store.store_port != job_store.port
    assert worker.get("secret/key") == b"value"  # the worker's link is untouched by all this
    assert len(refused) >= 2 and all(client == HOST for client, _ in refused), refused


@pytest.mark.parametrize("store", [False], ids=["token"], indirect=True)
def test_the_link_is_refused_to_a_process_without_the_token(store, monkeypatch: pytest.MonkeyPatch) -> None:
    job_store, _ = store
    monkeypatch.delenv(ENV_TOKEN)
    with pytest.raises(StoreRefused, match=ENV_TOKEN):
        connect_store(HOST, job_store.port, 5.0)


def test_a_local_link_serves_only_this_process(tmp_path: Path) -> None:
    """The loopback end of a link takes connections from this process only: another process of this
    host connecting to its port is dropped, and the link waits on for its own client."""
    gate = socket.create_server((HOST, 0))
    accepted: list[socket.socket] = []

    def serve_gate() -> None:  # a gate that accepts the token and echoes what comes after
        from undying.store_link import server_handshake

        connection, _ = gate.accept()
        accepted.append(connection)
        server_handshake(connection, TOKEN)
        while data := connection.recv(1024):
            connection.sendall(data)

    threading.Thread(target=serve_gate, daemon=True).start()
    host, port = StoreLink(TOKEN, None).local_end(HOST, gate.getsockname()[1], 5.0)
    intruder = _connect_from_another_process(host, port)
    assert intruder == b"", "another process got an answer through the link"
    own = socket.create_connection((host, port), timeout=5.0)
    own.sendall(b"ping")
    assert own.recv(4) == b"ping"
    own.close()
    gate.close()


def _connect_from_another_process(host: str, port: int) -> bytes:
    """What a child process reads after sending through (host, port): b"" when it was dropped."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: connect, send, report what came back
        os.close(read)
        try:
            with socket.create_connection((host, port), timeout=3.0) as connection:
                connection.sendall(b"ping")
                os.write(write, b"got:" + connection.recv(4))
        except OSError:
            os.write(write, b"got:")
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    return text[len(b"got:"):]


def test_bad_tls_files_are_one_line_errors(tmp_path: Path, files: TlsFiles) -> None:
    from undying.tls import TlsFileError, check_client, check_server

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(TlsFileError, match="--tls-cert: cannot load"):
        check_server("--tls-cert", ServerTls(str(files.cert), str(garbage)))
    with pytest.raises(TlsFileError, match="--tls-ca: cannot load"):
        check_client("--tls-ca", ClientTls(str(tmp_path / "missing.pem")))
    check_server("--tls-cert", ServerTls(str(files.cert), str(files.key)))
    assert isinstance(ClientTls(str(files.ca)).context(), ssl.SSLContext)


@pytest.mark.parametrize("store", [False, True], ids=["token", "token+tls"], indirect=True)
def test_a_port_probe_is_closed_quietly(store, files: TlsFiles) -> None:
    """A connection that leaves before sending a byte (a load balancer's or Kubernetes' TCP probe) is
    not a refusal worth logging; one that sends a wrong proof is."""
    job_store, refused = store
    for _ in range(3):
        socket.create_connection((HOST, job_store.port), timeout=5.0).close()
    for _ in range(3):  # probes that reset the connection (the gate's greeting unread, or no linger)
        probe = socket.create_connection((HOST, job_store.port), timeout=5.0)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        time.sleep(0.05)  # the gate's greeting (token only) has arrived unread
        probe.close()
    tls = ClientTls(str(files.ca)) if job_store.tls is not None else None
    with pytest.raises(StoreRefused):
        StoreLink(OTHER_TOKEN, tls).open(HOST, job_store.port, 5.0)
    deadline = time.monotonic() + 5
    while not refused and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the probes' threads are done by now too
    assert [why for _, why in refused] == ["wrong token proof"], refused


SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py")


@pytest.mark.parametrize(("flags", "line"), [
    (["--tls-cert", "{cert}"], "--tls-cert and --tls-key: give both or neither"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}"], "--tls-cert: needs --tls-ca too"),
    (["--tls-ca", "{ca}"], "--tls-ca: a controller runs on this node and needs its certificate"),
    (["--tls-cert", "{cert}", "--tls-key", "{ca}", "--tls-ca", "{ca}"], "--tls-cert: cannot load the certificate"),
    (["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-ca", "{missing}"], "--tls-ca: cannot load"),
    (["--etcd-ca", "{ca}"], "--etcd-ca: only with --etcd"),
    (["--etcd-cert", "{cert}"], "--etcd-cert/--etcd-key: need --etcd-ca"),
])
def test_bad_tls_flags_are_one_line_errors(flags: list[str], line: str, files: TlsFiles, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from undying.cli import main

    paths = {"cert": files.cert, "key": files.key, "ca": files.ca, "missing": tmp_path / "missing.pem"}
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *(flag.format(**paths) for flag in flags), "--run-dir", str(tmp_path / "run"), SCRIPT])
    assert exit_info.value.code == 2
    [error] = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("undying: error: ") and line in error, error
    assert not (tmp_path / "run").exists()


def test_a_node_that_only_joins_takes_the_ca_alone(files: TlsFiles) -> None:
    """Node R > 0 hosts no controller: --tls-ca alone is its whole TLS setup."""
    import argparse

    from undying.launch import cli_tls

    args = argparse.Namespace(tls_cert=None, tls_key=None, tls_ca=str(files.ca))
    assert cli_tls.server_tls(args, hosts_controller=False) is None
    assert cli_tls.controller_ca(args) == str(files.ca)
