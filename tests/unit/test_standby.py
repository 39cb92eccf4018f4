"""The node's warm standby (undying/agent/standby.py) and the agent's handle on it (warm_standby.py): a
forked worker runs its script as ``python script.py`` would, its exit (code or signal) reaches the
agent, no worker outlives the standby, and where the agent stops the job on SIGTERM the standby and
its workers ignore it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from undying.agent.procs import ignores_sigterm, stop_processes
from undying.agent.warm_standby import WarmStandby

REPORT = """
import atexit, json, os, signal, sys
def report():
    json.dump({"argv": sys.argv, "name": __name__, "ppid": os.getppid(), "cwd": os.getcwd(),
               "mine": os.environ.get("ONLY_IN_ASSIGNMENT"), "leaked": "ONLY_IN_STANDBY" in os.environ,
               "torch_loaded_before": TORCH_LOADED, "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
               "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "stdin": sys.stdin.read(),
               "path0": sys.path[0]}, open(sys.argv[1], "w"))
TORCH_LOADED = "torch._dynamo" in sys.modules
atexit.register(report)  # the interpreter's own exit runs the script's atexit hooks
print("to stdout"); print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[2]))
"""

SLEEP = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"


@pytest.fixture
def standby(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ONLY_IN_STANDBY", "1")
    handle = WarmStandby(tmp_path / "standby.log")
    yield handle
    handle.close()


def says_up(log: Path) -> bool:
    return log.exists() and "up" in log.read_text()


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_forked_worker_runs_its_script_as_python_would(standby: WarmStandby, tmp_path: Path) -> None:
    script, report, log = tmp_path / "train.py", tmp_path / "report.json", tmp_path / "rank0.log"
    script.write_text(REPORT)
    env = {"ONLY_IN_ASSIGNMENT": "yes", "PATH": os.environ.get("PATH", "")}
    worker = standby.fork(env, [sys.executable, "-u", str(script), str(report), "3"], log)
    assert worker is not None
    assert worker.wait(timeout=60) == 3, log.read_text()
    result = json.loads(report.read_text())
    assert result["argv"] == [str(script), str(report), "3"] and result["name"] == "__main__"
    assert result["mine"] == "yes" and not result["leaked"], "the assignment's environment, only it"
    assert result["torch_loaded_before"], "forked from an interpreter that imported torch"
    assert result["ppid"] == standby.process.pid
    assert result["sigint"] and result["sigterm"] and result["stdin"] == ""
    assert result["path0"] == str(tmp_path) and result["cwd"] == os.getcwd()
    assert log.read_text().splitlines() == ["to stdout", "to stderr"]
    assert "ready" in (tmp_path / "standby.log").read_text()


def test_a_killed_worker_reads_its_signal_and_the_standby_forks_on(standby: WarmStandby, tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text(SLEEP)
    first = standby.fork(dict(os.environ), [sys.executable, str(script)], tmp_path / "a.log")
    second = standby.fork(dict(os.environ), [sys.executable, str(script)], tmp_path / "b.log")
    assert first is not None and second is not None and first.pid != second.pid
    wait_for(lambda: says_up(tmp_path / "a.log"))
    os.kill(first.pid, signal.SIGKILL)
    assert first.wait(timeout=10) == -signal.SIGKILL
    assert second.poll() is None
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=10) == -signal.SIGTERM
    second.send_signal(signal.SIGKILL)  # ended: as Popen, nothing is sent to a pid that may be reused


def test_no_worker_outlives_its_standby(standby: WarmStandby, tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text(SLEEP)
    worker = standby.fork(dict(os.environ), [sys.executable, str(script)], tmp_path / "a.log")
    assert worker is not None
    wait_for(lambda: says_up(tmp_path / "a.log"))
    os.kill(standby.process.pid, signal.SIGKILL)
    assert worker.wait(timeout=10) == -signal.SIGKILL, "the agent learns its workers went with the standby"
    wait_for(lambda: not Path(f"/proc/{worker.pid}").exists() or ") Z " in Path(f"/proc/{worker.pid}/stat").read_text())
    assert not standby.usable()
    assert standby.fork(dict(os.environ), [sys.executable, str(script)], tmp_path / "b.log") is None


def test_closing_the_standby_ends_its_workers(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text(SLEEP)
    standby = WarmStandby(tmp_path / "standby.log")
    worker = standby.fork(dict(os.environ), [sys.executable, str(script)], tmp_path / "a.log")
    assert worker is not None
    assert standby.process.stdin is not None
    standby.process.stdin.close()  # the agent is done with it: it kills what it forked and exits
    assert standby.process.wait(timeout=30) == 0
    assert worker.wait(timeout=10) == -signal.SIGKILL


def test_a_standby_with_a_gpu_device_open_is_not_forked_from(tmp_path: Path) -> None:
    """The fork guard reads the process's open files: a GPU driver's device among them makes a fork
    unsafe (a driver initialised before a fork cannot be used in the child); none, and it is safe."""
    from undying.agent.standby import fork_unsafe_reason

    assert fork_unsafe_reason() is None
    fds = tmp_path / "fd"
    fds.mkdir()
    (fds / "3").symlink_to("/dev/null")
    assert fork_unsafe_reason(str(fds)) is None
    (fds / "4").symlink_to("/dev/nvidiactl")
    assert "nvidiactl" in (fork_unsafe_reason(str(fds)) or "")


DISPOSITIONS = """
import json, signal, sys
json.dump({"sigint": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
           "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_IGN}, open(sys.argv[1], "w"))
"""


def test_where_the_agent_stops_the_job_on_sigterm_its_standby_and_workers_ignore_it(tmp_path: Path) -> None:
    """--sigterm stop (a Slurm step signals every process of the step): the standby survives SIGTERM and
    SIGINT, and a worker it forks starts with both ignored, as a ``python`` started so would;
    stopping such a worker does not wait out a grace period for a SIGTERM it ignores."""
    standby = WarmStandby(tmp_path / "standby.log", ignore_stop_signals=True)
    try:
        script, report = tmp_path / "report.py", tmp_path / "report.json"
        script.write_text(DISPOSITIONS)
        worker = standby.fork(dict(os.environ), [sys.executable, str(script), str(report)], tmp_path / "a.log")
        assert worker is not None and worker.wait(timeout=60) == 0, (tmp_path / "a.log").read_text()
        assert json.loads(report.read_text()) == {"sigint": True, "sigterm": True}
        standby.process.send_signal(signal.SIGTERM)
        standby.process.send_signal(signal.SIGINT)
        (tmp_path / "sleep.py").write_text(SLEEP)
        sleeper = standby.fork(dict(os.environ), [sys.executable, str(tmp_path / "sleep.py")], tmp_path / "b.log")
        assert sleeper is not None and standby.process.poll() is None
        wait_for(lambda: says_up(tmp_path / "b.log"))
        assert ignores_sigterm(sleeper.pid)
        sent: list[int] = []
        original = sleeper.send_signal
        sleeper.send_signal = lambda signum: (sent.append(signum), original(signum))  # type: ignore[method-assign]
        stop_processes([sleeper], grace=600.0)
        assert sent[0] == signal.SIGKILL and sleeper.poll() == -signal.SIGKILL
    finally:
        standby.close()
