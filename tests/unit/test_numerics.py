"""Deterministic mode and the numerics record: what a worker runs with when ``deterministic: true``,
what every checkpoint manifest records about the numerics it was written under, and the
``numerics_changed`` event when a restore happens under other numerics (the bitwise-equality
promise then does not hold, and the job says so instead of failing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import JobRun, run_job
from undying import events as ev
from undying.checkpoint import list_committed
from undying.checkpoint.manifest import MANIFEST_NAME, NUMERICS_KEY, Manifest
from undying.config import JobSpec, SpecError, validate_job_spec
from undying.events import Event
from undying.report.summary import summarize
from undying.report.text import render_summary
from undying.runtime.devices import numerics_differences, numerics_record, set_numerics_mode
from undying.worker_env import DETERMINISTIC_ENV, WorkerEnv

# ----------------------------------------------------------------------------- the spec field


def test_deterministic_is_off_by_default_and_takes_a_boolean() -> None:
    assert JobSpec().deterministic is False
    assert validate_job_spec({"deterministic": True}).deterministic is True


def test_a_bad_deterministic_value_is_one_line_naming_the_field() -> None:
    with pytest.raises(SpecError) as caught:
        validate_job_spec({"deterministic": "sometimes"})
    assert str(caught.value) == "job spec: deterministic: not a boolean; allowed: true, false (got 'sometimes')"


# ----------------------------------------------------------------------------- the worker's environment


def test_the_agent_sets_the_deterministic_variables_only_in_deterministic_mode() -> None:
    on = WorkerEnv(spec=JobSpec(deterministic=True)).to_environ(inherited={})
    assert {name: on[name] for name in DETERMINISTIC_ENV} == {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple",
        "NCCL_NVLS_ENABLE": "0", "NCCL_MIN_NCHANNELS": "16", "NCCL_MAX_NCHANNELS": "16"}
    off = WorkerEnv(spec=JobSpec()).to_environ(inherited={})
    assert not set(DETERMINISTIC_ENV) & set(off)


def test_a_users_own_value_wins_over_the_agents() -> None:
    user = {"NCCL_ALGO": "Tree", "NCCL_MAX_NCHANNELS": "4"}
    added = WorkerEnv(spec=JobSpec(deterministic=True)).to_environ(inherited=user)
    worker_sees = {**user, **added}  # how the agent starts the worker: its environment, then these
    assert worker_sees["NCCL_ALGO"] == "Tree" and worker_sees["NCCL_PROTO"] == "Simple"
    # One channel bound set by the user: the other follows it, so the count is still one value.
    assert worker_sees["NCCL_MIN_NCHANNELS"] == worker_sees["NCCL_MAX_NCHANNELS"] == "4"


@pytest.fixture
def torch_numerics_flags(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Put torch's process-wide numerics flags and the deterministic variables back after the test."""
    for name in DETERMINISTIC_ENV:
        monkeypatch.setenv(name, "")  # recorded by monkeypatch, so that what the test sets is undone
        monkeypatch.delenv(name)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[2], saved[3]


@pytest.mark.usefixtures("torch_numerics_flags")
def test_deterministic_mode_sets_torchs_flags_in_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = True, False
    monkeypatch.setenv("NCCL_PROTO", "LL128")
    set_numerics_mode(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()  # a non-deterministic op raises
    assert torch.backends.cudnn.benchmark is False and torch.backends.cudnn.deterministic is True
    # Without an agent (a standalone run) the worker sets the variables itself, the user's still winning.
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["NCCL_PROTO"] == "LL128"


@pytest.mark.usefixtures("torch_numerics_flags")
def test_without_deterministic_mode_the_users_own_settings_stay() -> None:
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    set_numerics_mode(False)
    assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark is True
    assert not set(DETERMINISTIC_ENV) & set(os.environ)


# ----------------------------------------------------------------------------- the record


def test_the_record_names_versions_device_and_variables_as_the_worker_sees_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in DETERMINISTIC_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    record = numerics_record(True, "gloo", torch.device("cpu"))
    assert record == {
        "deterministic": True, "torch": torch.__version__, "backend": "gloo", "device": "cpu",
        "cuda": None, "cudnn": None, "nccl": None,
        "cpu": {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()},
        "env": {name: ("Tree" if name == "NCCL_ALGO" else None) for name in DETERMINISTIC_ENV}}
    assert json.loads(json.dumps(record)) == record  # it goes into a JSON manifest as it is


def test_differences_are_named_by_dotted_key() -> None:
    record = numerics_record(False, "gloo", torch.device("cpu"))
    record["env"]["NCCL_ALGO"] = None
    assert numerics_differences(record, json.loads(json.dumps(record))) == []
    other = {**record, "device": "NVIDIA H200", "env": {**record["env"], "NCCL_ALGO": "Ring"}}
    assert numerics_differences(record, other) == ["device", "env.NCCL_ALGO"]
    older = {key: value for key, value in record.items() if key != "cudnn"}
    assert numerics_differences(older, record) == ["cudnn"]


# ----------------------------------------------------------------------------- manifest and restore

TRAIN = textwrap.dedent("""
    import json, sys, torch, undying
    rt = undying.init()
    seen = []
    emit = rt.reporter.emit
    def recording_emit(kind, step=None, **details):
        seen.append({"kind": kind, "step": step, "details": details})
        emit(kind, step, **details)
    rt.reporter.emit = recording_emit
    torch.manual_seed(0)
    model = rt.wrap_model(torch.nn.Linear(8, 8))
    opt = rt.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in rt.steps(int(sys.argv[1])):
        with step:
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    rt.finish()
    print(json.dumps([event for event in seen if event["kind"] in ("numerics_changed", "checkpoint_load")]))
""")


def train_standalone(run_dir: Path, steps: int) -> list[dict]:
    """A one-rank standalone job (checkpoint every 2 steps, deterministic mode, one user variable);
    its restore, if any, is from storage (a standalone job's T1 is private memory)."""
    spec = {"deterministic": True, "checkpoint": {"interval": 2}}
    env = {**os.environ, "UNDYING_SPEC": json.dumps(spec), "UNDYING_RUN_DIR": str(run_dir), "NCCL_ALGO": "Tree"}
    for name in DETERMINISTIC_ENV:
        if name != "NCCL_ALGO":
            env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", TRAIN, str(steps)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_manifest_records_the_numerics_and_a_restore_under_others_is_an_event(tmp_path: Path) -> None:
    assert train_standalone(tmp_path, 4) == []  # a fresh start: nothing restored
    newest = list_committed(tmp_path / "checkpoints")[0]
    assert newest.step == 4
    record = newest.manifest.meta[NUMERICS_KEY]
    assert record["deterministic"] is True and record["device"] == "cpu" and record["backend"] == "gloo"
    assert record["torch"] == torch.__version__
    # As the worker saw them: the user's own NCCL_ALGO, the rest set for deterministic mode.
    assert record["env"] == {**DETERMINISTIC_ENV, "NCCL_ALGO": "Tree"}

    # The same numerics: the restore says nothing about them.
    events = train_standalone(tmp_path, 6)
    assert [(e["kind"], e["step"], e["details"]["source"]) for e in events] == [("checkpoint_load", 4, "storage")]

    # The newest checkpoint as if written on a GPU: restored all the same, with one event naming the change.
    manifest_path = list_committed(tmp_path / "checkpoints")[0].path / MANIFEST_NAME
    manifest = Manifest.from_json(manifest_path.read_text())
    assert manifest.step == 6
    manifest.meta[NUMERICS_KEY]["device"] = "NVIDIA H200"
    manifest_path.write_text(manifest.to_json())
    events = train_standalone(tmp_path, 8)
    assert [(e["kind"], e["step"]) for e in events] == [("numerics_changed", 6), ("checkpoint_load", 6)]
    changed = events[0]["details"]
    assert changed["differs"] == ["device"] and changed["ranks"] == [0]
    assert changed["recorded"]["device"] == "NVIDIA H200" and changed["current"]["device"] == "cpu"
    assert json.loads((tmp_path / "result.json").read_text())["final_step"] == 8


def test_the_report_shows_a_numerics_change() -> None:
    changed = Event(ev.NUMERICS_CHANGED, rank=0, step=40, details={
        "differs": ["device"], "ranks": [0, 1], "recorded": {"device": "NVIDIA H100 80GB HBM3"},
        "current": {"device": "NVIDIA H200"}, "path": "ckpt/step_000000040"})
    text = render_summary(summarize([changed]))
    assert "numerics: step 40 restored under other numerics (device: NVIDIA H100 80GB HBM3 -> NVIDIA H200)" in text
    assert "numerics" not in render_summary(summarize([]))


# ----------------------------------------------------------------------------- a real job


@pytest.mark.faults
def test_deterministic_mode_on_cpu_ends_with_the_same_parameters(reference_run: JobRun, tmp_path: Path) -> None:
    """CPU kernels and gloo are deterministic already: the mode changes no bit of a fault-free run."""
    run = run_job(tmp_path, ["--set", "deterministic=true"])
    assert run.returncode == 0, run.output + run.logs()
    assert run.result["param_sha256"] == reference_run.result["param_sha256"]
    assert not run.kinds(ev.NUMERICS_CHANGED)
    records = [checkpoint.manifest.meta[NUMERICS_KEY] for checkpoint in list_committed(tmp_path / "checkpoints")]
    assert records and all(record["deterministic"] and record["env"]["NCCL_ALGO"] == "Ring" for record in records)
