"""The rows (replicas) of a sharded job's (replicate, shard) mesh that a set of ranks makes up.

Shared by the controller (which generations a sharded job may train in: controller/membership.py)
and the worker (the replicas a generation's mesh groups span: runtime/mesh.py); imports nothing
heavy. Rank g sits at row g // shard, column g % shard; a shard's rank has no stand-in within its
replica, so a generation of a sharded job is made of whole rows.
"""

from __future__ import annotations

from collections.abc import Iterable


def rows_of(members: Iterable[int], shard: int) -> list[int]:
    """The rows of which ``members`` hold at least one rank, in order."""
    return sorted({rank // shard for rank in members})


def incomplete_rows(members: Iterable[int], shard: int) -> list[int]:
    """The rows of which ``members`` hold some ranks but not all ``shard`` columns."""
    present = set(members)
    return [row for row in rows_of(present, shard)
            if not all(row * shard + column in present for column in range(shard))]
