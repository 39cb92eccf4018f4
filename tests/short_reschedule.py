"""``undying`` with elastic training's reschedule wait shortened, for fault tests and benchmarks.

``python tests/short_reschedule.py SECONDS run ...`` is ``undying run ...`` except that the
controller, which runs in this process, waits SECONDS for a lost node instead of the spec's
``wait_reschedule_timeout``, whose 30 s floor (MindCluster's range) would make every elastic
test idle half a minute. Agents and workers never read the wait; their spec is unchanged.
Not for ``--etcd`` jobs, whose controller candidates are other processes.
"""

from __future__ import annotations

import sys

from undying.cli import main
from undying.config import JobSpec


def shorten_reschedule_wait(seconds: float) -> None:
    """Make every spec in this process report ``seconds`` as its reschedule wait."""

    def short_wait(spec: JobSpec) -> float:
        return seconds

    JobSpec.reschedule_wait = short_wait  # type: ignore[method-assign]


if __name__ == "__main__":
    shorten_reschedule_wait(float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
