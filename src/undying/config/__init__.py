"""The job spec: every knob of a run, read once at start and validated with one-line errors.

The launcher/controller loads it from YAML and CLI flags; agents and workers receive it as JSON
and rebuild the same ``JobSpec``. ``model`` holds the fields and their ranges, ``loading`` the
ways in and out, ``errors`` the one-line wording, ``compare`` the check that every node runs
the same spec. Read in every process (controller, agent, worker).
"""

from __future__ import annotations

from undying.config.compare import NODE_LOCAL_FIELDS, spec_differences
from undying.config.errors import SpecError
from undying.config.loading import (
    load_job_spec,
    recover_strategy_overrides,
    spec_from_json,
    spec_to_dict,
    validate_job_spec,
)
from undying.config.model import STRATEGIES, CheckpointSpec, JobSpec, SpecStrategy

__all__ = [
    "NODE_LOCAL_FIELDS",
    "STRATEGIES",
    "CheckpointSpec",
    "JobSpec",
    "SpecError",
    "SpecStrategy",
    "load_job_spec",
    "recover_strategy_overrides",
    "spec_differences",
    "spec_from_json",
    "spec_to_dict",
    "validate_job_spec",
]
