"""Django's Tasks API, as its own backends behave (issue 12): a non-JSON argument is a
``TypeError``; a failing task records its own exception class; ``SystemExit`` and
``KeyboardInterrupt`` in a task are FAILED results with that class; and a task's function
path is visible on its job and filters ``list_jobs``, ``requeue_dead`` and the API."""

from __future__ import annotations

import math

import pytest
from django.tasks import TaskResultStatus
from django.tasks.exceptions import InvalidTask
from django.tasks.signals import task_finished
from django.test import Client

from jobs import InvalidJob, engine, enqueueing
from jobs.context import JobContext
from jobs.models import Job, State
from jobs.tasks_backend import InvalidTaskArguments, run_task
from ops import tokens
from tests.testapp import tasks

from .helpers import claim_one, run, run_json


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args",
    [(object(),), (math.nan,), (b"\xff",), ({"key": {1, 2}},)],
    ids=["object", "nan", "bad-bytes", "set"],
)
def test_a_non_json_argument_is_a_type_error(args):
    with pytest.raises(TypeError, match="JSON") as raised:
        tasks.add.enqueue(*args, 1)
    # ... and still what Holdfast and Django code catches: InvalidTask, InvalidJob.
    assert isinstance(raised.value, InvalidTaskArguments | InvalidTask | InvalidJob)
    with pytest.raises(TypeError):
        tasks.add.enqueue(1, b=object())
    assert not Job.objects.exists()


def test_a_failing_task_records_its_own_exception_class(run_worker):
    result = tasks.missing_report.enqueue("2026-12-01")
    run_worker()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    [error] = result.errors
    assert error.exception_class_path == "tests.testapp.tasks.ReportMissing"
    assert error.exception_class is tasks.ReportMissing
    assert "ReportMissing: no report for 2026-12-01" in error.traceback


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("task", "args", "raised", "path"),
    [
        (tasks.exits, (3,), SystemExit, "builtins.SystemExit"),
        (tasks.interrupts, (), KeyboardInterrupt, "builtins.KeyboardInterrupt"),
    ],
    ids=["SystemExit", "KeyboardInterrupt"],
)
def test_a_task_that_exits_fails_with_that_class(task, args, raised, path):
    """The backend's side: the task's handler records the exit as the task's failure (the
    signal carries a FAILED result with the exception's class) and lets it through to the
    worker unchanged, which records the attempt with its class (issue 12, part A)."""
    enqueued = task.enqueue(*args)
    job = claim_one()
    finished = []

    def on_finished(sender, task_result, **kwargs):
        finished.append(task_result)

    task_finished.connect(on_finished)
    try:
        with pytest.raises(raised):
            run_task(JobContext(job, "w1"), **job.args)
    finally:
        task_finished.disconnect(on_finished)
    [reported] = finished
    assert reported.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in reported.errors] == [path]
    assert reported.errors[0].exception_class is raised

    # The attempt as the worker records it: the result read back says the same.
    failure = engine.Failure(
        error_class=raised.__name__, message="", traceback="Traceback ...", context={}
    )
    engine.fail(job, failure, backoff_seconds=0)
    result = task.get_result(enqueued.id)
    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in result.errors] == [path]


def test_the_task_path_is_visible_and_filters_jobs_requeues_and_the_api(run_worker):
    good = tasks.add.enqueue(1, 2)
    bad = tasks.missing_report.enqueue("monday")
    enqueueing.enqueue("test.echo", {"task": "tests.testapp.tasks.add"})  # not a task's job
    run_worker()

    listed = run_json("list_jobs", "--kind", "tests.testapp.tasks.add")
    assert [job["id"] for job in listed["jobs"]] == [int(good.id)]
    assert listed["jobs"][0]["kind"] == "django.task"
    assert listed["jobs"][0]["task"] == "tests.testapp.tasks.add"
    assert "django.task tests.testapp.tasks.add" in run("list_jobs", "--kind", "django.task")
    assert run_json("list_jobs", "--kind", "django.task")["count"] == 2

    _, token = tokens.create("reader", "read")
    response = Client().get(
        "/internal/v1/dead-jobs/?kind=tests.testapp.tasks.missing_report",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert [job["id"] for job in response.json()["jobs"]] == [int(bad.id)]
    assert response.json()["jobs"][0]["task"] == "tests.testapp.tasks.missing_report"

    assert run_json("requeue_dead", "--kind", "tests.testapp.tasks.add")["requeued"] == []
    data = run_json("requeue_dead", "--kind", "tests.testapp.tasks.missing_report")
    assert data["requeued"] == [int(bad.id)]
    assert Job.objects.get(pk=int(bad.id)).state == State.QUEUED

    # The API's requeue chooses by task path too.
    Job.objects.filter(pk=int(bad.id)).update(state=State.DEAD)
    _, writer = tokens.create("writer", "write")
    response = Client().post(
        "/internal/v1/dead-jobs/requeue/",
        {"kind": "tests.testapp.tasks.missing_report"},
        content_type="application/json",
        headers={"Authorization": f"Bearer {writer}"},
    )
    assert response.status_code == 200, response.content
    assert response.json()["requeued"] == [int(bad.id)]
    assert Job.objects.get(pk=int(bad.id)).state == State.QUEUED
