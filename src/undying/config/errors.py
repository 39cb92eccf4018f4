"""The job spec's error wording: every invalid spec becomes one line naming the field, the
problem, the allowed values and the value given.

Runs wherever a spec is validated (the launcher/controller, the agent, the worker). Rules in
the model raise ``spec_rule``; pydantic's own errors are translated by ``spec_error_from_validation``.
"""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from undying.strategy_names import SPEC_STRATEGIES

# Pydantic error type of the model's cross-field and list rules; its ctx carries the message parts.
SPEC_RULE_ERROR = "job_spec_rule"

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


def spec_rule(problem: str, allowed: str, got: Any, field: str | None = None) -> PydanticCustomError:
    """The error a model validator raises for a rule pydantic cannot express; ``field`` names
    the field when it is not the one being validated (cross-field rules, list items)."""
    context: dict[str, Any] = {"problem": problem, "allowed": allowed, "got": got}
    if field is not None:
        context["field"] = field
    return PydanticCustomError(SPEC_RULE_ERROR, "{problem}", context)


def allowed_strategy_list() -> str:
    return "a non-empty list or comma-separated string of: " + ", ".join(SPEC_STRATEGIES)


def spec_error_from_validation(exc: ValidationError, root_model: type[BaseModel]) -> SpecError:
    """The first of pydantic's errors as a ``SpecError``; ``root_model`` is the model that was
    validated, whose annotations and constraints give the allowed values."""
    error = exc.errors(include_url=False)[0]
    location = error["loc"]
    context = error.get("ctx") or {}
    if error["type"] == SPEC_RULE_ERROR:
        field_path = context.get("field") or _format_location(location)
        return SpecError(field_path, context["problem"], context["allowed"], context["got"])
    return SpecError(
        _format_location(location),
        _describe_problem(error["type"], location, error["msg"]),
        _describe_allowed(root_model, location),
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
    # The only list of choices in the spec is recover_strategy.
    if error_type == "literal_error" and location and isinstance(location[-1], int):
        return "unknown strategy"
    return _PROBLEM_BY_ERROR_TYPE.get(error_type, message[:1].lower() + message[1:])


def _describe_allowed(root_model: type[BaseModel], location: tuple[int | str, ...]) -> str:
    """Allowed values for the field at ``location``, read from the models' own annotations
    and constraints so the message cannot drift from what validation enforces."""
    model = root_model
    field_info: FieldInfo | None = None
    for depth, part in enumerate(location):
        if isinstance(part, int):
            return ", ".join(SPEC_STRATEGIES)
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
        return allowed_strategy_list()
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
