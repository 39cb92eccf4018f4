"""``undying slurm sbatch`` (slurm/command.py, slurm/batch.py): the batch script it writes asks Slurm
for N + K nodes with --no-kill, runs one `undying run` per node, and requeues the job on exit 75 and
on nothing else; a SIGTERM to the script's shell becomes `undying stop`. The script's logic is run
here by bash against stand-ins for srun, scontrol and undying (the real thing: tests/faults/test_slurm.py).
Every bad request is one error line."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from undying.cli import main
from undying.slurm.command import check_capacity, time_limit_seconds
from undying.slurm.errors import SlurmError

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py")


def write_script(tmp_path: Path, *options: str, spec: str = "nproc_per_node: 2\n") -> str:
    (tmp_path / "job.yaml").write_text(spec)
    out = tmp_path / "job.sbatch"
    assert main(["slurm", "sbatch", str(tmp_path / "job.yaml"), *options, "--out", str(out), "--python",
                 str(tmp_path / "bin" / "python"), "--", SCRIPT, "--steps", "30"]) == 0
    return out.read_text()


def test_the_script_asks_for_every_node_and_keeps_the_allocation_when_one_dies(tmp_path: Path) -> None:
    text = write_script(tmp_path, "--nodes", "2", "--standby", "1", "--partition", "gpu", "--time", "2:00:00",
                        "--gpus-per-node", "8", "--cpus-per-task", "16", "--sbatch-option=--exclusive")
    lines = text.splitlines()
    for wanted in ("#SBATCH --job-name=job", "#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1",
                   "#SBATCH --no-kill", "#SBATCH --requeue", "#SBATCH --signal=TERM@180",
                   "#SBATCH --open-mode=append", "#SBATCH --partition=gpu", "#SBATCH --time=2:00:00",
                   "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=16", "#SBATCH --exclusive"):
        assert wanted in lines, wanted
    srun = " ".join(text.split("srun ", 1)[1].split("&")[0].replace("\\\n", " ").split())
    for wanted in ("--no-kill", "--kill-on-bad-exit=0", "--ntasks-per-node=1", "--cpus-per-task=16",
                   f"run --nnodes 2 --standby 1 --config {tmp_path / 'job.yaml'} --nproc-per-node 8 {SCRIPT} "
                   "--steps 30"):
        assert wanted in srun, wanted
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def fake_tools(tmp_path: Path, srun_code: int, srun_seconds: float = 0.0) -> dict[str, str]:
    """srun, scontrol and the python that runs undying, each appending its arguments to calls.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls.log"
    for name, body in (("srun", f"sleep {srun_seconds}; exit {srun_code}"), ("scontrol", "exit 0"),
                       ("python", "exit 0")):
        tool = bin_dir / name
        tool.write_text(f'#!/bin/bash\necho "{name} $*" >> {calls}\n{body}\n')
        tool.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(tmp_path),
            "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "n[1-3]"}


@pytest.mark.parametrize(("code", "requeued"), [(0, False), (1, False), (2, False), (75, True), (130, False)])
def test_only_a_stopped_job_is_requeued(tmp_path: Path, code: int, requeued: bool) -> None:
    text = write_script(tmp_path, "--nodes", "2", "--standby", "1")
    done = subprocess.run(["bash", "-c", text], env=fake_tools(tmp_path, code), capture_output=True, text=True,
                          cwd=tmp_path, timeout=30)
    assert done.returncode == code, done.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls[0].startswith('srun --nodes=3 --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 ')
    assert ("scontrol requeue 77" in calls) is requeued, calls


def test_sigterm_to_the_batch_shell_asks_the_job_to_stop(tmp_path: Path) -> None:
    text = write_script(tmp_path, "--nodes", "2")
    script = tmp_path / "batch.sh"
    script.write_text(text)
    shell = subprocess.Popen(["bash", str(script)], env=fake_tools(tmp_path, 75, srun_seconds=3), cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    calls = tmp_path / "calls.log"
    deadline = time.monotonic() + 20
    while not (calls.exists() and "srun" in calls.read_text()):
        assert time.monotonic() < deadline, "srun never started"
        time.sleep(0.05)
    shell.send_signal(signal.SIGTERM)
    assert shell.wait(timeout=30) == 75  # srun's code, though the shell was signalled while waiting for it
    logged = calls.read_text().splitlines()
    assert f"python -m undying.cli stop {tmp_path}/runs/slurm-77" in logged, logged
    assert "scontrol requeue 77" in logged


@pytest.mark.parametrize(("args", "message"), [
    ([], "--nodes: required (the job's nodes, spares not counted), or nnodes in "),
    (["--nodes", "0"], "--nodes: allowed 1 or more (got 0)"),
    (["--nodes", "2", "--standby", "-1"], "--standby: allowed 0 or more spare nodes (got -1)"),
    (["--nodes", "2", "--time", "1h"], "--time: allowed MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS"),
    (["--nodes", "2", "--time", "2"], "--stop-warning 180 s leaves no training time within --time 2 (120 s)"),
    (["--nodes", "2", "--stop-warning", "0"], "--stop-warning: allowed 1..65535 seconds (got 0)"),
    (["--nodes", "2", "--job-name", "a b"], "--job-name: allowed 1-64 letters, digits"),
    (["--nodes", "2", "--sbatch-option", "exclusive"], "--sbatch-option: allowed one sbatch option"),
])
def test_a_bad_request_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                         message: str) -> None:
    (tmp_path / "job.yaml").write_text("nproc_per_node: 2\n")
    with pytest.raises(SystemExit) as exited:
        main(["slurm", "sbatch", str(tmp_path / "job.yaml"), *args, "--", SCRIPT])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and error.count("\n") == 1 and error.startswith("undying: error: " + message)


def test_the_spec_and_the_script_are_checked_before_anything_is_written(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    for spec, options, script, message in (
            ("nnodes: 2\nheartbeat_timeout: 0.1\n", [], SCRIPT, "job spec: heartbeat_timeout: must be greater"),
            ("nnodes: 2\n", ["--nodes", "3"], SCRIPT, f"--nodes 3: {tmp_path / 'job.yaml'} says nnodes: 2"),
            ("nnodes: 2\n", [], "no_such_train.py", "script 'no_such_train.py' not found"),
    ):
        (tmp_path / "job.yaml").write_text(spec)
        with pytest.raises(SystemExit):
            main(["slurm", "sbatch", str(tmp_path / "job.yaml"), *options, "--out", str(tmp_path / "x.sbatch"),
                  "--", script])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x.sbatch").exists()


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("30:15", 1815), ("2:00:00", 7200), ("1-0", 86400), ("1-2:30", 95400), ("1-2:30:05", 95405)])
def test_slurm_time_formats(text: str, seconds: int) -> None:
    assert time_limit_seconds(text) == seconds


def test_a_request_larger_than_the_partition_is_refused() -> None:
    listing = ("PartitionName=debug AllowGroups=ALL Default=YES MaxNodes=UNLIMITED TotalNodes=3 State=UP\n"
               "PartitionName=big AllowGroups=ALL Default=NO MaxNodes=4 TotalNodes=16 State=UP\n")

    def scontrol(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        if command[-1] == "big":
            return subprocess.CompletedProcess(command, 0, listing.splitlines()[1], "")
        if command[-1] == "nope":
            return subprocess.CompletedProcess(command, 1, "", "Partition nope not found\n")
        return subprocess.CompletedProcess(command, 0, listing, "")

    check_capacity(None, 2, 1, scontrol)
    check_capacity("big", 3, 1, scontrol)
    with pytest.raises(SlurmError, match=r"--nodes 3 \+ --standby 1 = 4 nodes: partition debug holds at most 3 "
                                         r"\(TotalNodes\)"):
        check_capacity(None, 3, 1, scontrol)
    with pytest.raises(SlurmError, match=r"--nodes 5 = 5 nodes: partition big holds at most 4 \(MaxNodes\)"):
        check_capacity("big", 5, 0, scontrol)
    with pytest.raises(SlurmError, match="--partition nope: Partition nope not found"):
        check_capacity("nope", 1, 0, scontrol)
