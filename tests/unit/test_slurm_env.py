"""``undying run`` in a Slurm step (slurm/env.py, slurm/launch.py, slurm/shared_token.py), with fake
step environments: the node's rank, the job's node count and spares, the controller's address and
port, the run directory and the token come from the step unless a flag says otherwise; outside a
step nothing changes; what the step cannot hold is one error line."""

from __future__ import annotations

import os
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from undying.cli import main
from undying.launch.launch_options import LaunchOptions, SigtermAction
from undying.slurm.env import SlurmEnvError, SlurmStep, controller_port, node_address
from undying.slurm.launch import Placement, SlurmPlacementError, place
from undying.slurm.shared_token import SharedTokenError, shared_token

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py")


def step_environ(node_id: int, nodelist: str = "gpu-[01-03]", nodes: int = 3, tasks: int | None = None,
                 job_id: str = "4242", submit_dir: str = "/shared/me") -> dict[str, str]:
    """A task's environment as srun sets it (the variables read; SLURM_STEP_ID marks a step)."""
    return {"SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_NODEID": str(node_id),
            "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist, "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_NNODES": str(nodes), "SLURM_STEP_NUM_TASKS": str(nodes if tasks is None else tasks),
            "SLURM_SUBMIT_DIR": submit_dir}


def test_outside_a_step_there_is_no_step() -> None:
    assert SlurmStep.from_environ({}) is None
    batch_script = {k: v for k, v in step_environ(0).items() if k != "SLURM_STEP_ID"}
    assert SlurmStep.from_environ(batch_script) is None  # the batch script itself is no step
    assert SlurmStep.from_environ({**step_environ(0), "UNDYING_SLURM": "0"}) is None  # asked to ignore it


def test_a_step_is_read_from_its_environment() -> None:
    step = SlurmStep.from_environ({**step_environ(1), "SLURM_RESTART_COUNT": "2"})
    assert step == SlurmStep("4242", 1, ("gpu-01", "gpu-02", "gpu-03"), 3, Path("/shared/me"), 2)
    assert step.node_name == "gpu-02"
    assert step.run_dir == Path("/shared/me/runs/slurm-4242") and step.job_name == "slurm-4242"
    # SLURM_JOB_NODELIST when the step's own list is missing (an older srun)
    older = {k: v for k, v in step_environ(0).items() if k not in ("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES")}
    assert SlurmStep.from_environ(older).nodes == ("gpu-01", "gpu-02", "gpu-03")


@pytest.mark.parametrize(("change", "message"), [
    ({"SLURM_JOB_ID": "12x"}, "SLURM_JOB_ID: expected a number (got '12x')"),
    ({"SLURM_NODEID": "3"}, "SLURM_NODEID: expected 0..2 (got '3')"),
    ({"SLURM_NODEID": "one"}, "SLURM_NODEID: expected an integer (got 'one')"),
    ({"SLURM_STEP_NUM_NODES": "4"}, "SLURM_STEP_NODELIST names 3 nodes, SLURM_STEP_NUM_NODES says 4"),
    ({"SLURM_STEP_NODELIST": "gpu-[03-01]"}, "SLURM_STEP_NODELIST: host list 'gpu-[03-01]': range '03-01' runs"),
    ({"SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": ""}, "SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are unset"),
])
def test_a_contradictory_step_is_one_error(change: dict[str, str], message: str) -> None:
    with pytest.raises(SlurmEnvError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SlurmStep.from_environ({**step_environ(0), **change})


def test_the_controller_port_follows_the_job_id() -> None:
    assert controller_port("4242") == 24242
    assert controller_port("1234567") == 24567 and controller_port("10000") == 20000


def test_the_controllers_address_is_slurms_node_addr_else_the_name() -> None:
    def scontrol(output: str, code: int = 0):
        def run(command, **kwargs):
            assert command == ["scontrol", "show", "node", "-o", "gpu-01"]
            return subprocess.CompletedProcess(command, code, output, "")
        return run

    line = "NodeName=gpu-01 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.1.2.3 NodeHostName=gpu-01 Port=6818"
    assert node_address("gpu-01", scontrol(line)) == "10.1.2.3"
    assert node_address("gpu-01", scontrol("", code=1)) == "gpu-01"

    def missing(command, **kwargs):
        raise FileNotFoundError("scontrol")

    assert node_address("gpu-01", missing) == "gpu-01"


def test_the_last_k_nodes_are_spares_and_the_job_gets_the_rest() -> None:
    step = SlurmStep.from_environ(step_environ(2))
    assert place(step, None, None, standby=1) == Placement(node_rank=2, nnodes=2, spare=True)
    assert place(step, None, None, standby=0) == Placement(node_rank=2, nnodes=3, spare=False)
    assert place(step, None, 2, standby=1) == Placement(node_rank=2, nnodes=2, spare=True)
    assert place(step, 0, None, standby=1) == Placement(node_rank=0, nnodes=2, spare=False)  # a flag wins


@pytest.mark.parametrize(("nnodes", "standby", "tasks", "message"), [
    (3, 1, None, "the job needs 3 nodes + 1 spare = 4, the Slurm step has 3 (SLURM_STEP_NUM_NODES): allocate 4 "
                 "(sbatch --nodes 4)"),
    (4, 0, None, "the job needs 4 nodes = 4, the Slurm step has 3 (SLURM_STEP_NUM_NODES): allocate 4 "
                 "(sbatch --nodes 4)"),
    (1, 1, None, "the job needs 1 node + 1 spare = 2, the Slurm step has 3 (SLURM_STEP_NUM_NODES): use them all "
                 "(--nnodes 2, or --standby 2)"),
    (None, 3, None, "--standby 3 leaves no node for the job: the Slurm step has 3 nodes (SLURM_STEP_NUM_NODES)"),
    (None, 0, 6, "undying run runs once per node of the Slurm step: start it with srun --ntasks-per-node=1 "
                 "(this step has 6 tasks on 3 nodes)"),
])
def test_a_job_the_step_cannot_hold_is_one_error(nnodes: int | None, standby: int, tasks: int | None,
                                                 message: str) -> None:
    step = SlurmStep.from_environ(step_environ(0, tasks=tasks))
    with pytest.raises(SlurmPlacementError) as raised:
        place(step, None, nnodes, standby)
    assert str(raised.value) == message


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[LaunchOptions]:
    """What ``undying run`` would launch (the launch itself replaced), with scontrol's NodeAddr faked."""
    captured: list[LaunchOptions] = []

    def launch(options: LaunchOptions) -> int:
        captured.append(options)
        return 0

    monkeypatch.setattr("undying.launch.launcher.launch", launch)
    monkeypatch.setattr("undying.slurm.launch.node_address", lambda name: {"gpu-01": "10.0.0.1"}.get(name, name))
    monkeypatch.delenv("UNDYING_TOKEN", raising=False)
    monkeypatch.delenv("UNDYING_SLURM", raising=False)
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    return captured


def run_in_step(monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], *args: str) -> int:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    return main(["run", "--nproc-per-node", "2", *args, SCRIPT])


def test_each_node_of_a_step_takes_its_place_from_slurm(launched: list[LaunchOptions], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for node_id in range(3):
        assert run_in_step(monkeypatch, step_environ(node_id, submit_dir=str(tmp_path)), "--standby", "1") == 0
    run_dir = tmp_path / "runs" / "slurm-4242"
    token = (run_dir / "job.token").read_text().strip()
    for node_id, options in enumerate(launched):
        assert options.node_rank == node_id and options.spec.nnodes == 2 and options.spec.nproc_per_node == 2
        assert options.standby_agents == (1 if node_id == 2 else 0)  # the step's last node is the spare
        assert options.controller_address == "10.0.0.1:24242"
        assert options.run_dir == run_dir and options.token == token
        assert options.sigterm is SigtermAction.STOP
    assert launched[0].controller_bind == "0.0.0.0"  # node 0 listens where the others reach it
    assert stat.S_IMODE((run_dir / "job.token").stat().st_mode) == 0o600


def test_a_flag_always_wins_over_the_step(launched: list[LaunchOptions], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 32)
    assert run_in_step(monkeypatch, step_environ(0, submit_dir=str(tmp_path)), "--run-dir", str(tmp_path / "mine"),
                       "--token-file", str(token), "--master-port", "29999", "--controller-bind", "10.9.9.9",
                       "--sigterm", "leave") == 0
    assert run_in_step(monkeypatch, step_environ(1, submit_dir=str(tmp_path)), "--controller", "head:1234",
                       "--token-file", str(token)) == 0
    first, second = launched
    assert (first.controller_address, first.controller_bind) == ("10.0.0.1:29999", "10.9.9.9")
    assert first.run_dir == tmp_path / "mine" and first.token == "t" * 32 and first.sigterm is SigtermAction.LEAVE
    assert second.controller_address == "head:1234" and second.spec.nnodes == 3
    assert not (tmp_path / "runs").exists()


def test_a_failover_job_in_a_step_is_named_after_it(launched: list[LaunchOptions], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_in_step(monkeypatch, step_environ(1, submit_dir=str(tmp_path)), "--etcd", "etcd-0:2379") == 0
    [options] = launched
    assert (options.etcd, options.job_name, options.controller_bind) == ("etcd-0:2379", "slurm-4242", "0.0.0.0")
    assert options.node_rank == 1 and options.controller_address is None


def test_outside_a_step_nothing_changes(launched: list[LaunchOptions], tmp_path: Path) -> None:
    assert main(["run", "--nproc-per-node", "2", "--run-dir", str(tmp_path), SCRIPT]) == 0
    [options] = launched
    assert options.node_rank is None and options.controller_address is None
    assert options.controller_bind == "127.0.0.1" and options.sigterm is SigtermAction.LEAVE


def test_a_step_that_cannot_hold_the_spec_is_one_error_line(launched: list[LaunchOptions], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("nnodes: 3\n")
    with pytest.raises(SystemExit) as exited:
        run_in_step(monkeypatch, step_environ(0, submit_dir=str(tmp_path)), "--config", str(spec), "--standby", "1")
    assert exited.value.code == 2 and not launched
    assert capsys.readouterr().err == ("undying: error: the job needs 3 nodes + 1 spare = 4, the Slurm step has 3 "
                                       "(SLURM_STEP_NUM_NODES): allocate 4 (sbatch --nodes 4)\n")


def test_the_token_is_made_once_for_every_node(tmp_path: Path) -> None:
    path = tmp_path / "run" / "job.token"
    tokens: list[str] = []
    threads = [threading.Thread(target=lambda: tokens.append(shared_token(path))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(tokens) == 8 and len(set(tokens)) == 1 and len(tokens[0]) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["job.token"]  # no staging file left behind
    assert shared_token(path) == tokens[0]  # a requeued job reads it again
    path.write_text("short\n")
    with pytest.raises(SharedTokenError, match="fewer than 16 characters"):
        shared_token(path)
