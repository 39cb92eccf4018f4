"""Nobody in who does not belong, across hosts: a job whose nodes run in network namespaces of their
own (tests/faults/netns.py) with TLS and a token, and a process of another job on a third host that
tries everything a neighbour on the network could: join as a node, read the controller's status,
events and metrics, stop the job, talk plain HTTP, open the store with its own token or with torch's
own client, and reach the store's loopback port. It gets nothing, every attempt on the controller
and the store is logged with its address, and the job ends with the fault-free run's parameters.
Skipped where namespaces cannot be made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, STEPS, JobRun
from tests.faults.netns import NetnsUnavailable, Network, unavailable_reason
from tests.faults.test_real_hosts import Hosts
from tests.tls_files import make_tls_files
from undying import events as ev
from undying.client import parse_address

pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(unavailable_reason() is not None, reason=f"no separate hosts: {unavailable_reason()}")]

INTRUDER_HOST = 2
STEP_SLEEP = ["--step-sleep", "0.8"]
# What a process of another job (its own token; the job's CA, which is no secret) tries from its host.
# argv: controller HOST:PORT, store gate port, the store's own (loopback) port, CA file, token file.
INTRUDER = """
import datetime, http.client, json, socket, sys
import torch.distributed as dist
from undying.client import ControllerClient, ControllerUnreachable, Unauthorized, parse_address
from undying.store_link import StoreLink, StoreRefused
from undying.tls import ClientTls

controller, gate_port, store_port, ca, token_file = sys.argv[1:6]
token = open(token_file).read().strip()
host, port = parse_address(controller)
tried = {}
for method, path, body in [("GET", "/status", None), ("GET", "/events", None), ("GET", "/metrics", None),
                           ("POST", "/v1/agent/hello", {"node": 1, "pid": 1, "hostname": "x", "nproc": 2}),
                           ("POST", "/v1/job/stop", {"reason": "intruder", "now": True})]:
    client = ControllerClient(controller, token, timeout=5.0, tls=ClientTls(ca))
    try:
        client.request(method, path, body)
        tried[path] = "served"
    except Unauthorized:
        tried[path] = "401"
    except ControllerUnreachable as error:
        tried[path] = f"unreachable: {error}"
    client.close()
try:
    plain = http.client.HTTPConnection(host, port, timeout=5.0)
    plain.request("GET", "/status", headers={"Authorization": "Bearer " + token})
    tried["plain http"] = f"HTTP {plain.getresponse().status}"
except (OSError, http.client.HTTPException) as error:
    tried["plain http"] = "failed"
try:
    StoreLink(token, ClientTls(ca)).open(host, int(gate_port), 5.0)
    tried["store link"] = "joined"
except StoreRefused:
    tried["store link"] = "refused"
try:
    raw = dist.TCPStore(host, int(gate_port), is_master=False, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=3))
    tried["torch client"] = f"read {raw.num_keys()} keys"
except Exception:
    tried["torch client"] = "failed"
try:
    socket.create_connection((host, int(store_port)), timeout=3.0).close()
    tried["store port"] = "connected"
except OSError:
    tried["store port"] = "unreachable"
print(json.dumps(tried))
"""


@pytest.fixture
def network():
    try:
        made = Network(hosts=3)  # node 0 (the controller), node 1, the intruder
    except NetnsUnavailable as error:
        pytest.skip(f"no separate hosts: {error}")
    yield made
    made.close()


def loopback_listeners(network: Network, host: int, pid: int) -> list[int]:
    """The TCP ports process ``pid`` listens on at 127.0.0.1 of ``host``."""
    listing = subprocess.run(["ip", "netns", "exec", network.hosts[host], "ss", "-ltnpH"], capture_output=True,
                             text=True, timeout=30).stdout
    return [int(line.split()[3].rpartition(":")[2]) for line in listing.splitlines()
            if f"pid={pid}," in line and line.split()[3].startswith("127.0.0.1:")]


def test_a_process_of_another_job_can_neither_join_nor_read_anything(reference_run: JobRun, network: Network,
                                                                      tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path / "tls", (network.address(0), "127.0.0.1"))
    tls_args = ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca)]
    # The same options on every node, as from one template.
    cluster = Hosts(tmp_path, tls_args, network=network, script_args=STEP_SLEEP)
    other_token = tmp_path / "other-token"
    other_token.write_text("another-job-" + "o" * 30)
    try:
        cluster.start(0)
        cluster.start(1)
        start = cluster.wait_for_event("the first step", lambda e: e.kind == ev.HEARTBEAT and (e.step or 0) >= 2)
        job_start = next(e for e in cluster.events() if e.kind == ev.JOB_START)
        assert job_start.details["tls"] is True
        controller = job_start.details["controller"]
        [store_port] = loopback_listeners(network, 0, cluster.processes[0].pid)  # torch's store, behind the gate

        # Both at once, while the job trains (STEP_SLEEP keeps it at it for some 20 s).
        intruder = subprocess.Popen(network.command(INTRUDER_HOST, [
            sys.executable, "-c", INTRUDER, controller, str(job_start.details["store_port"]), str(store_port),
            str(tls.ca), str(other_token)]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        with open(tmp_path / "joiner.out", "w") as joiner_output:  # not a pipe: no grandchild may hold it
            joiner = subprocess.Popen(network.command(INTRUDER_HOST, [
                sys.executable, "-m", "undying.cli", "run", "--nnodes", "2", "--nproc-per-node", "2",
                "--node-rank", "1", "--controller", controller, "--token-file", str(other_token),
                "--tls-ca", str(tls.ca), "--run-dir", str(tmp_path / "intruder"), "--quiet",
                str(REPO / "examples" / "gpt" / "train.py")]), stdout=joiner_output, stderr=subprocess.STDOUT,
                cwd=REPO)
        intruder_out, intruder_err = intruder.communicate(timeout=120)
        joiner_code = joiner.wait(timeout=120)
        assert cluster.processes[0].poll() is None, "the job ended before the intruder was done: too short a test"
        joined = (tmp_path / "joiner.out").read_text()
        assert intruder.returncode == 0, intruder_err[-3000:]
        tried = json.loads(intruder_out.strip().splitlines()[-1])
        code, output = cluster.wait(0)
        assert cluster.wait(1)[0] == 0
    finally:
        cluster.close()
    run = JobRun(code, output, cluster.run_dir(0), cluster.mark)
    assert tried == {"/status": "401", "/events": "401", "/metrics": "401", "/v1/agent/hello": "401",
                     "/v1/job/stop": "401", "plain http": "failed", "store link": "refused",
                     "torch client": "failed", "store port": "unreachable"}, tried
    assert joiner_code == 2 and "refused the job token" in joined, joined[-2000:]
    # The job never noticed: same parameters as the fault-free run, no recovery, one agent per node.
    assert code == 0, output
    assert run.result["final_step"] == STEPS
    assert run.result["param_sha256"] == reference_run.result["param_sha256"]
    assert not run.kinds(ev.FAULT_DETECTED) and len(run.kinds(ev.AGENT_REGISTERED)) == 2
    assert not run.kinds(ev.REQUEST_REFUSED)  # the intruder's token never got as far as a body
    intruder_address = network.address(INTRUDER_HOST)
    refused = [e.details for e in run.kinds(ev.AUTH_REFUSED) if e.time >= start.time]
    assert {d["client"] for d in refused} == {intruder_address}, refused
    assert {d.get("service", "controller") for d in refused} == {"controller", "store"}, refused
    assert parse_address(controller)[0] == network.address(0)
