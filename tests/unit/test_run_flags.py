"""``undying run``'s torchrun flags: --redirects, --tee and --local-ranks-filter with torchrun's
meanings, --nproc-per-node's words, --master-addr/--master-port onto the controller, --standalone,
--log-dir, --version; each bad value is one error line naming the flag and what is allowed."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from undying import __version__
from undying.agent.console_streams import (
    BOTH,
    NONE,
    STDERR,
    STDOUT,
    ConsoleStreams,
    StreamOptionError,
    console_streams,
)
from undying.cli import main
from undying.launch.torchrun_flags import FlagError, controller_flags, nproc_per_node

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py")


def test_every_stream_is_shown_by_default() -> None:
    assert console_streams(3) == ConsoleStreams((BOTH, BOTH, BOTH))


@pytest.mark.parametrize(("redirects", "tee", "ranks", "shown"), [
    ("3", None, None, (NONE, NONE)),  # logged only
    ("1", None, None, (STDERR, STDERR)),  # stdout logged only: stderr still shown
    ("3", "2", None, (STDERR, STDERR)),  # a tee'd stream is shown even when redirected
    ("0:1,1:2", None, None, (STDERR, STDOUT)),
    ("3", "1:3", None, (NONE, BOTH)),  # a local rank the map leaves out: 0
    (None, None, "1", (NONE, BOTH)),
    ("2", "0:1", "0", (STDOUT, NONE)),
])
def test_torchrun_meanings(redirects: str | None, tee: str | None, ranks: str | None,
                           shown: tuple[int, ...]) -> None:
    streams = console_streams(2, redirects, tee, ranks)
    assert streams.by_local_rank == shown
    assert ConsoleStreams.from_text(streams.to_text()) == streams  # as the agent gets it
    assert streams.of(5) == NONE


@pytest.mark.parametrize(("flags", "named"), [
    (("4", None, None), "--redirects: allowed 0 (none), 1 (stdout), 2 (stderr), 3 (both)"),
    ((None, "0:1,x", None), "--tee: allowed"),
    ((None, "2:1", None), "--tee: local rank 2 out of range; allowed 0..1"),
    ((None, None, "0,a"), "--local-ranks-filter: allowed a comma-separated list of local ranks"),
    ((None, None, "3"), "--local-ranks-filter: local rank 3 out of range; allowed 0..1"),
])
def test_bad_stream_flags_name_the_flag(flags: tuple[str | None, str | None, str | None], named: str) -> None:
    with pytest.raises(StreamOptionError, match=named.replace("(", r"\(").replace(")", r"\)")):
        console_streams(2, *flags)


def test_nproc_per_node_words() -> None:
    assert nproc_per_node("4") == 4
    assert nproc_per_node("cpu") == len(os.sched_getaffinity(0))
    assert nproc_per_node("auto") == len(os.sched_getaffinity(0))  # no accelerator on the CPU build
    for bad in ("0", "-1", "many", "2.5"):
        with pytest.raises(FlagError, match=f"--nproc-per-node: allowed auto, cpu, gpu or a positive integer "
                                            f"\\(got '{bad}'\\)"):
            nproc_per_node(bad)


def run_args(**given: object) -> argparse.Namespace:
    defaults: dict[str, object] = {"controller": None, "controller_bind": None, "master_addr": None,
                                   "master_port": None, "standalone": False, "node_rank": None, "etcd": None}
    return argparse.Namespace(**{**defaults, **given})


def test_master_addr_and_port_are_the_controller() -> None:
    assert controller_flags(run_args(), 1) == (None, "127.0.0.1")
    assert controller_flags(run_args(master_port=29600), 1) == ("127.0.0.1:29600", "127.0.0.1")
    # Node 0 of a multi-node job listens where the other nodes reach it, unless told otherwise.
    assert controller_flags(run_args(master_addr="10.0.0.5", node_rank=0), 2) == ("10.0.0.5:29500", "10.0.0.5")
    assert controller_flags(run_args(master_addr="10.0.0.5", node_rank=0, controller_bind="0.0.0.0"), 2) == \
        ("10.0.0.5:29500", "0.0.0.0")
    assert controller_flags(run_args(master_addr="10.0.0.5", node_rank=1), 2) == ("10.0.0.5:29500", "127.0.0.1")
    assert controller_flags(run_args(master_addr="::1", master_port=7), 1)[0] == "[::1]:7"
    with pytest.raises(FlagError, match="give them or --controller HOST:PORT, not both"):
        controller_flags(run_args(master_addr="a", controller="b:1"), 1)


def test_standalone_is_one_node_with_its_own_controller() -> None:
    assert controller_flags(run_args(standalone=True), 1) == (None, "127.0.0.1")
    with pytest.raises(FlagError, match="--standalone: one node; allowed --nnodes 1 \\(got 2\\)"):
        controller_flags(run_args(standalone=True), 2)
    with pytest.raises(FlagError, match="not with --node-rank, --master-addr"):
        controller_flags(run_args(standalone=True, node_rank=0, master_addr="x"), 1)


@pytest.mark.parametrize(("args", "expected"), [
    (["--tee", "7"], "--tee: allowed 0 (none)"),
    (["--redirects", "0:1,0:9"], "--redirects: allowed"),
    (["--nproc-per-node", "2", "--local-ranks-filter", "2"], "--local-ranks-filter: local rank 2 out of range"),
    (["--nproc-per-node", "lots"], "--nproc-per-node: allowed auto, cpu, gpu or a positive integer"),
    (["--standalone", "--nnodes", "2"], "--standalone: one node"),
    (["--master-addr", "h", "--controller", "h:1"], "not both"),
    (["--master-port", "70000"], "--master-port: allowed 1..65535"),
    (["--log-dir", SCRIPT], "--log-dir: allowed a directory"),
])
def test_bad_flags_are_one_line(args: list[str], expected: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        main(["run", "--run-dir", str(run_dir), *args, SCRIPT])
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("undying: error: ") and expected in lines[0], lines[0]
    assert not run_dir.exists()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"undying {__version__}"
