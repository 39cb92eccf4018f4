"""Fixtures of the unit tests: job machines driven on a fake clock (tests/unit/job_harness.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.unit.job_harness import Job


@pytest.fixture
def make_job(tmp_path: Path):
    """Makes jobs (``make(**spec_fields)``) and closes their event logs at the end of the test."""
    jobs: list[Job] = []

    def make(**spec_fields: Any) -> Job:
        job = Job(tmp_path / f"run{len(jobs)}", **spec_fields)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()
