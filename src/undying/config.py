"""The job spec: every knob of a run, read once at start and validated with one-line errors.

The launcher/controller loads it from YAML and CLI flags (``load_job_spec``) and hands it to
agents and workers as JSON in an environment variable (``spec_to_dict`` / ``spec_from_json``);
all three processes read the same ``JobSpec``. Knob names follow MindCluster.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

Strategy = Literal["retry", "recover-in-place", "recover", "elastic-training", "dump", "exit"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)

# Spellings accepted for top-level keys besides the canonical field name (after "-" -> "_").
_TOP_LEVEL_KEY_ALIASES = {"process_recover_enable": "process_recover"}
# Test-only: seconds to wait for a lost node before an elastic shrink, below the 30 s floor of
# wait_reschedule_timeout (MindCluster's range), so that fault tests stay short.
ENV_WAIT_RESCHEDULE_OVERRIDE = "UNDYING_TEST_WAIT_RESCHEDULE_S"

# Pydantic error type of the cross-field and list rules below; its ctx carries the message parts.
_SPEC_RULE_ERROR = "job_spec_rule"

# Longest repr shown after "got", so one bad value cannot flood the terminal.
_MAX_VALUE_REPR = 200


class SpecError(ValueError):
    """A job spec that cannot run. ``str()`` is always one line naming field, problem,
    allowed values and the value given, so a user can fix the spec without reading code."""

    def __init__(self, field: str, problem: str, allowed: str, value: Any) -> None:
        super().__init__(field, problem, allowed, value)
        self.field = field
        self.problem = problem
        self.allowed = allowed
        self.value = value

    def __str__(self) -> str:
        value_repr = repr(self.value)
        if len(value_repr) > _MAX_VALUE_REPR:
            value_repr = value_repr[: _MAX_VALUE_REPR - 3] + "..."
        message = f"job spec: {self.field}: {self.problem}; allowed: {self.allowed} (got {value_repr})"
        return " ".join(message.splitlines())


def _spec_rule(problem: str, allowed: str, got: Any, field: str | None = None) -> PydanticCustomError:
    context: dict[str, Any] = {"problem": problem, "allowed": allowed, "got": got}
    if field is not None:
        context["field"] = field
    return PydanticCustomError(_SPEC_RULE_ERROR, "{problem}", context)


def _reject_bool(value: Any) -> Any:
    # Pydantic's lax mode reads True as 1; in a spec that is always a typo.
    if isinstance(value, bool):
        raise PydanticCustomError("number_type", "Input should be a number, not a boolean")
    return value


def _on_off_from_bool(value: Any) -> Any:
    # YAML 1.1 reads bare on/off as booleans.
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


class CheckpointSpec(BaseModel):
    """Where and how often workers save. ``dir=None`` means ``RUN_DIR/checkpoints``; ``dir`` is a
    local or shared-filesystem path, or an fsspec URL (``s3://``, ``gs://``, ``file://``, chained
    ``simplecache::s3://``, ...) whose protocols fsspec knows; neither is reached here (the
    saver finds out whether it can write, and whether the protocol's package is installed).

    ``interval``: steps between T2 checkpoints (persisted in the background).
    ``snapshot_interval``: steps between T1 snapshots into node shared memory (0: only at
    T2 checkpoint steps). ``snapshot_slots``: T1 slots per rank, each the size of the rank's
    state; with 2, while the persister holds one the other is rewritten each time (a torn write
    falls back to the persisted step), with 3 a torn write falls back to the previous step.
    ``overlap``: ``on`` copies the parameters and optimizer state of a snapshot in the
    background, overlapping the next step's forward, backward and gradient sync (its optimizer
    step waits for the copy); ``off`` copies everything at the step boundary; ``auto`` (the
    default) is ``on`` for a device's (GPU's) state and ``off`` for CPU state, where the copy
    competes with training for the same cores (measured: no gain, docs/benchmarks.md)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dir: str | None = None
    interval: int = Field(100, ge=1)
    keep: int = Field(2, ge=1)
    snapshot_interval: int = Field(1, ge=0)
    snapshot_slots: int = Field(2, ge=2, le=8)
    overlap: Literal["auto", "on", "off"] = "auto"

    _reject_bool_numbers = field_validator("interval", "keep", "snapshot_interval", "snapshot_slots",
                                           mode="before")(_reject_bool)
    _on_off_from_yaml_bool = field_validator("overlap", mode="before")(_on_off_from_bool)

    @field_validator("dir")
    @classmethod
    def _known_url_protocols(cls, value: str | None) -> str | None:
        if value is None or "://" not in value:
            return value
        import fsspec  # only for URLs; a dependency of torch

        available = fsspec.available_protocols()
        # A chained URL ("simplecache::s3://bucket/ckpt") names one protocol per link.
        protocols = [link.split("://", 1)[0] for link in value.split("::")]
        unknown = [protocol for protocol in protocols if protocol not in available]
        if unknown:
            raise _spec_rule(f"unknown fsspec protocol {unknown[0]!r}",
                             f"a local path, or a URL of a protocol fsspec knows: {', '.join(sorted(available))}",
                             value)
        return value


class JobSpec(BaseModel):
    """One job's configuration, with every value in range and the cross-field rules holding:
    non-exit strategies need ``process_recover``, ``heartbeat_timeout > heartbeat_interval``
    and ``1 <= min_nodes <= nnodes``. It does not check that paths or URLs exist."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    process_recover: bool = False
    recover_strategy: list[Strategy] = Field(default_factory=lambda: ["exit"])
    pod_rescheduling: Literal["on", "off"] = "off"
    fault_scheduling: Literal["force", "grace", "off"] = "force"
    grace_period: float = Field(900.0, gt=0)
    wait_reschedule_timeout: int = Field(270, ge=30, le=270)
    max_restarts: int = Field(32767, ge=0, le=32767)
    monitor_interval: float = Field(5.0, gt=0, le=300)
    comm_timeout: float = Field(30.0, gt=0)
    heartbeat_interval: float = Field(1.0, gt=0)
    heartbeat_timeout: float = Field(10.0, gt=0)
    start_timeout: float = Field(300.0, gt=0)
    # Seconds a live rank may go without committing a step before it counts as hung (None: off).
    step_timeout: float | None = Field(None, gt=0)
    node_return_timeout: float = Field(120.0, gt=0)
    watchdog: Literal["on", "off", "detect-only"] = "on"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    compile_cache: str | None = None
    warm_standby: bool = True  # each agent keeps a pre-started interpreter per rank: replacements, job restarts
    # Elastic training: how a replica covers a lost replica's share of the global batch.
    elastic_batch: Literal["accumulate", "grow"] = "accumulate"
    # Every rank appends the sample indices of each committed step to RUN_DIR/samples/ (audits, tests).
    sample_log: bool = False
    nnodes: int = Field(1, ge=1)
    min_nodes: int | None = None
    nproc_per_node: int = Field(1, ge=1)

    _reject_bool_numbers = field_validator(
        "grace_period",
        "wait_reschedule_timeout",
        "max_restarts",
        "monitor_interval",
        "comm_timeout",
        "heartbeat_interval",
        "heartbeat_timeout",
        "start_timeout",
        "step_timeout",
        "node_return_timeout",
        "nnodes",
        "min_nodes",
        "nproc_per_node",
        mode="before",
    )(_reject_bool)
    _on_off_from_yaml_bool = field_validator("pod_rescheduling", "watchdog", mode="before")(_on_off_from_bool)

    @field_validator("fault_scheduling", mode="before")
    @classmethod
    def _off_from_yaml_false(cls, value: Any) -> Any:
        return "off" if value is False else value

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _null_checkpoint_means_defaults(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("recover_strategy", mode="before")
    @classmethod
    def _split_comma_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",")] if value.strip() else []
        return value

    @field_validator("recover_strategy")
    @classmethod
    def _non_empty_without_duplicates(cls, strategies: list[str]) -> list[str]:
        if not strategies:
            raise _spec_rule("empty list", _allowed_strategy_list(), strategies)
        seen: set[str] = set()
        for index, name in enumerate(strategies):
            if name in seen:
                raise _spec_rule(
                    "duplicate strategy",
                    "each strategy at most once",
                    name,
                    field=f"recover_strategy[{index}]",
                )
            seen.add(name)
        return strategies

    @model_validator(mode="after")
    def _cross_field_rules(self) -> JobSpec:
        if not self.process_recover and self.process_level_strategies():
            raise _spec_rule(
                "needs process_recover: true",
                "exit alone, or process_recover: true",
                list(self.recover_strategy),
                field="recover_strategy",
            )
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise _spec_rule(
                "must be greater than heartbeat_interval",
                f"> heartbeat_interval ({self.heartbeat_interval})",
                self.heartbeat_timeout,
                field="heartbeat_timeout",
            )
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nnodes:
            raise _spec_rule("out of range", f"1..{self.nnodes} (nnodes)", self.min_nodes, field="min_nodes")
        return self

    @property
    def world_size(self) -> int:
        """Number of worker processes when every node is present."""
        return self.nnodes * self.nproc_per_node

    @property
    def fewest_nodes(self) -> int:
        """The fewest nodes elastic training may shrink to (``min_nodes``, else 1)."""
        return self.min_nodes if self.min_nodes is not None else 1

    def reschedule_wait(self) -> float:
        """Seconds to wait for a lost node to come back before elastic training shrinks the job:
        ``wait_reschedule_timeout``, unless the test-only environment override is set."""
        override = os.environ.get(ENV_WAIT_RESCHEDULE_OVERRIDE)
        return float(override) if override else float(self.wait_reschedule_timeout)

    def process_level_strategies(self) -> list[str]:
        """The listed strategies other than ``exit``, in the order they are to be tried."""
        return [name for name in self.recover_strategy if name != "exit"]


def validate_job_spec(raw: Mapping[str, Any]) -> JobSpec:
    """Build a ``JobSpec`` from a mapping (hyphenated keys allowed); raise ``SpecError`` if invalid."""
    if not isinstance(raw, Mapping):
        raise SpecError("<spec>", "not a mapping", "a mapping of field names to values", raw)
    normalised = _normalise_top_level(raw)
    try:
        return JobSpec.model_validate(normalised)
    except ValidationError as exc:
        raise _spec_error_from_validation(exc) from None


def load_job_spec(
    path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> JobSpec:
    """Read the YAML spec at ``path`` (if any), apply ``overrides`` and validate.

    Override keys may be dotted (``checkpoint.interval``) or hyphenated; a value of ``None``
    means the flag was not given and leaves the file's value (or the default) in place.
    Every failure, including a missing or malformed file, raises ``SpecError``.
    """
    raw: Mapping[str, Any] = {} if path is None else _read_yaml_mapping(path)
    merged = _normalise_top_level(raw)
    for key, value in _flatten_overrides(overrides or {}).items():
        if value is not None:
            _set_dotted(merged, key, value)
    return validate_job_spec(merged)


def spec_to_dict(spec: JobSpec) -> dict[str, Any]:
    """The spec as a plain JSON-able dict with canonical field names."""
    return spec.model_dump(mode="json")


def spec_from_json(text: str) -> JobSpec:
    """Rebuild a spec from ``json.dumps(spec_to_dict(spec))``, e.g. read from an env var."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(
            "<json>", f"invalid JSON: {exc.msg} at position {exc.pos}", "a JSON object", text
        ) from None
    return validate_job_spec(raw)


def _read_yaml_mapping(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    shown_path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as spec_file:
            loaded = yaml.safe_load(spec_file)
    except FileNotFoundError:
        raise SpecError("<file>", "file not found", "path to a readable YAML file", shown_path) from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SpecError(
            "<file>", f"cannot read: {reason}", "path to a readable YAML file", shown_path
        ) from None
    except yaml.YAMLError as exc:
        raise SpecError(
            "<file>", _describe_yaml_error(exc), "a YAML mapping of job spec fields", shown_path
        ) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, Mapping):
        raise SpecError("<file>", "top level is not a mapping", "a YAML mapping of job spec fields", loaded)
    return loaded


def _describe_yaml_error(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or "syntax error"
    if mark is None:
        return f"invalid YAML: {problem}"
    return f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _canonical_key(key: Any, aliases: Mapping[str, str]) -> str:
    name = str(key).strip().replace("-", "_")
    return aliases.get(name, name)


def _normalise_keys(raw: Mapping[Any, Any], aliases: Mapping[str, str], prefix: str) -> dict[str, Any]:
    normalised: dict[str, Any] = {}
    spelling_of: dict[str, Any] = {}
    for key, value in raw.items():
        name = _canonical_key(key, aliases)
        if name in normalised:
            raise SpecError(
                prefix + name,
                f"given twice (as {spelling_of[name]!r} and {key!r})",
                "one spelling of each field",
                value,
            )
        normalised[name] = value
        spelling_of[name] = key
    return normalised


def _normalise_top_level(raw: Mapping[Any, Any]) -> dict[str, Any]:
    normalised = _normalise_keys(raw, _TOP_LEVEL_KEY_ALIASES, prefix="")
    checkpoint = normalised.get("checkpoint")
    if isinstance(checkpoint, Mapping):
        normalised["checkpoint"] = _normalise_keys(checkpoint, {}, prefix="checkpoint.")
    return normalised


def _flatten_overrides(overrides: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    # A nested mapping ({"checkpoint": {"interval": 5}}) updates fields; it does not replace the section.
    flat: dict[str, Any] = {}
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten_overrides(value, prefix=dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _set_dotted(target: dict[str, Any], dotted_key: str, value: Any) -> None:
    parts = [
        _canonical_key(part, _TOP_LEVEL_KEY_ALIASES if depth == 0 else {})
        for depth, part in enumerate(dotted_key.split("."))
    ]
    node = target
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, Mapping):
            section = ".".join(parts[: depth + 1])
            raise SpecError(section, "not a mapping, cannot set " + dotted_key, "a mapping", child)
        node[part] = dict(child)
        node = node[part]
    node[parts[-1]] = value


def _spec_error_from_validation(exc: ValidationError) -> SpecError:
    error = exc.errors(include_url=False)[0]
    location = error["loc"]
    context = error.get("ctx") or {}
    if error["type"] == _SPEC_RULE_ERROR:
        field_path = context.get("field") or _format_location(location)
        return SpecError(field_path, context["problem"], context["allowed"], context["got"])
    return SpecError(
        _format_location(location),
        _describe_problem(error["type"], location, error["msg"]),
        _describe_allowed(location),
        error.get("input"),
    )


def _format_location(location: tuple[int | str, ...]) -> str:
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else part
    return path or "<spec>"


_PROBLEM_BY_ERROR_TYPE = {
    "greater_than": "out of range",
    "greater_than_equal": "out of range",
    "less_than": "out of range",
    "less_than_equal": "out of range",
    "int_parsing": "not an integer",
    "int_type": "not an integer",
    "int_from_float": "not a whole number",
    "float_parsing": "not a number",
    "float_type": "not a number",
    "number_type": "not a number",
    "finite_number": "not a finite number",
    "bool_parsing": "not a boolean",
    "bool_type": "not a boolean",
    "string_type": "not a string",
    "list_type": "not a list",
    "model_type": "not a mapping",
    "model_attributes_type": "not a mapping",
    "dict_type": "not a mapping",
    "literal_error": "unknown value",
    "extra_forbidden": "unknown field",
}


def _describe_problem(error_type: str, location: tuple[int | str, ...], message: str) -> str:
    if error_type == "literal_error" and location and isinstance(location[-1], int):
        return "unknown strategy"
    return _PROBLEM_BY_ERROR_TYPE.get(error_type, message[:1].lower() + message[1:])


def _describe_allowed(location: tuple[int | str, ...]) -> str:
    """Allowed values for the field at ``location``, read from the models' own annotations
    and constraints so the message cannot drift from what validation enforces."""
    model: type[BaseModel] = JobSpec
    field_info: FieldInfo | None = None
    for depth, part in enumerate(location):
        if isinstance(part, int):
            return ", ".join(STRATEGIES)
        if part not in model.model_fields:
            return ", ".join(model.model_fields)
        field_info = model.model_fields[part]
        nested = field_info.annotation
        if depth < len(location) - 1 and isinstance(nested, type) and issubclass(nested, BaseModel):
            model = nested
    if field_info is None:
        return "a mapping of field names to values"
    return _describe_field(field_info)


def _describe_field(field_info: FieldInfo) -> str:
    annotation = field_info.annotation
    nullable = False
    if get_origin(annotation) in (Union, types.UnionType):
        members = [member for member in get_args(annotation) if member is not type(None)]
        nullable = len(members) < len(get_args(annotation))
        annotation = members[0]
    text = _describe_type(annotation, field_info)
    return f"{text}, or null" if nullable else text


def _describe_type(annotation: Any, field_info: FieldInfo) -> str:
    if get_origin(annotation) is Literal:
        return ", ".join(str(choice) for choice in get_args(annotation))
    if get_origin(annotation) is list:
        return _allowed_strategy_list()
    if annotation is bool:
        return "true, false"
    if annotation is str:
        return "a string"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a mapping with keys: " + ", ".join(annotation.model_fields)
    return _describe_bounds(annotation, field_info)


def _describe_bounds(annotation: Any, field_info: FieldInfo) -> str:
    bounds: dict[str, Any] = {}
    for constraint in field_info.metadata:
        for name in ("gt", "ge", "lt", "le"):
            if getattr(constraint, name, None) is not None:
                bounds[name] = getattr(constraint, name)
    if "ge" in bounds and "le" in bounds:
        return f"{bounds['ge']}..{bounds['le']}"
    symbols = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    parts = [f"{symbols[name]} {limit}" for name, limit in bounds.items()]
    if parts:
        return " and ".join(parts)
    return "an integer" if annotation is int else "a number"


def _allowed_strategy_list() -> str:
    return "a non-empty list or comma-separated string of: " + ", ".join(STRATEGIES)


__all__ = [
    "STRATEGIES",
    "CheckpointSpec",
    "JobSpec",
    "SpecError",
    "Strategy",
    "load_job_spec",
    "spec_from_json",
    "spec_to_dict",
    "validate_job_spec",
]
