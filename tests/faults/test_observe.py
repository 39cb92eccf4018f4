"""Watching a real job: ``/metrics`` scraped while a worker is SIGKILLed and recovered in place,
parsed with prometheus_client's text parser, its counters and histograms moving across the
recovery; the controller found through the run directory, as ``undying status RUN_DIR`` finds it.
The final parameters still equal the fault-free run's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import JobRun, assert_ends_bitwise, start_job, wait_no_processes
from undying.client import ControllerClient, ControllerUnreachable
from undying.launch.controller_files import TOKEN_FILE, read_controller_record

pytestmark = pytest.mark.faults

PROCESS_LEVEL = ["--set", "process_recover=true", "--recover-strategy", "retry,recover-in-place"]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, by name and labels."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(scrape: dict, name: str, **labels: str) -> float:
    return scrape.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_across_a_real_recovery(reference_run: JobRun, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Steps that take a moment (the numbers are unchanged), so that scrapes land before and after the fault.
    process, mark = start_job(run_dir, [*PROCESS_LEVEL, "--inject", "kill:rank=1:step=12"],
                              script_args=["--step-sleep", "0.1"])
    scrapes = []
    try:
        deadline = time.time() + 120
        while not (run_dir / "controller.json").exists():
            assert time.time() < deadline and process.poll() is None, "no controller.json in the run dir"
            time.sleep(0.1)
        record = read_controller_record(run_dir)
        client = ControllerClient(record.address, (run_dir / TOKEN_FILE).read_text().strip(), timeout=5.0)
        while process.poll() is None and time.time() < deadline:
            try:
                scrapes.append(samples(client.get("/metrics")))
            except ControllerUnreachable:
                pass  # the job has just ended
            time.sleep(0.2)
        client.close()
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert wait_no_processes(mark) == []
    run = JobRun(process.returncode, output, run_dir, mark)
    assert run.returncode == 0, run.output + run.logs()
    assert_ends_bitwise(run, reference_run)

    before = [s for s in scrapes if value(s, "undying_steps_total") > 0
              and value(s, "undying_faults_total", reason="worker_exit") == 0]
    after = [s for s in scrapes if value(s, "undying_mttr_seconds_count") == 1]
    assert before and after, f"{len(scrapes)} scrapes, none before or after the recovery"
    first, last = before[0], after[-1]
    assert value(first, "undying_recoveries_total", strategy="recover-in-place") == 0
    assert value(last, "undying_faults_total", reason="worker_exit") == 1
    assert value(last, "undying_recoveries_total", strategy="recover-in-place") == 1
    assert 0 < value(last, "undying_mttr_seconds_sum") < 60
    for phase in ("wait_for_plan", "rebuild", "repair"):  # every rank's part of the recovery
        assert value(last, "undying_recovery_phase_seconds_count", strategy="recover-in-place", phase=phase) == 4
    assert value(last, "undying_steps_total") > value(first, "undying_steps_total") >= 1
    assert value(last, "undying_step_seconds_count") > value(first, "undying_step_seconds_count")
    assert value(last, "undying_checkpoint_stall_seconds_count") >= 1
    assert value(last, "undying_checkpoint_persist_seconds_count") >= 1
    assert value(last, "undying_checkpoint_durable_step") >= 10
    assert value(last, "undying_generation") == 2 and value(last, "undying_recoveries_counted") == 1
    assert value(last, "undying_train_loss", stat="min") <= value(last, "undying_train_loss", stat="max")
    # A counter never goes back while one controller serves the job.
    counters = {key for scrape in scrapes for key in scrape if key[0].endswith(("_total", "_count", "_sum"))}
    for key in counters:
        seen = [scrape[key] for scrape in scrapes if key in scrape]
        assert seen == sorted(seen), key
