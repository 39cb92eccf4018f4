"""Whether two nodes run the same job: the job-wide fields on which two specs differ.

Runs in the controller, which compares each agent's spec (sent in its hello, in the wire form
of ``spec_to_dict``) with its own; a node launched with other flags or another YAML file would
otherwise train under other timeouts, strategies or checkpoint settings than the rest.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from undying.config.model import JobSpec

# Fields that may differ from node to node: paths on the node's own disk that no other process
# reads. compile_cache is one (kernels compiled on that node, kept wherever it has room).
# checkpoint.dir is not: every rank saves to and restores from the one storage it names.
NODE_LOCAL_FIELDS: frozenset[str] = frozenset({"compile_cache"})


def spec_differences(ours: JobSpec, theirs: JobSpec) -> list[str]:
    """The job-wide fields whose values differ between two specs, sorted by name; nested
    fields are dotted (``checkpoint.interval``). Empty when both nodes run the same job.

    Every field is job-wide except those in ``NODE_LOCAL_FIELDS``. Values are compared exactly
    as validated: ``recover_strategy: [retry, exit]`` and ``[exit, retry]`` differ, and so do
    two ``checkpoint.dir`` spellings of the same place.
    """
    return sorted(_differing_fields(ours, theirs, prefix=""))


def _differing_fields(ours: BaseModel, theirs: BaseModel, prefix: str) -> list[str]:
    differing: list[str] = []
    for name in type(ours).model_fields:
        dotted = prefix + name
        if dotted in NODE_LOCAL_FIELDS:
            continue
        our_value: Any = getattr(ours, name)
        their_value: Any = getattr(theirs, name)
        if isinstance(our_value, BaseModel) and isinstance(their_value, BaseModel):
            differing += _differing_fields(our_value, their_value, prefix=dotted + ".")
        elif our_value != their_value:
            differing.append(dotted)
    return differing
