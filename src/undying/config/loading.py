"""Reading a job spec: a YAML file plus CLI overrides, a mapping, or the JSON it travels as.

The launcher/controller loads the spec once (``load_job_spec``) and hands it to agents and
workers as JSON in an environment variable and in the agent's hello (``spec_to_dict`` /
``spec_from_json``); every path ends in ``validate_job_spec``, so a bad spec is one ``SpecError``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from undying.config.errors import SpecError, spec_error_from_validation
from undying.config.model import JobSpec

# Spellings accepted for top-level keys besides the canonical field name (after "-" -> "_").
_TOP_LEVEL_KEY_ALIASES = {"process_recover_enable": "process_recover"}


def validate_job_spec(raw: Mapping[str, Any]) -> JobSpec:
    """Build a ``JobSpec`` from a mapping (hyphenated keys allowed); raise ``SpecError`` if invalid."""
    if not isinstance(raw, Mapping):
        raise SpecError("<spec>", "not a mapping", "a mapping of field names to values", raw)
    normalised = _normalise_top_level(raw)
    try:
        return JobSpec.model_validate(normalised)
    except ValidationError as exc:
        raise spec_error_from_validation(exc, JobSpec) from None


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


def recover_strategy_overrides(names: str | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """What ``--recover-strategy NAMES`` stands for among ``overrides`` (the other flags and --set):
    the list, and ``process_recover: true`` when it names a process-level strategy (anything but
    ``exit``), which is what a user asking for one means, unless ``process_recover`` is set there
    explicitly. Nothing for ``None`` (the flag not given)."""
    if names is None:
        return {}
    implied: dict[str, Any] = {"recover_strategy": names}
    process_level = [name for name in (part.strip() for part in names.split(",")) if name and name != "exit"]
    if process_level and overrides.get("process_recover") is None:
        implied["process_recover"] = True
    return implied


def spec_to_dict(spec: JobSpec) -> dict[str, Any]:
    """The spec's wire form: a plain JSON-able dict with canonical field names, which
    ``validate_job_spec`` turns back into an equal spec."""
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
