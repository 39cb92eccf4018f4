"""A JSON object's values checked against the field types of the dataclass it becomes.

Runs wherever a message is decoded: in the controller for every request body (``protocol.Message``,
``events.Event``), in agents and workers for replies. JSON says nothing of types, and a value of the
wrong one (a rank that is a string, a step that is a list, a node that is null) must be refused where
it arrives, with one line naming the field, not fail later inside the job machine, half applied.

Checked: ``int`` (not bool), ``float`` (int or float), ``str``, ``bool``, ``Any``,
``X | None``, ``list[X]``, ``dict[str, X]``; anything else is accepted as it comes.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any


def check_fields(cls: type, values: dict[str, Any]) -> None:
    """Raise ValueError naming ``cls.field`` for the first value not of its field's type."""
    hints = _hints(cls)
    for name, value in values.items():
        expected = hints.get(name)
        if expected is not None and not _matches(value, expected):
            raise ValueError(f"{cls.__name__}.{name}: expected {_describe(expected)}, got {value!r:.80}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _matches(value: Any, expected: Any) -> bool:
    if expected is Any:
        return True
    origin = typing.get_origin(expected)
    if origin in (types.UnionType, typing.Union):
        return any(_matches(value, option) for option in typing.get_args(expected))
    if expected is type(None):
        return value is None
    if expected is bool:
        return type(value) is bool
    if expected is int:
        return type(value) is int
    if expected is float:
        return type(value) in (int, float)  # NaN too: a diverged loss is news (a wait is range-checked)
    if expected is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(expected) or (Any,)
        return isinstance(value, list) and all(_matches(element, item) for element in value)
    if origin is dict:
        key, item = typing.get_args(expected) or (Any, Any)
        return isinstance(value, dict) and all(_matches(k, key) and _matches(v, item) for k, v in value.items())
    return True  # a type this checker does not know (a ClassVar, a nested dataclass): not judged here


def _describe(expected: Any) -> str:
    return getattr(expected, "__name__", None) if typing.get_origin(expected) is None else str(expected)  # type: ignore[return-value]
