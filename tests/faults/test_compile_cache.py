"""``compile_cache: DIR`` holds torch.compile's caches for every worker of the job: a process
that compiles the model again (a replacement, a restarted job, the next run) finds the graphs
an earlier process compiled there instead of compiling them. Here the second job, started
fresh on the same directory, compiles nothing: every graph of rank 0 is a cache hit. A
directory that cannot be created is refused at start in one line naming the field."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, run_job, undying_command

pytestmark = pytest.mark.faults

LOOP = REPO / "examples" / "loop" / "train.py"
ONE_NODE = ["--nnodes", "1", "--nproc-per-node", "2"]


def compiled_run(run_dir: Path, cache: Path) -> dict:
    run = run_job(run_dir, [*ONE_NODE, "--set", f"compile_cache={cache}"], steps=3, script=LOOP, timeout=400,
                  script_args=["--compile", "--warmup", "1"])
    assert run.returncode == 0, run.output + run.logs()
    return run.result


def test_a_second_job_finds_its_compiled_graphs_in_the_compile_cache(tmp_path: Path) -> None:
    cache = tmp_path / "compile-cache"
    first = compiled_run(tmp_path / "first", cache)
    assert first["compiled_graphs"]["cache_misses"] > 0, first
    assert any(cache.rglob("*")), "nothing was written to compile_cache"
    second = compiled_run(tmp_path / "second", cache)
    assert second["compiled_graphs"] == {"cache_hits": first["compiled_graphs"]["cache_misses"],
                                         "cache_misses": 0}, second
    assert second["param_sha256"] == first["param_sha256"]


def test_a_compile_cache_that_cannot_be_created_is_refused_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    command = undying_command(["run", *ONE_NODE, "--set", f"compile_cache={blocker / 'cache'}", str(LOOP)])
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("undying: error: compile_cache: allowed a directory"), line
