"""The benchmarks still run against the current API: the checkpoint benchmark (a smoke run at 4M
parameters), the control-plane scale simulation (64 ranks), T1 per node (two ranks, small) and the T2
load (two layers, page cache warm)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_checkpoint_benchmark_runs_on_a_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "checkpoint.json"
    done = subprocess.run([sys.executable, "bench/checkpoint.py", "--sizes", "tiny", "--repeats", "1",
                           "--loop-rounds", "1", "--work-dir", str(tmp_path / "work"), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert row["size"] == "tiny" and row["adamw"]
    for method in ("copy", "undying", "torch_save", "async_save"):
        assert row[method]["stall_s"] > 0, method
    assert row["undying"]["load_t1_s"] > 0 and row["undying"]["load_t2_s"] > 0
    assert set(row["loop"]["step_s"]) == {"none", "boundary", "overlapped"}
    assert "| tiny |" in done.stdout


def test_scale_benchmark_runs_and_steady_training_wakes_no_tick(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    done = subprocess.run([sys.executable, "bench/scale.py", "--ranks", "64", "--seconds", "1", "--repeats", "1",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    steady = row["steady"]
    # Every beat and poll woke the loop under the shell's earlier rule; none of them is news.
    assert steady["wakes_before_per_s"] > 64 and steady["news_ticks_per_s"] == 0
    assert steady["ticks_per_s"] > 0 and row["in_place"][0]["plan_reply_bytes"] < 1024
    assert "| 64 |" in done.stdout


def test_t1_per_node_benchmark_reads_back_bitwise_halves_the_memory_and_splits_the_embedding(tmp_path: Path) -> None:
    """Two real processes of one node write their parts of the replica; each puts the node's snapshot
    back together bitwise, and the node's slots hold the replica once, not once per rank. The replica
    is an embedding and its two AdamW moments (three equal tensors): dealt whole, one rank copies two
    of them; split by bytes, each copies half."""
    out = tmp_path / "t1.json"
    done = subprocess.run([sys.executable, "bench/t1_per_node.py", "--ranks", "2", "--layers", "0", "--embedding", "4096",
                           "--rounds", "3", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert all(row["bitwise_equal"] for row in rows.values())
    assert rows["per node"]["node_bytes"] < 0.6 * rows["per rank"]["node_bytes"]
    state = rows["per node"]["state_bytes"]
    assert rows["per node"]["largest_snapshot_bytes"] < 0.55 * state
    assert rows["per node, whole tensors"]["largest_snapshot_bytes"] > 0.6 * state


def test_t2_load_benchmark_loads_the_same_state_every_way(tmp_path: Path) -> None:
    """Each case of the T2 load bench (undying's read, the read before it, torch.load) in a fresh
    process ends with the same parameter and optimizer-state digest."""
    out = tmp_path / "t2_load.json"
    done = subprocess.run([sys.executable, "bench/t2_load.py", "--layers", "2", "--repeats", "1", "--caches", "warm",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["bitwise_equal"] and len(result["rows"]) == 3
    assert all(row["load_s"] > 0 and row["peak_rss_growth_mib"] > 0 for row in result["rows"])
