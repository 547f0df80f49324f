"""Django tasks run by real ``manage.py runworker`` processes: a burst run, and a worker
SIGKILLed mid-task whose task is reclaimed and finished by another worker."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from django.tasks import TaskResultStatus

from jobs.models import State
from jobs.tasks_backend import LeaseExpired
from tests.process.helpers import job_summary, wait_for_job, wait_for_marker
from tests.support.workers import WorkerPool
from tests.testapp import tasks

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


def test_runworker_burst_runs_django_tasks(workers: WorkerPool) -> None:
    added = tasks.add.enqueue(20, 22)
    greeted = tasks.greet.enqueue("runworker")
    described = tasks.describe.enqueue("subprocess")
    exploded = tasks.explode.enqueue("on purpose")

    done = workers.command("runworker", "--burst", "--worker-id", "burst", timeout=60)
    assert done.returncode == 0, done.describe()

    assert tasks.add.get_result(added.id).return_value == 42
    assert tasks.greet.get_result(greeted.id).return_value == "hello runworker"
    context = tasks.describe.get_result(described.id)
    assert context.return_value["attempt"] == 1
    assert context.return_value["worker_ids"] == ["burst"]
    failed = tasks.explode.get_result(exploded.id)
    assert failed.status == TaskResultStatus.FAILED
    assert [error.exception_class for error in failed.errors] == [ValueError]
    for result in (added, greeted, described, exploded):
        result.refresh()
        assert result.is_finished and result.worker_ids == ["burst"]


def test_sigkill_mid_task_is_reclaimed_and_finished_with_two_attempts(
    workers: WorkerPool, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    result = tasks.sleep_on_first_attempt.enqueue(marker=str(marker), seconds=60)
    job_id = int(result.id)
    victim = workers.start("victim")
    wait_for_marker(marker, victim)
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING and result.worker_ids == ["victim"]

    assert victim.kill() == -signal.SIGKILL
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING  # until its 2-second lease runs out

    rescuer = workers.start("rescuer")
    wait_for_job(job_id, State.SUCCEEDED, workers, timeout=20)
    assert rescuer.events("lease_reclaimed", job_id=job_id, lease_token=1)

    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL, job_summary([job_id])
    assert result.attempts == 2
    assert result.worker_ids == ["victim", "rescuer"]
    assert result.return_value == {"attempt": 2, "worker_ids": ["victim", "rescuer"]}
    [error] = result.errors  # the killed attempt, reclaimed: no exception was raised
    assert error.exception_class is LeaseExpired
    assert "worker victim stopped renewing lease 1" in error.traceback
    assert result.started_at < result.last_attempted_at <= result.finished_at
    assert rescuer.alive
