"""The replica state of a data-parallel job kept once per node in T1: each local rank's snapshot holds
its part, and a reader puts the node's parts back together.

Runs in the worker: the training thread writes its part (``replica_part``, for runtime/snapshots.py),
and a restart or a repair from node memory reads the node's snapshot of a step (``NodeReplica``).
Data-parallel ranks hold the same model and optimizer state after every commit, so keeping it in
every rank's slots multiplies host memory by the ranks per node; here the replica's bytes are
dealt out to the node's local ranks in equal ranges (the same deal on every rank): the tensors in
their order, a range boundary falling inside a tensor splitting it into pieces (a model whose
embedding outweighs a rank's share copies no more on one rank than on another). Each rank copies only
its part, beside its own state (RNG, registered objects). A snapshot of
a step exists on the node when every local rank's slot holds its part of it, each behind its own
commit word (checkpoint/snapshot_slot.py). The rank that writes a T2 checkpoint keeps the whole
replica in its snapshot of that checkpoint's step (its persister reads nothing but its own slot).

Not for sharded jobs (each rank's shard differs) nor without node shared memory.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from undying.checkpoint.snapshot import RankSnapshots
from undying.checkpoint.state_tree import copy_into, flatten_state, unflatten_state

PART = "replica_part"  # a snapshot's key for its part of the node's replica state
REPLICA = "replica"  # ... for the whole replica state (every snapshot of a job that does not share it)


Piece = tuple[int, int, int]  # (index of a tensor in the flattened replica, first element, end element)


def deal(tensors: Sequence[tuple[int, int, bool]], parts: int) -> list[list[Piece]]:
    """Each part's pieces of the tensors given as (elements, bytes per element, splittable): the
    tensors' bytes, in order, cut into ``parts`` ranges of equal size, a cut inside a splittable tensor
    at an element boundary; a tensor that is not splittable (not contiguous: no flat view) goes whole
    to the part its first byte falls in. A pure function of its inputs, so every rank of the node deals alike."""
    total = sum(numel * element_size for numel, element_size, _ in tensors)
    ends = [total * (part + 1) // parts for part in range(parts)]  # the byte offset where each part ends
    pieces: list[list[Piece]] = [[] for _ in range(parts)]
    part, offset = 0, 0
    for index, (numel, element_size, splittable) in enumerate(tensors):
        first = 0
        while True:
            while part < parts - 1 and offset + first * element_size >= ends[part]:
                part += 1
            to_the_end = not splittable or part == parts - 1  # the tensor's rest goes to this part
            stop = numel if to_the_end else min(numel, -(-(ends[part] - offset) // element_size))
            pieces[part].append((index, first, stop))
            first = stop
            if first >= numel:
                break
        offset += numel * element_size
    return pieces


def replica_part(replica: Any, local_index: int, local_count: int) -> dict[str, Any]:
    """Local rank ``local_index``'s part of ``replica``: the skeleton (small: everything but tensors;
    pickled, so that the snapshot's own walk over its tree leaves its tensor references alone), how
    many tensors the whole has, and this rank's pieces (``deal``) with each piece's tensor: the tensor
    itself where the piece is all of it, else a flat view of its elements."""
    skeleton, tensors = flatten_state(replica)
    mine = deal([(tensor.numel(), tensor.element_size(), tensor.is_contiguous()) for tensor in tensors],
                local_count)[local_index]
    return {"skeleton": pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL), "count": len(tensors),
            "pieces": [[index, first, stop, list(tensors[index].shape)] for index, first, stop in mine],
            "tensors": [_piece(tensors[index], first, stop) for index, first, stop in mine]}


def _piece(tensor: torch.Tensor, first: int, stop: int) -> torch.Tensor:
    return tensor if (first, stop) == (0, tensor.numel()) else tensor.reshape(-1)[first:stop]


class NodeReplica:
    """Reads the node's snapshots as one rank's: its own slots and, opened for each call, the slots of
    the node's other local ranks that share the replica (files in the same directory; none when
    ``local_ranks`` is this rank alone, whose snapshots then hold the whole replica). Only while no
    rank of the node writes a snapshot: at a restart (every process new) and in a recovery (every
    survivor has settled its snapshots and waits for the plan)."""

    def __init__(self, directory: Path | None, own: RankSnapshots, local_ranks: Sequence[int], slots: int) -> None:
        self.directory = directory
        self.own = own
        self.local_ranks = list(local_ranks)
        self.others = [rank for rank in self.local_ranks if rank != own.rank]
        self.slots = slots

    def held(self, replicas: int) -> list[int]:
        """The steps, newest first, of which every local rank holds a complete snapshot taken with
        ``replicas`` replicas (a snapshot of another size predates a shrink or a grow), and whose
        parts fit together (the same tensor count, every tensor in some part)."""
        steps = {info.step for info in self.own.committed() if info.world_size == replicas}
        if not self.others:  # this rank's snapshots are whole: nothing to fit together
            return sorted(steps, reverse=True)
        others = self._open_others()
        try:
            for snapshots in others:
                steps &= {info.step for info in snapshots.committed() if info.world_size == replicas}
            return sorted((step for step in steps if _parts_fit(step, [self.own, *others])), reverse=True)
        finally:
            for snapshots in others:
                snapshots.close()

    def read(self, step: int, live: dict[str, Any]) -> dict[str, Any]:
        """The state of ``step`` as one rank's snapshot holds it (``replica`` and ``rank``): this rank's
        own part, and the replica put together from the node's parts, copied into ``live``'s tensors
        where they match (``copy_into``). KeyError if a local rank holds no complete part of it."""
        own_slot = self.own.pin(step)
        others: list[RankSnapshots] = []
        pins: list[tuple[RankSnapshots, int]] = []
        try:
            state = self.own.read_slot(own_slot, clone=False)
            replica = state.get(REPLICA)
            if replica is None:  # a part: the other local ranks' parts are opened only now
                others = self._open_others()
                parts = [state[PART]]
                for snapshots in others:
                    pins.append((snapshots, snapshots.pin(step)))
                    other = snapshots.read_slot(pins[-1][1], clone=False)
                    if REPLICA in other:  # the T2 writer's snapshot of a checkpoint step: the whole of it
                        parts = [_whole(other[REPLICA], state[PART]["skeleton"])]
                        break
                    parts.append(other[PART])
                why_not = _why_parts_do_not_fit(parts)
                if why_not is not None:
                    raise KeyError(f"the node's parts of step {step} {why_not}")
                replica = _assemble(parts)
            return copy_into({REPLICA: replica, "rank": state["rank"]}, live)
        finally:
            for snapshots, slot in pins:
                snapshots.unpin(slot)
            for snapshots in others:
                snapshots.close()
            self.own.unpin(own_slot)

    def _open_others(self) -> list[RankSnapshots]:
        return [RankSnapshots(self.directory, rank, self.slots, populate=False) for rank in self.others]


def _parts_fit(step: int, ranks: list[RankSnapshots]) -> bool:
    """Do the ranks' snapshots of ``step`` make one replica? (Only their skeletons are read.)"""
    parts = []
    for snapshots in ranks:
        slot = snapshots.pin(step)
        try:
            state = snapshots.read_slot(slot, clone=False)
            if REPLICA in state:
                return True
            parts.append({"count": state[PART]["count"], "pieces": state[PART]["pieces"]})
            del state  # views into the slot
        finally:
            snapshots.unpin(slot)
    return _why_parts_do_not_fit(parts) is None


def _why_parts_do_not_fit(parts: list[dict[str, Any]]) -> str | None:
    """Why ``parts`` do not make one replica (their tensor counts differ, a tensor's pieces disagree on
    its shape, or leave some of its elements in no part), or None."""
    counts = {part["count"] for part in parts}
    if len(counts) != 1:
        return f"hold different tensor counts ({sorted(counts)})"
    count = counts.pop()
    spans: dict[int, list[tuple[int, int]]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for part in parts:
        for index, first, stop, shape in part["pieces"]:
            if shapes.setdefault(index, tuple(shape)) != tuple(shape):
                return f"disagree on the shape of tensor {index}"
            spans.setdefault(index, []).append((first, stop))
    covered = [index for index in range(count) if _covered(sorted(spans.get(index, [])), math.prod(shapes.get(index, ())))]
    if len(covered) != count:
        return f"cover {len(covered)} of its {count} tensors"
    return None


def _covered(spans: list[tuple[int, int]], numel: int) -> bool:
    """Do the sorted ``spans`` cover elements 0 .. ``numel`` - 1, each once?"""
    end = 0
    for first, stop in spans:
        if first != end:
            return False
        end = stop
    return bool(spans) and end == numel


def _whole(replica: Any, skeleton: Any) -> dict[str, Any]:
    """A whole replica as the one part that holds every tensor, under this rank's ``skeleton``."""
    _, tensors = flatten_state(replica)
    return {"skeleton": skeleton, "count": len(tensors), "tensors": tensors,
            "pieces": [[index, 0, tensor.numel(), list(tensor.shape)] for index, tensor in enumerate(tensors)]}


def _assemble(parts: list[dict[str, Any]]) -> Any:
    """The replica from parts that fit (``_why_parts_do_not_fit``), under the first part's skeleton
    (this rank's own values). A tensor held whole by one part is that part's (a view into its slot); a
    split one is put together in fresh memory."""
    pieces: dict[int, list[tuple[int, int, list[int], torch.Tensor]]] = {}
    for part in parts:
        for (index, first, stop, shape), tensor in zip(part["pieces"], part["tensors"], strict=True):
            pieces.setdefault(index, []).append((first, stop, shape, tensor))
    tensors = []
    for index in range(parts[0]["count"]):
        held = sorted(pieces[index], key=lambda piece: piece[0])
        if len(held) == 1:
            tensors.append(held[0][3])
            continue
        joined = torch.empty(held[-1][1], dtype=held[0][3].dtype)
        for first, stop, _, tensor in held:
            joined[first:stop].copy_(tensor)
        tensors.append(joined.view(held[0][2]))
    skeleton = pickle.loads(parts[0]["skeleton"])  # noqa: S301 - this node's own shared memory, as every T1 read
    return unflatten_state(skeleton, tensors)
