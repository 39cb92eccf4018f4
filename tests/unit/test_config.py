"""Job spec validation: defaults, ranges, enums, spellings, file loading, the JSON hand-off and
the comparison of two nodes' specs."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import fsspec
import pytest

from undying.config import (
    NODE_LOCAL_FIELDS,
    STRATEGIES,
    CheckpointSpec,
    JobSpec,
    SpecError,
    load_job_spec,
    recover_strategy_overrides,
    spec_differences,
    spec_from_json,
    spec_to_dict,
    validate_job_spec,
)
from undying.protocol import AgentHello
from undying.strategy_names import SPEC_STRATEGIES, StrategyName

ALL_STRATEGIES_TEXT = "retry, recover-in-place, recover, elastic-training, dump, exit"


def spec_error(overrides: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as caught:
        load_job_spec(overrides=overrides)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("job spec: ")
    return caught.value


def write_yaml(tmp_path: Path, text: str) -> Path:
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(text, encoding="utf-8")
    return spec_path


def test_defaults() -> None:
    spec = load_job_spec()
    assert spec == JobSpec()
    assert spec.process_recover is False
    assert spec.recover_strategy == ["exit"]
    assert spec.pod_rescheduling == "off"
    assert spec.fault_scheduling == "force"
    assert spec.grace_period == 900.0
    assert spec.wait_reschedule_timeout == 270
    assert spec.max_restarts == 32767
    assert spec.monitor_interval == 5.0
    assert spec.comm_timeout == 30.0
    assert spec.heartbeat_interval == 1.0
    assert spec.heartbeat_timeout == 10.0
    assert spec.start_timeout == 300.0
    assert spec.node_return_timeout == 120.0
    assert spec.watchdog == "on"
    assert spec.backend == "auto"
    assert spec.checkpoint == CheckpointSpec(dir=None, interval=100, keep=2)
    assert spec.compile_cache is None
    assert (spec.nnodes, spec.min_nodes, spec.nproc_per_node) == (1, None, 1)
    assert spec.world_size == 1
    assert spec.process_level_strategies() == []


def test_default_strategy_list_is_not_shared_between_specs() -> None:
    first, second = JobSpec(), JobSpec()
    first.recover_strategy.append("dump")
    assert second.recover_strategy == ["exit"]


def test_world_size_and_process_level_strategies() -> None:
    spec = load_job_spec(
        overrides={
            "nnodes": 3,
            "nproc_per_node": 4,
            "process_recover": True,
            "recover_strategy": ["recover-in-place", "retry", "exit", "dump"],
        }
    )
    assert spec.world_size == 12
    assert spec.process_level_strategies() == ["recover-in-place", "retry", "dump"]


@pytest.mark.parametrize(
    ("field_path", "inside", "outside", "allowed"),
    [
        ("wait_reschedule_timeout", [30, 270], [29, 271], "30..270"),
        ("max_restarts", [0, 32767], [-1, 32768], "0..32767"),
        ("monitor_interval", [0.001, 300], [0, -1, 300.5], "> 0 and <= 300"),
        ("grace_period", [0.001], [0, -5], "> 0"),
        ("comm_timeout", [0.001], [0, -1], "> 0"),
        ("heartbeat_interval", [0.001], [0, -1], "> 0"),
        ("start_timeout", [0.001], [0, -1], "> 0"),
        ("node_return_timeout", [0.001], [0], "> 0"),
        ("nnodes", [1], [0, -1], ">= 1"),
        ("nproc_per_node", [1], [0], ">= 1"),
        ("checkpoint.interval", [1], [0, -1], ">= 1"),
        ("checkpoint.keep", [1], [0], ">= 1"),
        ("checkpoint.snapshot_interval", [0], [-1], "an integer >= 0, or auto"),
        ("checkpoint.snapshot_budget", [0.001, 0.999], [0, 1, -0.5], "> 0 and < 1"),
        ("checkpoint.snapshot_slots", [2, 8], [1, 9], "2..8"),
    ],
)
def test_range_boundaries(field_path: str, inside: list[float], outside: list[float], allowed: str) -> None:
    for value in inside:
        spec = load_job_spec(overrides={field_path: value})
        holder: Any = spec
        for part in field_path.split("."):
            holder = getattr(holder, part)
        assert holder == value
    for value in outside:
        error = spec_error({field_path: value})
        assert str(error) == f"job spec: {field_path}: out of range; allowed: {allowed} (got {value!r})"


def test_out_of_range_message_matches_documented_example() -> None:
    assert str(spec_error({"wait_reschedule_timeout": 20})) == (
        "job spec: wait_reschedule_timeout: out of range; allowed: 30..270 (got 20)"
    )


def test_heartbeat_timeout_must_exceed_interval() -> None:
    assert (
        load_job_spec(overrides={"heartbeat_interval": 2, "heartbeat_timeout": 2.01}).heartbeat_timeout
        == 2.01
    )
    for timeout in (2, 1):
        error = spec_error({"heartbeat_interval": 2, "heartbeat_timeout": timeout})
        assert error.field == "heartbeat_timeout"
        assert str(error) == (
            "job spec: heartbeat_timeout: must be greater than heartbeat_interval; "
            f"allowed: > heartbeat_interval (2.0) (got {float(timeout)!r})"
        )


def test_host_silence_timeout_above_the_agents_beat_interval() -> None:
    assert load_job_spec().host_silence_limit() == pytest.approx(0.85)  # null: an agent beat + 0.6 s
    assert load_job_spec(overrides={"host_silence_timeout": 2}).host_silence_limit() == 2.0
    # Never past heartbeat_timeout: a rank silent that long is hung anyway.
    assert load_job_spec(overrides={"host_silence_timeout": 20}).host_silence_limit() == 10.0
    error = spec_error({"host_silence_timeout": 0.25})
    assert error.field == "host_silence_timeout"
    assert str(error) == (
        "job spec: host_silence_timeout: must be greater than the agents' beat interval (a live host is silent "
        "that long between beats); allowed: > 0.25 (0.25, or heartbeat_interval / 2 if shorter), or null (got 0.25)"
    )
    assert spec_error({"host_silence_timeout": 0.1, "heartbeat_interval": 0.2}).field == "host_silence_timeout"
    assert load_job_spec(overrides={"host_silence_timeout": 0.2, "heartbeat_interval": 0.3}).host_silence_limit() == 0.2


def test_the_commit_fence_lease_is_half_the_host_silence_limit_with_the_watchdog_on() -> None:
    assert load_job_spec().commit_fence_lease() == pytest.approx(0.425)
    assert load_job_spec(overrides={"host_silence_timeout": 2}).commit_fence_lease() == 1.0
    assert load_job_spec(overrides={"watchdog": "off"}).commit_fence_lease() is None
    assert load_job_spec(overrides={"watchdog": "detect-only"}).commit_fence_lease() is None


def test_min_nodes_between_one_and_nnodes() -> None:
    assert load_job_spec(overrides={"nnodes": 4, "min_nodes": 1}).min_nodes == 1
    assert load_job_spec(overrides={"nnodes": 4, "min_nodes": 4}).min_nodes == 4
    for min_nodes in (0, 5):
        error = spec_error({"nnodes": 4, "min_nodes": min_nodes})
        assert str(error) == f"job spec: min_nodes: out of range; allowed: 1..4 (nnodes) (got {min_nodes})"


@pytest.mark.parametrize(
    ("field_name", "bad_value", "allowed"),
    [
        ("pod_rescheduling", "maybe", "on, off"),
        ("fault_scheduling", "soft", "force, grace, off"),
        ("fault_scheduling", True, "force, grace, off"),
        ("watchdog", "loud", "on, off, detect-only"),
        ("backend", "mpi", "auto, gloo, nccl"),
        ("checkpoint.overlap", "sometimes", "auto, on, off"),
        ("checkpoint.peer_copy", "on", "auto, off"),
    ],
)
def test_bad_enum_value_is_one_line_naming_field_value_and_choices(
    field_name: str, bad_value: Any, allowed: str
) -> None:
    error = spec_error({field_name: bad_value})
    assert str(error) == f"job spec: {field_name}: unknown value; allowed: {allowed} (got {bad_value!r})"
    assert (error.field, error.value, error.allowed) == (field_name, bad_value, allowed)


def test_unknown_strategy_names_index_and_all_strategies() -> None:
    error = spec_error({"recover_strategy": ["exit", "foo"]})
    assert str(error) == (
        f"job spec: recover_strategy[1]: unknown strategy; allowed: {ALL_STRATEGIES_TEXT} (got 'foo')"
    )
    assert ", ".join(STRATEGIES) == ALL_STRATEGIES_TEXT


def test_every_strategy_is_accepted() -> None:
    spec = load_job_spec(overrides={"process_recover": True, "pod_rescheduling": "on",
                                    "recover_strategy": list(STRATEGIES)})
    assert spec.recover_strategy == list(STRATEGIES)


def test_strategies_from_comma_separated_string() -> None:
    spec = load_job_spec(overrides={"process_recover": True, "pod_rescheduling": "on",
                                    "recover_strategy": "retry, recover,exit"})
    assert spec.recover_strategy == ["retry", "recover", "exit"]
    assert load_job_spec(overrides={"recover_strategy": "exit"}).recover_strategy == ["exit"]


def test_duplicate_strategy_names_the_repeat() -> None:
    error = spec_error({"process_recover": True, "recover_strategy": "retry,dump,retry"})
    assert str(error) == (
        "job spec: recover_strategy[2]: duplicate strategy; allowed: each strategy at most once (got 'retry')"
    )


@pytest.mark.parametrize("empty", [[], ""])
def test_empty_strategy_list(empty: Any) -> None:
    error = spec_error({"recover_strategy": empty})
    assert error.field == "recover_strategy"
    assert error.problem == "empty list"
    assert ALL_STRATEGIES_TEXT in error.allowed


def test_strategy_list_of_wrong_type() -> None:
    error = spec_error({"recover_strategy": 5})
    assert (error.field, error.problem, error.value) == ("recover_strategy", "not a list", 5)


def test_recover_is_refused_without_the_settings_it_needs() -> None:
    """Every strategy the start banner lists can run: recover needs pods rescheduled."""
    listed = {"process_recover": True, "recover_strategy": "recover-in-place,recover"}
    assert str(spec_error(listed)) == (
        "job spec: pod_rescheduling: recover (in recover_strategy) needs pod_rescheduling: on; "
        "allowed: on, or recover_strategy without recover (got 'off')")
    assert str(spec_error({**listed, "pod_rescheduling": "on", "fault_scheduling": "off"})) == (
        "job spec: fault_scheduling: recover (in recover_strategy) reschedules a lost node, which "
        "fault_scheduling: off forbids; allowed: force or grace, or recover_strategy without recover (got 'off')")
    assert load_job_spec(overrides={**listed, "pod_rescheduling": "on"}).recover_strategy == [
        "recover-in-place", "recover"]


def test_the_recover_strategy_flag_implies_process_recover() -> None:
    """`--recover-strategy recover-in-place` alone asks for process-level recovery; an explicit
    `--set process_recover=...` wins, and `exit` alone implies nothing."""
    assert recover_strategy_overrides("retry, recover-in-place", {}) == {
        "recover_strategy": "retry, recover-in-place", "process_recover": True}
    assert load_job_spec(overrides=recover_strategy_overrides("recover-in-place", {})).process_recover is True
    assert recover_strategy_overrides("exit", {}) == {"recover_strategy": "exit"}
    assert recover_strategy_overrides("retry", {"process_recover": False}) == {"recover_strategy": "retry"}
    assert recover_strategy_overrides(None, {}) == {}


def test_process_level_strategy_needs_process_recover() -> None:
    error = spec_error({"recover_strategy": ["retry", "exit"]})
    assert str(error) == (
        "job spec: recover_strategy: needs process_recover: true; "
        "allowed: exit alone, or process_recover: true (got ['retry', 'exit'])"
    )
    spec = load_job_spec(overrides={"process_recover": True, "recover_strategy": ["retry", "exit"]})
    assert spec.process_level_strategies() == ["retry"]


def test_unknown_top_level_field_lists_every_field() -> None:
    error = spec_error({"foo": 1})
    assert str(error) == (f"job spec: foo: unknown field; allowed: {', '.join(JobSpec.model_fields)} (got 1)")


def test_nested_checkpoint_errors_use_dotted_path() -> None:
    assert str(spec_error({"checkpoint.bogus": 3})) == (
        "job spec: checkpoint.bogus: unknown field; allowed: dir, interval, keep, snapshot_interval, "
        "snapshot_budget, snapshot_slots, overlap, peer_copy, persist (got 3)"
    )
    assert str(spec_error({"checkpoint.interval": "often"})) == (
        "job spec: checkpoint.interval: not an integer; allowed: >= 1 (got 'often')"
    )
    assert str(spec_error({"checkpoint.dir": 7})) == (
        "job spec: checkpoint.dir: not a string; allowed: a string, or null (got 7)"
    )
    assert str(spec_error({"checkpoint.dir": "nosuch://bucket/ckpt"})) == (
        "job spec: checkpoint.dir: unknown fsspec protocol 'nosuch'; allowed: a local path, or a URL of "
        f"a protocol fsspec knows: {', '.join(sorted(fsspec.available_protocols()))} "
        "(got 'nosuch://bucket/ckpt')"
    )
    assert "unknown fsspec protocol 'nosuch'" in str(spec_error({"checkpoint.dir": "simplecache::nosuch://b"}))
    assert str(spec_error({"checkpoint": 5})) == (
        "job spec: checkpoint: not a mapping; allowed: a mapping with keys: dir, interval, keep, "
        "snapshot_interval, snapshot_budget, snapshot_slots, overlap, peer_copy, persist (got 5)"
    )


@pytest.mark.parametrize("url", ["s3://bucket/ckpt", "gs://bucket/run-1", "file:///mnt/ckpt",
                                 "memory://ckpt", "simplecache::s3://bucket/ckpt"])
def test_checkpoint_dir_accepts_fsspec_urls_without_reaching_them(url: str) -> None:
    """No credentials, no network and no s3fs/gcsfs here: validation only checks the protocol names."""
    assert load_job_spec(overrides={"checkpoint.dir": url}).checkpoint.dir == url


@pytest.mark.parametrize(
    ("field_name", "bad_value", "problem"),
    [
        ("max_restarts", 1.5, "not a whole number"),
        ("max_restarts", "many", "not an integer"),
        ("nnodes", True, "not a number"),
        ("grace_period", False, "not a number"),
        ("comm_timeout", float("inf"), "not a finite number"),
        ("process_recover", 2, "not a boolean"),
        ("compile_cache", 3, "not a string"),
    ],
)
def test_wrong_types_are_one_line(field_name: str, bad_value: Any, problem: str) -> None:
    error = spec_error({field_name: bad_value})
    assert (error.field, error.problem, error.value) == (field_name, problem, bad_value)


def test_only_first_of_several_errors_is_reported() -> None:
    error = spec_error({"wait_reschedule_timeout": 1, "max_restarts": -1, "foo": 1})
    assert error.field == "wait_reschedule_timeout"


def test_hyphenated_keys_and_aliases() -> None:
    spec = load_job_spec(
        overrides={
            "process-recover-enable": True,
            "recover-strategy": "recover-in-place,exit",
            "wait-reschedule-timeout": 60,
            "pod-rescheduling": "on",
            "fault-scheduling": "grace",
            "grace-period": 30,
            "nproc-per-node": 2,
            "checkpoint.keep": 5,
        }
    )
    assert spec.process_recover is True
    assert spec.recover_strategy == ["recover-in-place", "exit"]
    assert spec.wait_reschedule_timeout == 60
    assert spec.pod_rescheduling == "on"
    assert spec.fault_scheduling == "grace"
    assert spec.grace_period == 30.0
    assert spec.nproc_per_node == 2
    assert spec.checkpoint.keep == 5


def test_same_field_under_two_spellings_is_an_error() -> None:
    with pytest.raises(SpecError) as caught:
        validate_job_spec({"process_recover": True, "process-recover-enable": False})
    assert caught.value.field == "process_recover"
    assert "given twice" in str(caught.value)


def test_yaml_file_with_on_off_hyphens_and_nested_checkpoint(tmp_path: Path) -> None:
    spec_path = write_yaml(
        tmp_path,
        """
process-recover-enable: true
recover-strategy: [retry, recover, exit]
pod-rescheduling: on
fault-scheduling: grace
watchdog: off
wait-reschedule-timeout: 30
checkpoint:
  dir: /mnt/shared/run
  interval: 10
compile_cache: /tmp/cache
nnodes: 2
min_nodes: 1
nproc_per_node: 4
""",
    )
    spec = load_job_spec(spec_path)
    assert spec.process_recover is True
    assert spec.recover_strategy == ["retry", "recover", "exit"]
    assert spec.pod_rescheduling == "on"
    assert spec.fault_scheduling == "grace"
    assert spec.watchdog == "off"
    assert spec.wait_reschedule_timeout == 30
    assert spec.checkpoint == CheckpointSpec(dir="/mnt/shared/run", interval=10, keep=2)
    assert spec.compile_cache == "/tmp/cache"
    assert spec.world_size == 8


def test_yaml_watchdog_on_and_quoted_detect_only(tmp_path: Path) -> None:
    assert load_job_spec(write_yaml(tmp_path, "watchdog: on\n")).watchdog == "on"
    assert load_job_spec(write_yaml(tmp_path, "watchdog: detect-only\n")).watchdog == "detect-only"
    assert load_job_spec(write_yaml(tmp_path, "pod_rescheduling: off\n")).pod_rescheduling == "off"
    assert load_job_spec(write_yaml(tmp_path, "checkpoint:\n  overlap: on\n")).checkpoint.overlap == "on"
    assert load_job_spec(write_yaml(tmp_path, "checkpoint:\n  overlap: off\n")).checkpoint.overlap == "off"
    assert load_job_spec().checkpoint.overlap == "auto"
    assert load_job_spec(write_yaml(tmp_path, "checkpoint:\n  peer_copy: off\n")).checkpoint.peer_copy == "off"


def test_overrides_win_over_file_and_none_means_not_given(tmp_path: Path) -> None:
    spec_path = write_yaml(tmp_path, "max_restarts: 5\ncheckpoint:\n  interval: 10\n  keep: 3\n")
    spec = load_job_spec(
        spec_path,
        overrides={"max_restarts": None, "checkpoint.interval": 20, "checkpoint": {"keep": None}},
    )
    assert spec.max_restarts == 5
    assert spec.checkpoint.interval == 20
    assert spec.checkpoint.keep == 3


def test_nested_mapping_override_updates_instead_of_replacing(tmp_path: Path) -> None:
    spec_path = write_yaml(tmp_path, "checkpoint:\n  dir: /data/ckpt\n")
    spec = load_job_spec(spec_path, overrides={"checkpoint": {"interval": 7}})
    assert spec.checkpoint == CheckpointSpec(dir="/data/ckpt", interval=7, keep=2)


def test_empty_yaml_and_null_checkpoint_give_defaults(tmp_path: Path) -> None:
    assert load_job_spec(write_yaml(tmp_path, "")) == JobSpec()
    assert load_job_spec(write_yaml(tmp_path, "checkpoint:\n")) == JobSpec()


def test_yaml_value_error_is_reported_like_an_override(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        load_job_spec(write_yaml(tmp_path, "recover_strategy: [exit, bogus]\n"))
    assert str(caught.value) == (
        f"job spec: recover_strategy[1]: unknown strategy; allowed: {ALL_STRATEGIES_TEXT} (got 'bogus')"
    )


def test_missing_file(tmp_path: Path) -> None:
    missing_path = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as caught:
        load_job_spec(missing_path)
    assert str(caught.value) == (
        f"job spec: <file>: file not found; allowed: path to a readable YAML file (got {str(missing_path)!r})"
    )


def test_malformed_yaml_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        load_job_spec(write_yaml(tmp_path, "nnodes: [1, 2\nwatchdog: on\n"))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("job spec: <file>: invalid YAML at line ")


@pytest.mark.parametrize("top_level", ["- 1\n- 2\n", "just a string\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, top_level: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_job_spec(write_yaml(tmp_path, top_level))
    assert caught.value.field == "<file>"
    assert caught.value.problem == "top level is not a mapping"


def test_override_through_a_non_mapping_is_an_error() -> None:
    error = spec_error({"nnodes.count": 2})
    assert error.field == "nnodes"


def test_long_values_are_shortened_and_newlines_stay_escaped() -> None:
    error = spec_error({"backend": "x" * 1000 + "\nsecond line"})
    message = str(error)
    assert "\n" not in message
    assert len(message) < 400


def test_round_trip_through_json() -> None:
    spec = load_job_spec(
        overrides={
            "process_recover": True,
            "recover_strategy": "recover-in-place,retry,exit",
            "fault_scheduling": "grace",
            "watchdog": "detect-only",
            "checkpoint.dir": "/tmp/ckpt",
            "checkpoint.interval": 3,
            "compile_cache": "/tmp/cc",
            "nnodes": 2,
            "min_nodes": 1,
        }
    )
    as_dict = spec_to_dict(spec)
    assert isinstance(as_dict["checkpoint"], dict)
    text = json.dumps(as_dict)
    assert spec_from_json(text) == spec
    assert spec_from_json(json.dumps(spec_to_dict(JobSpec()))) == JobSpec()


def test_bad_json_is_a_spec_error() -> None:
    with pytest.raises(SpecError) as caught:
        spec_from_json("{not json")
    assert caught.value.field == "<json>"
    with pytest.raises(SpecError) as caught:
        spec_from_json('{"max_restarts": -1}')
    assert caught.value.field == "max_restarts"


def test_spec_error_survives_pickling() -> None:
    error = spec_error({"watchdog": "loud"})
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_strategies_are_the_spec_strategy_names() -> None:
    assert STRATEGIES == SPEC_STRATEGIES
    spec = load_job_spec(overrides={"process_recover": True, "recover_strategy": "retry,exit"})
    assert all(isinstance(name, StrategyName) for name in spec.recover_strategy)
    assert spec_to_dict(spec)["recover_strategy"] == ["retry", "exit"]
    error = spec_error({"process_recover": True, "recover_strategy": ["job-restart"]})
    assert str(error) == (
        f"job spec: recover_strategy[0]: unknown strategy; allowed: {ALL_STRATEGIES_TEXT} (got 'job-restart')"
    )


def test_reschedule_wait_is_the_spec_value() -> None:
    assert JobSpec().reschedule_wait() == 270.0
    assert load_job_spec(overrides={"wait_reschedule_timeout": 30}).reschedule_wait() == 30.0


NODE_SPEC = {"process_recover": True, "recover_strategy": "retry,dump,exit", "nnodes": 2,
             "nproc_per_node": 4, "checkpoint.dir": "/mnt/shared/ckpt", "compile_cache": "/scratch/cc"}


def test_the_same_spec_has_no_differences() -> None:
    assert spec_differences(JobSpec(), JobSpec()) == []
    assert spec_differences(load_job_spec(overrides=NODE_SPEC), load_job_spec(overrides=NODE_SPEC)) == []


def test_differences_name_each_differing_field_sorted() -> None:
    ours = load_job_spec(overrides=NODE_SPEC)
    theirs = load_job_spec(overrides={**NODE_SPEC, "max_restarts": 3, "comm_timeout": 60})
    assert spec_differences(ours, theirs) == ["comm_timeout", "max_restarts"]
    assert spec_differences(theirs, ours) == ["comm_timeout", "max_restarts"]


def test_differences_inside_checkpoint_are_dotted() -> None:
    ours = load_job_spec(overrides=NODE_SPEC)
    theirs = load_job_spec(overrides={**NODE_SPEC, "checkpoint.interval": 7, "checkpoint.dir": "/other"})
    assert spec_differences(ours, theirs) == ["checkpoint.dir", "checkpoint.interval"]


def test_strategy_order_and_null_versus_value_differ() -> None:
    ours = load_job_spec(overrides=NODE_SPEC)
    reordered = load_job_spec(overrides={**NODE_SPEC, "recover_strategy": "dump,retry,exit"})
    assert spec_differences(ours, reordered) == ["recover_strategy"]
    with_step_timeout = load_job_spec(overrides={**NODE_SPEC, "step_timeout": 60})
    assert spec_differences(ours, with_step_timeout) == ["step_timeout"]


def test_node_local_paths_may_differ() -> None:
    assert NODE_LOCAL_FIELDS == {"compile_cache"}
    ours = load_job_spec(overrides=NODE_SPEC)
    theirs = load_job_spec(overrides={**NODE_SPEC, "compile_cache": None})
    assert spec_differences(ours, theirs) == []


def test_the_spec_travels_in_the_agent_hello() -> None:
    spec = load_job_spec(overrides=NODE_SPEC)
    hello = AgentHello(1, 1234, "host1", spec.nproc_per_node, spec=spec_to_dict(spec))
    received = AgentHello.from_dict(json.loads(json.dumps(hello.to_dict())))
    rebuilt = validate_job_spec(received.spec)
    assert rebuilt == spec
    assert spec_differences(spec, rebuilt) == []
    assert AgentHello(1, 1234, "host1", 4).spec == {}  # a sender that does not say
