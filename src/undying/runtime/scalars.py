"""The scalars a training script logs with ``ft.log(loss=..., lr=..., grad_norm=...)``, checked in the worker.

Runs in the worker. The newest value of each name rides on the rank's next heartbeat; the controller
keeps it in its sampled ``heartbeat`` events, shows it in ``undying status`` and exports it as the
Prometheus gauge ``undying_train_<name>`` (mean, min and max over the ranks). So a name is a valid
part of a metric name, and a job logs a bounded number of names (each is a few series, not one
per rank).
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Collection
from typing import Any

import torch

NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED_NAMES = frozenset({"phase"})  # the heartbeat event's own field
MAX_SCALARS = 32  # distinct names per rank: every name is a metric the controller exports


def checked_scalars(values: dict[str, Any], logged: Collection[str]) -> dict[str, float]:
    """``values`` as plain floats, or ValueError naming the first bad name or value; ``logged``:
    the names this rank logged before (they count against ``MAX_SCALARS``). A value of None is no
    news (a step that failed before its loss was known): the name keeps its last value."""
    scalars: dict[str, float] = {}
    for name, value in values.items():
        if not NAME_PATTERN.fullmatch(name) or name in RESERVED_NAMES:
            raise ValueError(f"ft.log: scalar name {name!r}: allowed letters, digits and '_' (not first a digit), "
                             f"other than {', '.join(sorted(RESERVED_NAMES))}")
        if value is not None:
            scalars[name] = _as_float(name, value)
    names = set(logged) | set(scalars)
    if len(names) > MAX_SCALARS:
        raise ValueError(f"ft.log: allowed at most {MAX_SCALARS} scalar names per rank (got {len(names)}: "
                         f"{', '.join(sorted(names))})")
    return scalars


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:39] + "…"
    raise ValueError(f"ft.log: {name}: allowed a real number or a one-element tensor "
                     f"(got {type(value).__name__} {shown})")
