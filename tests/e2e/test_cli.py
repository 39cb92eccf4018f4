"""The CLI as a user runs it: bad input is one line and exit code 2, nothing started or written;
a running job refuses clients without its token and stops on `undying stop`; a node with another
job spec is refused; report draws a run."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import EXAMPLE, MARK_ENV, REPO, start_job, undying_command, wait_no_processes
from undying import events as ev
from undying.events import read_events


def cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "undying.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["run", "--nnodes", "two", str(EXAMPLE)], "--nnodes"),
        (["run", "--set", "wait_reschedule_timeout=10", str(EXAMPLE)], "wait_reschedule_timeout"),
        (["run", "--max-restarts", "40000", str(EXAMPLE)], "max_restarts"),
        (["run", "--recover-strategy", "retry,bogus", str(EXAMPLE)], "recover_strategy"),
        # Every strategy the banner lists can run: recover needs pods rescheduled.
        (["run", "--recover-strategy", "recover-in-place,recover", str(EXAMPLE)],
         "pod_rescheduling: recover (in recover_strategy) needs pod_rescheduling: on"),
        (["run", "--recover-strategy", "retry", "--set", "process_recover=false", str(EXAMPLE)],
         "needs process_recover: true"),
        (["run", "--set", "watchdog=maybe", str(EXAMPLE)], "watchdog"),
        (["run", "--monitor-interval", "-1", str(EXAMPLE)], "monitor_interval"),
        (["run", "--set", "no_such_knob=1", str(EXAMPLE)], "no_such_knob"),
        (["run", "--inject", "kill:rank=9:step=1", str(EXAMPLE)], "rank must be <"),
        (["run", "--inject", "explode:rank=0:step=1", str(EXAMPLE)], "unknown kind"),
        (["run", "--node-rank", "3", "--nnodes", "2", str(EXAMPLE)], "--node-rank"),
        (["run", "no_such_script.py"], "not found"),
        (["run"], "script"),
        (["run", "--bogus-flag", str(EXAMPLE)], "--bogus-flag"),
        (["frobnicate"], "frobnicate"),
        (["run", "--sigterm", "quit", str(EXAMPLE)], "--sigterm"),
        (["stop"], "stop: give the job's RUN_DIR"),
        (["slurm", "sbatch", "no_such_job.yaml", "--nodes", "2", str(EXAMPLE)], "no_such_job.yaml"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], expected: str) -> None:
    run_dir = tmp_path / "run"
    if args[:1] == ["run"] and len(args) > 1:
        args = ["run", "--run-dir", str(run_dir), *args[1:]]
    result = cli(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("undying: error:") and expected in lines[0], lines[0]
    assert not run_dir.exists(), "bad input must not start or write anything"


def test_bad_config_file_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("recover_strategy: [retry, retry]\nprocess_recover: true\n")
    result = cli("run", "--config", str(config), "--run-dir", str(tmp_path / "run"), str(EXAMPLE))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "recover_strategy" in result.stderr
    config.write_text("checkpoint:\n  interval: 0\n")
    result = cli("run", "--config", str(config), str(EXAMPLE))
    assert result.returncode == 2 and "checkpoint.interval" in result.stderr


def _request(address: str, method: str, path: str, token: str | None, body: dict | None = None) -> int:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    conn.request(method, path, body=json.dumps(body or {}) if method == "POST" else None, headers=headers)
    status = conn.getresponse().status
    conn.close()
    return status


def test_running_job_refuses_clients_without_token(tmp_path: Path) -> None:
    token = "t0ken-" + "x" * 30
    token_file = tmp_path / "token"
    token_file.write_text(token)
    run_dir = tmp_path / "run"
    process, mark = start_job(run_dir, ["--token-file", str(token_file)], steps=100_000)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            events = read_events(run_dir) if (run_dir / "events.jsonl").exists() else []
            if any(event.kind == ev.HEARTBEAT for event in events):
                break
            time.sleep(0.2)
        address = next(e for e in events if e.kind == ev.JOB_START).details["controller"]
        for method, path in [("GET", "/status"), ("GET", "/metrics"), ("GET", "/events"),
                             ("POST", "/v1/agent/hello"), ("POST", "/v1/job/stop"),
                             ("POST", "/v1/worker/heartbeat")]:
            assert _request(address, method, path, None) == 401, path
            assert _request(address, method, path, "wrong-token") == 401, path
        hello = {"node": 0, "pid": 1, "hostname": "intruder", "nproc": 2}
        assert _request(address, "POST", "/v1/agent/hello", "nope", hello) == 401
        wrong = tmp_path / "wrong"
        wrong.write_text("w" * 32)
        assert cli("status", "--controller", address, "--token-file", str(wrong)).returncode == 1
        status = cli("status", "--controller", address, "--token-file", str(token_file), "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["state"] == "running"
        # The run directory is enough: the controller's address and the token (mode 0600) are kept there.
        assert stat.S_IMODE((run_dir / "controller.token").stat().st_mode) == 0o600
        table = cli("status", str(run_dir))
        assert table.returncode == 0, table.stderr
        assert table.stdout.startswith("job ") and " running " in table.stdout.splitlines()[0]
        assert all(word in table.stdout for word in ("rank", "pid", "phase", "heartbeat"))
        assert json.loads(cli("status", str(run_dir), "--json").stdout)["world_size"] == 4
        assert process.poll() is None, "the job must keep running"
        refused = [e for e in read_events(run_dir) if e.kind == ev.AUTH_REFUSED]
        assert len(refused) >= 13
        assert not any(e.kind == ev.AGENT_REGISTERED and e.details.get("host") == "intruder"
                       for e in read_events(run_dir))
        assert cli("stop", "--controller", address, "--token-file", str(wrong)).returncode == 1
        assert process.poll() is None, "a stop without the token must change nothing"
        # `undying stop RUN_DIR` (POST /v1/job/stop): the newest committed step persisted, then exit 75.
        stopped = cli("stop", str(run_dir), "--reason", "test")
        assert stopped.returncode == 0, stopped.stderr
        assert "stops once every rank persisted its newest step" in stopped.stdout
        # The first SIGTERM this process gets asks for the same stop, though the stop was asked
        # already (under Slurm another node's request may come first): not a cancel.
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        assert process.returncode == 75, output
        assert "job stopped: stopped (test) with step" in output
    finally:
        if process.poll() is None:
            process.kill()
    assert wait_no_processes(mark) == []
    # The job is over: nothing in its run directory points at a controller any more.
    assert not (run_dir / "controller.token").exists()
    ended = cli("status", str(run_dir))
    assert ended.returncode == 1 and "no job running from here" in ended.stderr
    assert "no job running from here" in cli("stop", str(run_dir)).stderr


def test_report_summarizes_and_draws(tmp_path: Path) -> None:
    from undying.events import Event, EventLog

    log = EventLog(tmp_path)
    start = time.time()
    log.emit(Event(ev.JOB_START, time=start, details={"world_size": 2}))
    log.emit(Event(ev.GENERATION_START, time=start + 0.1, generation=1, details={"world_size": 2}))
    for rank in (0, 1):
        log.emit(Event(ev.HEARTBEAT, time=start + 1, rank=rank, node=0, step=5, generation=1))
    log.emit(Event(ev.JOB_END, time=start + 2, generation=1, step=5,
                   details={"outcome": "succeeded", "exit_code": 0, "message": "finished"}))
    log.close()
    result = cli("report", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "succeeded" in result.stdout
    assert (tmp_path / "timeline.svg").read_text().startswith("<svg")
    assert (tmp_path / "report.png").read_bytes().startswith(b"\x89PNG")


def test_a_node_started_with_another_spec_is_refused_and_the_same_spec_joins(tmp_path: Path) -> None:
    """Real multi-node on loopback, one `undying run` per node: node 1 started with another
    comm_timeout than node 0's controller is refused with one line naming the field; started with
    the same spec, it joins and the job runs to its end."""
    token_file = tmp_path / "token"
    token_file.write_text("k" * 40)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--controller", f"127.0.0.1:{port}",
              "--token-file", str(token_file), "--monitor-interval", "0.3", "--set", "warm_standby=false",
              "--checkpoint-dir", str(tmp_path / "shared-checkpoints")]  # a run directory per node, as on hosts
    mark = uuid.uuid4().hex
    env = dict(os.environ, **{MARK_ENV: mark, "PYTHONUNBUFFERED": "1"})

    def node(rank: int, comm_timeout: int) -> subprocess.Popen:
        args = [*common, "--node-rank", str(rank), "--set", f"comm_timeout={comm_timeout}",
                "--run-dir", str(tmp_path / f"node{rank}"), str(EXAMPLE), "--steps", "6"]
        if rank == 0:
            args[1:1] = ["--controller-bind", "127.0.0.1"]
        return subprocess.Popen(undying_command(args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=REPO)

    leader = node(0, 30)
    try:
        stranger = node(1, 90)
        output, _ = stranger.communicate(timeout=120)
        assert stranger.returncode != 0, output
        refusal = [line for line in output.splitlines() if "refused" in line]
        assert refusal and refusal[-1].endswith(
            "the agent's job spec differs from the controller's in: comm_timeout"), output
        assert leader.poll() is None, "the controller keeps waiting for node 1"

        same = node(1, 30)
        output, _ = same.communicate(timeout=180)
        assert same.returncode == 0, output
        output, _ = leader.communicate(timeout=60)
        assert leader.returncode == 0, output
    finally:
        for process in (leader,):
            if process.poll() is None:
                process.kill()
    assert wait_no_processes(mark) == []
