"""A script that fails the same way at every try stops by itself, with its cause on the console.

Real processes: 2 simulated nodes x 2 workers; rank 2 raises ``RuntimeError("boom")`` in its step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, run_job
from undying import events as ev

pytestmark = pytest.mark.faults
BOOM = REPO / "tests" / "scripts" / "boom.py"


@pytest.mark.parametrize("guarded", [False, True], ids=["process-ends", "retry-keeps-process"])
def test_a_crash_loop_stops_with_its_cause_on_the_console_and_in_the_report(tmp_path: Path, guarded: bool) -> None:
    """Unguarded, rank 2 dies at step 0 and is replaced in place, then dies again; guarded, it votes no
    under retry and the step is retried. Either way the same exception at the same step stops the job
    (exit 1) with rank 2's exception and traceback on the console, in the event log and in the report."""
    run = run_job(tmp_path, ["--set", "process_recover=true", "--recover-strategy", "retry,recover-in-place"],
                  steps=10, script=BOOM, script_args=["--guarded"] * guarded, timeout=120)
    assert run.returncode == 1, run.output + run.logs()
    [loop] = run.kinds(ev.CRASH_LOOP)
    assert (loop.rank, loop.step, loop.details["error"]) == (2, 0, "RuntimeError: boom")
    assert loop.details["log_tail"][-1] == "RuntimeError: boom"
    assert any('raise RuntimeError("boom")' in line for line in loop.details["log_tail"])
    assert len(run.kinds(ev.FAULT_DETECTED)) == 2  # the first try and one replay: no more
    assert "CRASH LOOP" in run.output and "root cause: rank 2" in run.output
    assert "  | RuntimeError: boom" in run.output
    fault_lines = [line for line in run.output.splitlines() if "FAULT" in line]
    assert fault_lines and all(line.endswith("RuntimeError: boom") for line in fault_lines), run.output

    from undying.events import read_events
    from undying.report import render_summary, summarize

    report = render_summary(summarize(read_events(tmp_path)))
    assert "crash loop: the same exception again at step 0; root cause: rank 2" in report
    assert "  | RuntimeError: boom" in report


def test_a_script_that_fails_after_training_is_not_a_crash_loop_until_it_stops_progressing(tmp_path: Path) -> None:
    """Rank 2 raises from step 3 on, unguarded: steps 0-2 commit, then every replay of step 3 fails the
    same way and the job stops there: the committed steps before do not hide the loop."""
    run = run_job(tmp_path, ["--set", "process_recover=true", "--recover-strategy", "recover-in-place"],
                  steps=10, script=BOOM, script_args=["--from-step", "3"], timeout=120)
    assert run.returncode == 1, run.output + run.logs()
    [loop] = run.kinds(ev.CRASH_LOOP)
    assert (loop.rank, loop.step) == (2, 3), loop
