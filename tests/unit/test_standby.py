"""The warm standby interpreter (undying/standby.py): it imports on a thread of low CPU priority and
runs its rank on the main thread at normal priority; an empty stdin ends it at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from undying.standby import PRELOAD_NICE

REPORT_THREADS = """
import json, os, sys
nice = {int(task): int(open(f"/proc/self/task/{task}/stat").read().rsplit(")", 1)[1].split()[16])
        for task in os.listdir("/proc/self/task")}
json.dump({"main": os.getpriority(os.PRIO_PROCESS, 0), "threads": nice, "argv": sys.argv[1:],
           "torch_loaded": "torch._dynamo" in sys.modules}, open(sys.argv[1], "w"))
"""


def thread_nice_values(pid: int) -> dict[int, int]:
    values = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
        except OSError:
            continue
        values[int(task)] = int(stat.rsplit(")", 1)[1].split()[16])
    return values


def test_a_standby_imports_at_low_priority_and_runs_its_rank_at_normal_priority(tmp_path: Path) -> None:
    script, report, log = tmp_path / "rank.py", tmp_path / "report.json", tmp_path / "rank.log"
    script.write_text(REPORT_THREADS)
    standby = subprocess.Popen([sys.executable, "-u", "-m", "undying.standby"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # While torch is being imported (seconds), a thread other than the main one runs at PRELOAD_NICE.
        seen_low: set[int] = set()
        deadline = time.monotonic() + 30
        while not seen_low and time.monotonic() < deadline and standby.poll() is None:
            seen_low = {task for task, nice in thread_nice_values(standby.pid).items() if nice == PRELOAD_NICE}
            time.sleep(0.02)
        assert seen_low and standby.pid not in seen_low, "the imports run on a low-priority thread"
        assert thread_nice_values(standby.pid)[standby.pid] == 0, "the main thread keeps normal priority"
        assert standby.stdout is not None and standby.stdout.readline().strip() == b"ready"
        assignment = {"env": dict(os.environ), "command": [sys.executable, "-u", str(script), str(report)],
                      "log": str(log)}
        assert standby.stdin is not None
        standby.stdin.write((json.dumps(assignment) + "\n").encode())
        standby.stdin.close()
        assert standby.wait(timeout=60) == 0, log.read_text()
    finally:
        standby.kill()
    result = json.loads(report.read_text())
    assert result["torch_loaded"] and result["argv"] == [str(report)]
    assert result["main"] == 0
    if os.geteuid() == 0:
        # Allowed to lower nice values again: every thread the import started is back at normal priority.
        assert set(result["threads"].values()) == {0}, result


def test_a_standby_without_a_rank_exits_at_once_even_while_importing() -> None:
    standby = subprocess.Popen([sys.executable, "-m", "undying.standby"], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, errors = standby.communicate(b"", timeout=30)
    assert standby.returncode == 0, errors
    assert not errors
