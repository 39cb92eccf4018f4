"""Slurm's compressed host lists (``n[1-3,5]``, ``gpu-[01-10]``, ``a[1-2]-b[3-4]``) as node names.

Runs in ``undying run`` inside a Slurm step (``slurm/env.py``), without calling ``scontrol``.
``expand`` gives the names in the order ``scontrol show hostnames`` prints them (checked against
Slurm 22.05's output in tests/unit/test_slurm_hostlist.py):

- items are separated by commas outside brackets; empty items are skipped;
- a bracket holds comma-separated numbers and ``LOW-HIGH`` ranges (``LOW <= HIGH``); every number
  is zero-padded to the width of the range's ``LOW`` as written (``[08-10]`` -> 08 09 10,
  ``[8-10]`` -> 8 9 10, ``[1-03]`` -> 1 2 3);
- several brackets in one item expand as a product, the leftmost varying slowest
  (``a[1-2]-b[3-4]`` -> a1-b3 a1-b4 a2-b3 a2-b4);
- order and duplicates are kept (``n[3,1]`` -> n3 n1; ``n1,n1`` -> n1 n1).

Text after an item's last bracket (``n[1-2]-ib``) is kept as a suffix; Slurm 22.05's ``scontrol``
refuses such a list, later versions and other hostlist tools expand it the same way. Anything else
that is not a host list (an unclosed or nested bracket, a reversed or empty range, a non-number in
a bracket, a list of more than ``MAX_HOSTS`` names) raises ``HostlistError`` naming the list.
"""

from __future__ import annotations

import itertools
import re

from undying.slurm.errors import SlurmError

MAX_HOSTS = 1_000_000  # more names than any cluster has: a typo such as n[1-99999999], not a list
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class HostlistError(SlurmError):
    """Text that is not a Slurm host list; the message names it and what is wrong."""


def expand(hostlist: str) -> list[str]:
    """Every node name ``hostlist`` stands for, in ``scontrol show hostnames`` order."""
    names: list[str] = []
    for item in _split_items(hostlist):
        parts = _parse_item(item, hostlist)
        count = 1
        for part in parts:
            count *= len(part)
        if len(names) + count > MAX_HOSTS:
            raise HostlistError(f"host list {hostlist!r}: more than {MAX_HOSTS} names")
        names.extend("".join(choice) for choice in itertools.product(*parts))
    return names


def _split_items(hostlist: str) -> list[str]:
    """The comma-separated items of ``hostlist``, commas inside brackets kept."""
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for char in hostlist:
        if char == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"host list {hostlist!r}: nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"host list {hostlist!r}: ']' without '['")
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise HostlistError(f"host list {hostlist!r}: '[' without ']'")
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _parse_item(item: str, hostlist: str) -> list[list[str]]:
    """One item as a list of alternatives per position: literal text has one, a bracket its numbers."""
    parts: list[list[str]] = []
    for index, piece in enumerate(re.split(r"(\[[^\]]*\])", item)):
        if index % 2 == 0:
            if piece:
                parts.append([piece])
        else:
            parts.append(_numbers(piece[1:-1], hostlist))
    return parts


def _numbers(ranges: str, hostlist: str) -> list[str]:
    numbers: list[str] = []
    for text in ranges.split(","):
        match = _RANGE.fullmatch(text.strip())
        if match is None:
            raise HostlistError(f"host list {hostlist!r}: {text!r} in brackets is not N or LOW-HIGH")
        low_text, high_text = match.group(1), match.group(2)
        low = int(low_text)
        high = low if high_text is None else int(high_text)
        if high < low:
            raise HostlistError(f"host list {hostlist!r}: range {text!r} runs backwards")
        if high - low + 1 > MAX_HOSTS:
            raise HostlistError(f"host list {hostlist!r}: more than {MAX_HOSTS} names")
        width = len(low_text)
        numbers.extend(str(number).zfill(width) for number in range(low, high + 1))
    return numbers
