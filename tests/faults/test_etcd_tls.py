"""Controller failover with etcd over TLS and client certificates, and the controller over HTTPS.

Debian's etcd-server is started by the test with TLS on its client port and ``--client-cert-auth``
(certificates made by ``openssl``, tests/tls_files.py). A client without a certificate, with one
of another CA, or over plain HTTP gets nothing; a failover job whose every node reaches etcd with
its client certificate loses its controller's node (SIGKILL) and ends, on another leader, with the
fault-free run's parameters (as tests/faults/test_controller_failover.py does without TLS)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import STEPS, EtcdServer, JobRun, etcd_binary, free_port, wait_for_etcd
from tests.faults.test_controller_failover import PROCESS_LEVEL, run_failover_job
from tests.tls_files import TlsFiles, make_tls_files
from undying import events as ev
from undying.etcd import EtcdClient, EtcdUnavailable
from undying.tls import ENV_ETCD_CA, ENV_ETCD_CERT, ENV_ETCD_KEY, ClientTls

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def etcd_tls(tmp_path_factory: pytest.TempPathFactory, tls: TlsFiles):
    """One etcd member on loopback: HTTPS only, every client must present a certificate of our CA."""
    binary = etcd_binary()
    data = tmp_path_factory.mktemp("etcd-tls")
    client_port, peer_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{client_port}"
    with open(data / "etcd.log", "wb") as log:
        process = subprocess.Popen(
            [binary, "--name", "undying-tls", "--data-dir", str(data / "data"),
             "--listen-client-urls", f"https://{endpoint}", "--advertise-client-urls", f"https://{endpoint}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
             "--initial-cluster", f"undying-tls=http://127.0.0.1:{peer_port}",
             "--cert-file", str(tls.cert), "--key-file", str(tls.key),
             "--client-cert-auth", "--trusted-ca-file", str(tls.ca)], stdout=log, stderr=subprocess.STDOUT)
    client = EtcdClient(endpoint, tls=ClientTls(str(tls.ca), str(tls.client_cert), str(tls.client_key)))
    wait_for_etcd(client, process, data / "etcd.log")
    yield EtcdServer(endpoint, process)
    process.terminate()
    process.wait(timeout=10)


def test_etcd_answers_only_clients_with_a_certificate_of_its_ca(etcd_tls: EtcdServer, tls: TlsFiles,
                                                               tmp_path: Path) -> None:
    member = ClientTls(str(tls.ca), str(tls.client_cert), str(tls.client_key))
    EtcdClient(etcd_tls.endpoint, tls=member).put("/undying/tls-probe", "ours")
    stranger = make_tls_files(tmp_path / "stranger")
    for tls_of_client in (None,  # plain HTTP
                          ClientTls(str(tls.ca)),  # no client certificate
                          ClientTls(str(tls.ca), str(stranger.client_cert), str(stranger.client_key)),
                          ClientTls(str(stranger.ca), str(tls.client_cert), str(tls.client_key))):
        with pytest.raises(EtcdUnavailable):
            EtcdClient(etcd_tls.endpoint, timeout=2.0, tls=tls_of_client).get("/undying/tls-probe")


def test_a_failover_job_over_tls_loses_its_controller_node_and_ends_bitwise_equal(
        dropout_reference: JobRun, etcd_tls: EtcdServer, tls: TlsFiles, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The test process finds the leader in etcd as the nodes do: with the client certificate.
    monkeypatch.setenv(ENV_ETCD_CA, str(tls.ca))
    monkeypatch.setenv(ENV_ETCD_CERT, str(tls.client_cert))
    monkeypatch.setenv(ENV_ETCD_KEY, str(tls.client_key))
    tls_args = ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca),
                "--etcd-ca", str(tls.ca), "--etcd-cert", str(tls.client_cert), "--etcd-key", str(tls.client_key)]
    run, codes = run_failover_job(tmp_path, etcd_tls, [*PROCESS_LEVEL, "--inject", "node:node=0:step=10", *tls_args])
    assert codes[0] == -signal.SIGKILL, run.output
    assert codes[1] == 0 and codes[2] == 0, run.output + run.logs()
    assert run.result["final_step"] == STEPS
    assert run.result["param_sha256"] == dropout_reference.result["param_sha256"]
    leaders = run.kinds(ev.CONTROLLER_LEADER)
    assert [e.details["resumed"] for e in leaders] == [False, True] and leaders[1].node in (1, 2), leaders
    assert not run.kinds(ev.RESTART_BEGIN), run.output
    assert all(e.details.get("tls") for e in run.kinds(ev.JOB_START))
    # Every agent and worker reached the controllers over HTTPS and the stores through their gates.
    assert not run.kinds(ev.AUTH_REFUSED), run.kinds(ev.AUTH_REFUSED)
    assert not run.kinds(ev.REQUEST_REFUSED), run.kinds(ev.REQUEST_REFUSED)  # nothing of the job's refused
