"""A JSON object's values checked against the field types of the dataclass it becomes.

Runs wherever a message is decoded: in the controller for every request body (``protocol.Message``,
``events.Event``), in agents and workers for replies. JSON says nothing of types, and a value of the
wrong one (a rank that is a string, a step that is a list, a node that is null) must be refused where
it arrives, with one line naming the field, not fail later inside the job machine, half applied.

Checked: ``int`` (not bool), ``float`` (int or float), ``str``, ``bool``, ``Any``,
``X | None``, ``list[X]``, ``dict[str, X]``, a ``StrEnum`` (one of its values, which
``decode_fields`` turns into the member) and ``Literal`` strings; anything else is accepted as it comes.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Literal


def check_fields(cls: type, values: dict[str, Any]) -> None:
    """Raise ValueError naming ``cls.field`` for the first value not of its field's type."""
    checkers = _field_checkers(cls)
    for name, value in values.items():
        check = checkers.get(name)
        if check is not None and not check(value):
            raise ValueError(f"{cls.__name__}.{name}: expected {_describe(_hints(cls)[name])}, got {value!r:.80}")


def decode_fields(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` checked (``check_fields``), with each value of an enum field as its member: a
    ``Phase`` field holds ``Phase.COMPUTING``, not the string the JSON had."""
    check_fields(cls, values)
    for name, enum in _enum_fields(cls):
        if name in values and not isinstance(values[name], enum) and values[name] in enum._value2member_map_:
            values[name] = enum(values[name])
    return values


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _enum_fields(cls: type) -> tuple[tuple[str, type[StrEnum]], ...]:
    """The fields whose type is a StrEnum, alone or beside a Literal or None (``StrategyName | Literal[""]``)."""
    found = []
    for name, hint in _hints(cls).items():
        options = typing.get_args(hint) if typing.get_origin(hint) in (types.UnionType, typing.Union) else (hint,)
        enums = [option for option in options if _is_enum(option)]
        if len(enums) == 1:
            found.append((name, enums[0]))
    return tuple(found)


def _is_enum(expected: Any) -> bool:
    return isinstance(expected, type) and issubclass(expected, StrEnum)


@functools.cache
def _field_checkers(cls: type) -> dict[str, Callable[[Any], bool]]:
    """Each field's checker, made once per class: every request body is checked against them."""
    return {name: _checker(hint) for name, hint in _hints(cls).items()}


@functools.cache
def _checker(expected: Any) -> Callable[[Any], bool]:
    """Whether a value is of type ``expected``, as a function made once per type (the type's
    structure is read here, not again for every value)."""
    if expected is Any:
        return _any
    if _is_enum(expected):
        members = expected._value2member_map_
        return lambda value: isinstance(value, str) and value in members
    origin = typing.get_origin(expected)
    if origin is Literal:
        options = typing.get_args(expected)
        return lambda value: any(type(value) is type(option) and value == option for option in options)
    if origin in (types.UnionType, typing.Union):
        checks = tuple(_checker(option) for option in typing.get_args(expected))
        return lambda value: any(check(value) for check in checks)
    if expected is type(None):
        return lambda value: value is None
    if expected is bool:
        return lambda value: type(value) is bool
    if expected is int:
        return lambda value: type(value) is int
    if expected is float:
        return lambda value: type(value) in (int, float)  # NaN too: a diverged loss is news (a wait is range-checked)
    if expected is str:
        return lambda value: isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(expected) or (Any,)
        check_item = _checker(item)
        return lambda value: isinstance(value, list) and all(map(check_item, value))
    if origin is dict:
        key, item = typing.get_args(expected) or (Any, Any)
        check_key, check_value = _checker(key), _checker(item)
        return lambda value: isinstance(value, dict) and all(check_key(k) and check_value(v) for k, v in value.items())
    return _any  # a type this checker does not know (a ClassVar, a nested dataclass): not judged here


def _any(_value: Any) -> bool:
    return True


def _describe(expected: Any) -> str:
    origin = typing.get_origin(expected)
    if _is_enum(expected):
        return "one of " + ", ".join(member.value for member in expected)
    if origin is Literal:
        return " or ".join(repr(option) for option in typing.get_args(expected))
    if origin in (types.UnionType, typing.Union) and any(_is_enum(option) for option in typing.get_args(expected)):
        return " or ".join("null" if option is type(None) else _describe(option) for option in typing.get_args(expected))
    return getattr(expected, "__name__", None) if origin is None else str(expected)  # type: ignore[return-value]
