"""The ``undying run`` console as a user sees it: every worker's lines, whole and prefixed
``[rank N]`` (a replacement rank's too), each host's own ranks on real hosts, as torchrun's
--redirects/--tee/--local-ranks-filter choose, with the rank logs complete; and, in a real
terminal (tmux), one progress line whose step moves and which shows an injected fault."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import MARK_ENV, REPO, free_port, run_job, undying_command, wait_no_processes

pytestmark = pytest.mark.faults

SCRIPT = REPO / "tests" / "scripts" / "print_lines.py"
LINES, WIDTH = 3, 300
LINE = re.compile(rf"\[rank (\d)\] (out|err) (\d) of rank (\d): (?:abcdefghij){{{WIDTH // 10}}}")
PRINT_ARGS = ["--lines", str(LINES), "--width", str(WIDTH)]


def shown(output: str) -> Counter[tuple[int, str]]:
    """(rank, stream) -> how many of the script's lines the console showed; every line that names a
    rank of the script's must be one whole line of that rank's."""
    counts: Counter[tuple[int, str]] = Counter()
    for line in output.splitlines():
        if " of rank " not in line:
            continue
        match = LINE.fullmatch(line)
        assert match is not None and match[1] == match[4], f"not one whole line of one rank: {line[:120]!r}"
        counts[(int(match[1]), match[2])] += 1
    return counts


def test_every_rank_and_a_replacement_show_whole_prefixed_lines(tmp_path: Path) -> None:
    run = run_job(tmp_path / "run", ["--set", "process_recover=true", "--recover-strategy", "recover-in-place",
                                     "--inject", "kill:rank=1:step=3"],
                  steps=6, script=SCRIPT, script_args=PRINT_ARGS)
    assert run.returncode == 0, run.output + run.logs()
    assert run.kinds("replace"), "rank 1 must have been replaced"
    # Rank 1's first process and its replacement each print the lines.
    assert shown(run.output) == {(rank, stream): LINES * (2 if rank == 1 else 1)
                                 for rank in range(4) for stream in ("out", "err")}, run.output
    assert "\x1b" not in run.output and "[undying] step" not in run.output, "no terminal, no live line"
    rank1 = (run.run_dir / "logs" / "rank1.log").read_text()
    assert rank1.count("--- generation") == 2 and "[rank" not in rank1
    assert rank1.count("out 2 of rank 1: ") == 2 and rank1.count("err 2 of rank 1: ") == 2


def test_each_host_shows_its_ranks_as_its_flags_say(tmp_path: Path) -> None:
    """Two hosts of one job, plain ``python`` workers: node 0 shows only local rank 1's stderr
    (--local-ranks-filter 1 --redirects 1), node 1 only local rank 0's stdout (--redirects 3 --tee 0:1)."""
    (tmp_path / "token").write_text("c" * 40)
    port, mark = free_port(), uuid.uuid4().hex
    flags = {0: ["--local-ranks-filter", "1", "--redirects", "1"], 1: ["--redirects", "3", "--tee", "0:1"]}
    processes = {}
    for node in (0, 1):
        args = ["run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node), "--monitor-interval",
                "0.3", "--master-addr", "127.0.0.1", "--master-port", str(port), "--token-file",
                str(tmp_path / "token"), "--run-dir", str(tmp_path / f"node{node}"), "--checkpoint-dir",
                str(tmp_path / "checkpoints"), "--set", "warm_standby=false", *flags[node], str(SCRIPT), *PRINT_ARGS]
        processes[node] = subprocess.Popen(undying_command(args), env=dict(os.environ, **{MARK_ENV: mark}),
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    outputs = {node: process.communicate(timeout=240)[0] for node, process in processes.items()}
    assert [processes[node].returncode for node in (0, 1)] == [0, 0], outputs
    assert not wait_no_processes(mark)
    assert shown(outputs[0]) == {(1, "err"): LINES}, outputs[0]
    assert shown(outputs[1]) == {(2, "out"): LINES}, outputs[1]
    logs = {rank: tmp_path / f"node{rank // 2}" / "logs" for rank in range(4)}
    # The logs are complete: where one stream is shown (ranks 1 and 2), stderr has a file of its own.
    for rank in (1, 2):
        assert (logs[rank] / f"rank{rank}.log").read_text().count("out ") == LINES
        assert (logs[rank] / f"rank{rank}.stderr.log").read_text().count("err ") == LINES
    for rank in (0, 3):
        both = (logs[rank] / f"rank{rank}.log").read_text()
        assert both.count("out ") == both.count("err ") == LINES
        assert not (logs[rank] / f"rank{rank}.stderr.log").exists()


def tmux_binary() -> str:
    binary = shutil.which("tmux")
    if binary is None:
        message = "tmux is not installed (make test installs it where it can: scripts/ensure-tmux.sh)"
        if os.environ.get("UNDYING_REQUIRE_TMUX") == "1":
            raise AssertionError(message)
        pytest.skip(message)
    return binary


def test_progress_line_in_a_terminal_moves_and_shows_a_fault(tmp_path: Path) -> None:
    tmux = [tmux_binary(), "-L", f"undying-test-{uuid.uuid4().hex[:8]}"]
    mark = uuid.uuid4().hex
    job = undying_command(["run", "--nnodes", "2", "--nproc-per-node", "2", "--monitor-interval", "0.3",
                           "--set", "heartbeat_interval=0.5", "--run-dir", str(tmp_path / "run"),
                           "--set", "process_recover=true", "--recover-strategy", "recover-in-place",
                           "--inject", "kill:rank=1:step=25", "--redirects", "3", str(SCRIPT),
                           "--steps", "50", "--step-sleep", "0.1"])
    # Only the job carries the mark: the pane's shell and the tmux server are not the job's processes.
    pane = f"cd {shlex.quote(str(REPO))} && env {MARK_ENV}={mark} TERM=xterm {shlex.join(job)}; echo exit code $?"
    subprocess.run([*tmux, "new-session", "-d", "-x", "160", "-y", "40", f"{pane}; sleep 600"], check=True)
    screens: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (screens and "exit code" in screens[-1]):
            time.sleep(0.3)
            screens.append(subprocess.run([*tmux, "capture-pane", "-p", "-S", "-100"], capture_output=True,
                                          text=True, check=True).stdout)
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)
    final = screens[-1] if screens else ""
    assert "exit code 0" in final, final
    assert not wait_no_processes(mark)
    # While the job runs, the pane's last line is the live one: its step moves, of the script's 50.
    live = [screen.strip().splitlines()[-1] for screen in screens if screen.strip() and "exit code" not in screen]
    steps = [int(found[1]) for line in live if (found := re.match(r"\[undying\] step (\d+)/50 \(", line))]
    assert len(set(steps)) >= 3, live  # (a recovery that ends in a job restart may take it back)
    assert any(re.search(r"steps/s \| ETA \d:\d\d:\d\d \| loss ", line) for line in live), live
    assert any(re.search(r"\| \d+ faults?\b", line) for line in live), ("the live line counts the fault", live)
    # The fault's event line is printed above the live line, which is never left among the others.
    assert re.search(r": FAULT rank \d", final) and "job succeeded" in final, final
    assert not re.search(r"\[undying\] step \d+/50", final), final
