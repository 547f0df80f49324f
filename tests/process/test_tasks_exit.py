"""A Django task that calls ``sys.exit()`` or raises ``KeyboardInterrupt`` does not take its
worker down: through a real worker process the result is FAILED with that exception's
class, as Django's own backends report it, and the worker goes on (issue 12)."""

from __future__ import annotations

import pytest
from django.tasks import TaskResultStatus

from jobs.models import Job
from tests.support.workers import WorkerPool
from tests.testapp import tasks

pytestmark = pytest.mark.process


def test_sys_exit_and_keyboard_interrupt_in_tasks_are_failed_results(workers: WorkerPool):
    exited = tasks.exits.enqueue(3)
    interrupted = tasks.interrupts.enqueue()
    after = tasks.add.enqueue(2, 2)
    worker = workers.start("tasks-exit", "--burst")
    assert worker.wait_exit(timeout=30) == 0, worker.describe()

    for result, path in (
        (exited, "builtins.SystemExit"),
        (interrupted, "builtins.KeyboardInterrupt"),
    ):
        result.refresh()
        assert result.status == TaskResultStatus.FAILED, worker.describe()
        assert [error.exception_class_path for error in result.errors] == [path]
        assert Job.objects.get(pk=int(result.id)).attempts == 1
    after.refresh()
    assert after.status == TaskResultStatus.SUCCESSFUL and after.return_value == 4
