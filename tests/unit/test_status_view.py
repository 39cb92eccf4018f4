"""``undying status``'s table, drawn from a /status answer (no processes): ranks, PIDs, phases,
steps, loss, heartbeat ages and generations; one row per node for a large job; the latest faults."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from undying.launch.status_view import RANK_ROWS_UP_TO, render_status

NOW = 1_700_000_100.0


def status_of(nodes: int, per_node: int) -> dict[str, Any]:
    ranks = {str(r): {"node": r // per_node, "step": 120 + (r == 3), "phase": "computing", "pid": 4000 + r,
                      "generation": 2 if r == 1 else 1, "done": False, "exitcode": None,
                      "seconds_since_heartbeat": 0.25, "scalars": {"loss": 2.5 + r / 100}}
             for r in range(nodes * per_node)}
    return {
        "job_id": "d7193e480156", "state": "running", "generation": 2, "restart_count": 1, "max_restarts": 32767,
        "world_size": nodes * per_node, "committed_step": 120, "message": "", "uptime_seconds": 75.0,
        "faults": {"worker_exit": 1}, "recovery": None,
        "nodes": {str(n): {"alive": True, "pid": 300 + n, "host": f"host{n}", "standby": False,
                           "seconds_since_poll": 0.1, "running_workers": per_node} for n in range(nodes)},
        "ranks": ranks, "steps_per_second": 6.1, "durable_checkpoint": {"step": 110, "age_seconds": 2.0},
        "scalars": {"loss": {"mean": 2.515, "min": 2.5, "max": 2.53}},
        "recent": [{"time": NOW - 14, "kind": "fault_detected", "text": "FAULT rank 1 exited (killed by SIGKILL)"},
                   {"time": NOW - 13, "kind": "recovered", "text": "training again at step 41, 1.40 s after the fault"}],
    }


def text_of(status: dict[str, Any]) -> str:
    console = Console(record=True, width=160)
    console.print(render_status(status, now=NOW))
    return console.export_text()


def test_a_small_job_has_one_row_per_rank():
    text = text_of(status_of(nodes=2, per_node=2))
    lines = text.splitlines()
    assert lines[0].startswith("job d7193e480156 running")
    for fact in ("generation 2", "world 4", "step 120", "6.10 steps/s", "loss 2.515", "recoveries 1/32767",
                 "checkpoint step 110 (2 s old)", "up 1 min 15 s"):
        assert fact in lines[0], fact
    header = next(line for line in lines if "rank" in line and "pid" in line)
    assert header.split() == ["node", "┃", "host", "┃", "rank", "┃", "pid", "┃", "phase", "┃", "step", "┃", "loss",
                              "┃", "heartbeat", "┃", "gen"]
    row = next(line for line in lines if "4001" in line).split("│")
    assert [cell.strip() for cell in row] == ["0", "host0", "1", "4001", "computing", "120", "2.51", "0.2 s", "2"]
    assert "latest faults and recoveries:" in text
    assert "(14 s ago)  FAULT rank 1 exited (killed by SIGKILL)" in text


def test_a_large_job_has_one_row_per_node():
    status = status_of(nodes=8, per_node=8)
    assert len(status["ranks"]) > RANK_ROWS_UP_TO
    lines = text_of(status).splitlines()
    rows = [line for line in lines if line.lstrip()[:1].isdigit() and "│" in line]
    assert len(rows) == 8
    first = [cell.strip() for cell in rows[0].split("│")]
    assert first == ["0", "host0", "0-7", "8", "computing 8", "120-121", "2.535", "0.2 s", "1,2"]


def test_a_lost_node_and_a_spare_show_without_ranks():
    status = status_of(nodes=2, per_node=2)
    status["nodes"]["1"]["alive"] = False
    status["nodes"]["2"] = {"alive": True, "pid": 302, "host": "host2", "standby": True, "seconds_since_poll": 0.1,
                            "running_workers": 0}
    text = text_of(status)
    assert any(line.split("│")[0].strip() == "1" and "lost" in line for line in text.splitlines())
    assert any(line.split("│")[0].strip() == "2" and "spare" in line for line in text.splitlines())
