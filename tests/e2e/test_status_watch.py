"""``undying status RUN_DIR --watch`` in a real terminal (tmux): the table redrawn in place while a
job trains, its steps moving, the injected fault and the recovery appearing beneath, and the watch
ending with the job."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO, start_job, wait_no_processes

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=10).stdout


def test_watch_redraws_steps_and_shows_the_fault(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    process, mark = start_job(run_dir, ["--set", "process_recover=true", "--recover-strategy", "recover-in-place",
                                        "--inject", "kill:rank=1:step=25"], steps=70,
                              script_args=["--step-sleep", "0.1"])
    session = f"undying-watch-{uuid.uuid4().hex[:8]}"
    try:
        deadline = time.time() + 120
        while not (run_dir / "controller.json").exists():
            assert time.time() < deadline and process.poll() is None, "the job never wrote controller.json"
            time.sleep(0.2)
        watch = (f"cd {REPO} && PYTHONPATH={os.environ.get('PYTHONPATH', '')} {sys.executable} -m undying.cli "
                 f"status {run_dir} --watch --interval 0.3; echo WATCH-EXIT $?; sleep 60")
        tmux("new-session", "-d", "-s", session, "-x", "150", "-y", "40", watch)
        screens: list[str] = []
        while time.time() < deadline:
            screen = tmux("capture-pane", "-p", "-t", session)
            screens.append(screen)
            if "WATCH-EXIT" in screen:
                break
            time.sleep(0.5)
        process.communicate(timeout=60)
    finally:
        tmux("kill-session", "-t", session)
        if process.poll() is None:
            process.kill()
    assert wait_no_processes(mark) == []
    assert process.returncode == 0
    # Redrawn in place: every screen holds one table (one header line), not a growing scroll of them.
    headers = [[line for line in screen.splitlines() if line.startswith("job ")] for screen in screens]
    assert all(len(found) <= 1 for found in headers), screens[-1]
    steps = [int(match.group(1)) for found in headers if found
             for match in [re.search(r"\| step (\d+) \|", found[0])] if match]
    assert len(set(steps)) >= 3 and steps == sorted(steps), str(steps)
    table = next(screen for screen in screens if "heartbeat" in screen)
    assert all(word in table for word in ("node", "rank", "pid", "phase", "loss", "gen"))
    assert any("FAULT rank 1 exited (killed by SIGKILL)" in screen for screen in screens), screens[-1]
    assert any("training again at step" in screen for screen in screens)
    assert "WATCH-EXIT 0" in screens[-1], screens[-1]
