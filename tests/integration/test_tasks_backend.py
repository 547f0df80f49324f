"""Django's Tasks API on Holdfast: enqueue through ``Task.enqueue()``, run by the worker,
read back with ``get_result()``; Django's contract; options, signals and system checks.

The sample tasks are in tests/testapp/tasks.py; tests/settings.py configures ``TASKS``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core import checks
from django.db import transaction
from django.db.models.functions import Now
from django.tasks import TaskResultStatus, task, task_backends
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils import timezone

from jobs import engine, enqueueing, operations
from jobs.models import Job, State
from jobs.tasks_backend import KIND, HoldfastBackend, LeaseExpired
from tests.testapp import tasks

from .helpers import claim_one, expire_lease

BACKEND = "jobs.tasks_backend.HoldfastBackend"


def make_due(result_id: str) -> None:
    """Skip a retry's backoff: the job becomes runnable now (database clock)."""
    Job.objects.filter(pk=int(result_id), state=State.QUEUED).update(run_at=Now())


# --- running tasks -----------------------------------------------------------------------


def test_tasks_run_by_the_worker_report_status_and_return_values(run_worker):
    results = {
        "add": tasks.add.enqueue(2, b=3),
        "greet": tasks.greet.enqueue("ada"),
        "describe": tasks.describe.enqueue(label="ctx"),
        "describe_async": tasks.describe_async.enqueue("actx"),
        "shapes": tasks.shapes.enqueue(),
        "nothing": tasks.nothing.enqueue(),
    }
    for enqueued in results.values():
        assert enqueued.status == TaskResultStatus.READY
        assert enqueued.enqueued_at is not None and enqueued.worker_ids == []

    assert run_worker(worker_id="w-tasks") == len(results)

    fetched = {name: getattr(tasks, name).get_result(r.id) for name, r in results.items()}
    for name, result in fetched.items():
        assert result.status == TaskResultStatus.SUCCESSFUL, (name, result.errors)
        assert result.is_finished and result.errors == []
        assert result.worker_ids == ["w-tasks"] and result.attempts == 1
        assert result.enqueued_at <= result.started_at <= result.finished_at
        assert result.last_attempted_at == result.started_at
        assert result.backend == "default"
        assert result.id == results[name].id
    assert fetched["add"].return_value == 5
    assert (fetched["add"].args, fetched["add"].kwargs) == ([2], {"b": 3})
    assert fetched["greet"].return_value == "hello ada"
    assert fetched["describe"].return_value == {
        "label": "ctx",
        "attempt": 1,
        "id": results["describe"].id,
        "status": "RUNNING",
        "worker_ids": ["w-tasks"],
    }
    assert fetched["describe_async"].return_value == {"label": "actx", "attempt": 1}
    assert fetched["shapes"].return_value == {
        "pair": [1, 2],
        "raw": "bytes",
        "none": None,
        "nested": [{"x": 1.5}],
    }
    assert fetched["nothing"].return_value is None
    job = Job.objects.get(pk=int(results["add"].id))
    assert (job.kind, job.state, job.result) == (KIND, State.SUCCEEDED, 5)


def test_a_raising_task_fails_with_its_exception_and_traceback(run_worker):
    result = tasks.explode.enqueue("bad input")
    run_worker(worker_id="w1")

    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.is_finished
    assert result.finished_at is not None and result.worker_ids == ["w1"]
    [error] = result.errors
    assert error.exception_class_path == "builtins.ValueError"
    assert error.exception_class is ValueError
    assert "raise ValueError(message)" in error.traceback
    assert "ValueError: bad input" in error.traceback
    with pytest.raises(ValueError, match="Task failed"):
        _ = result.return_value
    job = Job.objects.get(pk=int(result.id))
    assert (job.state, job.attempts, job.max_attempts) == (State.DEAD, 1, 1)

    # An operator's requeue makes it READY again; the failed attempt stays on record.
    operations.requeue_one(job.pk)
    result.refresh()
    assert result.status == TaskResultStatus.READY and len(result.errors) == 1
    assert result.finished_at is None


def test_a_permanent_error_or_a_non_json_return_value_fails_at_once(run_worker):
    refused = tasks.refuse.enqueue()
    odd = tasks.not_json.enqueue()
    assert run_worker() == 2
    for result, message in ((refused, "retrying cannot help"), (odd, "not JSON")):
        result = tasks.refuse.get_backend().get_result(result.id)
        assert result.status == TaskResultStatus.FAILED
        assert result.attempts == 1  # though the backend allows 3
        [error] = result.errors
        assert error.exception_class_path == "jobs.exceptions.PermanentError"
        assert message in error.traceback


def test_a_return_value_the_database_cannot_store_fails_the_task_and_says_so(run_worker):
    """It failed after the handled block: the job went dead, but no ``task_finished`` was
    sent (audit)."""
    finished: list[tuple[str, str]] = []

    def receive(sender: type, task_result: Any, **kwargs: Any) -> None:
        finished.append((task_result.task.name, task_result.status))

    task_finished.connect(receive)
    try:
        result = tasks.unstorable.enqueue()
        assert run_worker() == 1
    finally:
        task_finished.disconnect(receive)
    assert finished == [("unstorable", TaskResultStatus.FAILED)]
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.attempts == 1
    [error] = result.errors
    assert "cannot be stored" in error.traceback


def test_a_task_leaving_a_transaction_open_fails_each_attempt_and_says_so_once(run_worker):
    """It sent ``task_finished`` SUCCESSFUL for attempts that then failed, and no FAILED at
    the last (PostgreSQL); on SQLite its completion committed the half-done work and the
    job ended succeeded (helper-29 #8). Both databases: each attempt fails, nothing of it
    commits, one FAILED at the end."""
    from tests.testapp.models import Effect

    finished: list[str] = []

    def receive(sender: type, task_result: Any, **kwargs: Any) -> None:
        finished.append(task_result.status)

    task_finished.connect(receive)
    try:
        result = tasks.leaves_a_transaction_open.enqueue("half-done")
        assert run_worker() == 1
        assert finished == []  # a retry follows: no signal
        make_due(result.id)
        assert run_worker() == 1
    finally:
        task_finished.disconnect(receive)
    assert finished == [TaskResultStatus.FAILED]
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.attempts == 2
    assert [e.exception_class_path for e in result.errors] == [
        "jobs.exceptions.TransactionLeftOpen"
    ] * 2
    assert not Effect.objects.filter(label="half-done").exists()


def test_a_failed_attempt_is_retried_and_every_attempt_is_reported(run_worker):
    result = tasks.flaky.enqueue(fail_until=2)
    assert run_worker(worker_id="w1") == 1  # the retry waits for its backoff

    result.refresh()
    assert result.status == TaskResultStatus.READY and not result.is_finished
    assert result.worker_ids == ["w1"] and result.finished_at is None
    assert [e.exception_class_path for e in result.errors] == ["builtins.ConnectionError"]
    assert "transient failure on attempt 1" in result.errors[0].traceback
    with pytest.raises(ValueError, match="not finished"):
        _ = result.return_value

    make_due(result.id)
    assert run_worker(worker_id="w2") == 1
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 2  # the attempt its TaskContext reported
    assert result.worker_ids == ["w1", "w2"] and result.attempts == 2
    assert len(result.errors) == 1
    assert result.started_at < result.last_attempted_at <= result.finished_at


def test_signals_are_sent_when_tasks_are_enqueued_start_and_finish(run_worker):
    seen: list[tuple[str, str, str, int, int]] = []
    backend = task_backends["default"]

    def recorder(name: str) -> Any:
        def receive(sender: type, task_result: Any, **kwargs: Any) -> None:
            assert sender is HoldfastBackend
            seen.append(
                (
                    name,
                    task_result.task.name,
                    task_result.status,
                    task_result.attempts,
                    len(task_result.errors),
                )
            )
            if name == "finished" and task_result.status == TaskResultStatus.SUCCESSFUL:
                # Success is committed before task_finished is sent.
                stored = backend.get_result(task_result.id)
                assert stored.status == TaskResultStatus.SUCCESSFUL

        return receive

    receivers = {
        task_enqueued: recorder("enqueued"),
        task_started: recorder("started"),
        task_finished: recorder("finished"),
    }
    for signal, receiver in receivers.items():
        signal.connect(receiver)
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            tasks.add.enqueue(1, 1)
            raise RuntimeError("the caller rolls back: nothing was enqueued")
        assert seen == []

        ok = tasks.add.enqueue(1, 2)
        flaky = tasks.flaky.enqueue(fail_until=2)
        tasks.explode.enqueue("no")
        assert [entry[:2] for entry in seen] == [
            ("enqueued", "add"),
            ("enqueued", "flaky"),
            ("enqueued", "explode"),
        ]
        seen.clear()
        run_worker()
        assert seen == [
            ("started", "add", "RUNNING", 1, 0),
            ("finished", "add", "SUCCESSFUL", 1, 0),
            ("started", "flaky", "RUNNING", 1, 0),  # fails, will be retried: not finished
            ("started", "explode", "RUNNING", 1, 0),
            ("finished", "explode", "FAILED", 1, 1),  # no attempt left
        ]
        seen.clear()
        make_due(flaky.id)
        run_worker()
        assert seen == [
            ("started", "flaky", "RUNNING", 2, 1),
            ("finished", "flaky", "SUCCESSFUL", 2, 1),
        ]
        assert tasks.add.get_result(ok.id).return_value == 3
    finally:
        for signal, receiver in receivers.items():
            signal.disconnect(receiver)


def test_a_database_fault_is_not_a_tasks_final_failure(run_worker):
    """A task that met a database fault on its last attempt is given back uncharged, as
    every job is: no ``task_finished`` FAILED for a task that will run again."""
    finished: list[str] = []

    def receive(sender: type, task_result: Any, **kwargs: Any) -> None:
        finished.append(task_result.status)

    task_finished.connect(receive)
    try:
        result = tasks.loses_its_database.enqueue()
        run_worker()
    finally:
        task_finished.disconnect(receive)
    assert finished == []
    job = Job.objects.get(pk=int(result.id))
    assert (job.state, job.attempts, job.max_attempts) == (State.QUEUED, 0, 1)
    result.refresh()
    assert result.status == TaskResultStatus.READY and not result.is_finished


def test_a_failing_signal_receiver_does_not_change_the_outcome(run_worker):
    def broken(**kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    task_started.connect(broken)
    task_finished.connect(broken)
    try:
        result = tasks.add.enqueue(2, 2)
        run_worker()
    finally:
        task_started.disconnect(broken)
        task_finished.disconnect(broken)
    assert tasks.add.get_result(result.id).return_value == 4


def test_priority_and_run_after_decide_when_tasks_run(run_worker):
    later = timezone.now() + timedelta(hours=1)
    low = tasks.add.using(priority=-5).enqueue(0, 1)
    high = tasks.add.using(priority=50).enqueue(0, 2)
    deferred = tasks.add.using(run_after=later).enqueue(0, 3)
    assert run_worker() == 2

    first, second = (tasks.add.get_result(r.id) for r in (high, low))
    assert first.started_at <= second.started_at
    assert Job.objects.get(pk=int(high.id)).leases.get().pk < (
        Job.objects.get(pk=int(low.id)).leases.get().pk
    )
    waiting = tasks.add.get_result(deferred.id)
    assert waiting.status == TaskResultStatus.READY and waiting.worker_ids == []
    assert waiting.task.run_after == later
    assert Job.objects.get(pk=int(deferred.id)).run_at == later
    assert (first.task.priority, second.task.priority) == (50, -5)


def test_a_reclaimed_attempt_is_reported_and_a_released_one_is_not(run_worker):
    result = tasks.describe.enqueue("after a crash")
    claimed = claim_one("w-leaving")
    engine.release(claimed)  # graceful shutdown gave it back: not charged
    result.refresh()
    assert (result.status, result.worker_ids, result.errors) == (TaskResultStatus.READY, [], [])

    claim_one("w-dead")
    assert tasks.describe.get_result(result.id).status == TaskResultStatus.RUNNING
    expire_lease(claimed.id)
    assert engine.reclaim_expired() == [claimed.id]
    result.refresh()
    assert result.status == TaskResultStatus.READY and result.worker_ids == ["w-dead"]
    [error] = result.errors
    assert error.exception_class_path == "jobs.tasks_backend.LeaseExpired"
    assert error.exception_class is LeaseExpired
    assert "stopped renewing" in error.traceback

    run_worker(worker_id="w-rescue")
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.worker_ids == ["w-dead", "w-rescue"]
    assert result.return_value["attempt"] == 2  # TaskContext.attempt is the job's attempt
    assert result.return_value["worker_ids"] == ["w-dead", "w-rescue"]


@pytest.mark.django_db
def test_a_cancelled_task_is_failed():
    result = tasks.add.enqueue(1, 1)
    operations.cancel(int(result.id))
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.finished_at is not None
    [error] = result.errors
    assert error.exception_class_path == "jobs.exceptions.Cancelled"
    assert "cancelled by operator" in error.traceback


def test_async_enqueue_and_get_result(run_worker):
    result = async_to_sync(tasks.greet.aenqueue)("grace")
    run_worker()
    fetched = async_to_sync(tasks.greet.aget_result)(result.id)
    assert fetched.return_value == "hello grace"
    async_to_sync(result.arefresh)()
    assert result.status == TaskResultStatus.SUCCESSFUL


# --- enqueue -----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_enqueue_writes_one_job_in_the_callers_transaction(settings):
    with pytest.raises(RuntimeError), transaction.atomic():
        rolled_back = tasks.add.enqueue(1, 2)
        assert Job.objects.filter(pk=int(rolled_back.id)).exists()
        raise RuntimeError("rollback")
    assert not Job.objects.filter(pk=int(rolled_back.id)).exists()
    with pytest.raises(TaskResultDoesNotExist):
        tasks.add.get_result(rolled_back.id)

    result = tasks.add.enqueue(1, b=2)
    job = Job.objects.get(pk=int(result.id))
    assert (job.kind, job.lane, job.priority, job.state) == (KIND, "default", 0, State.QUEUED)
    assert job.args == {
        "task": "tests.testapp.tasks.add",
        "args": [1],
        "kwargs": {"b": 2},
        "backend": "default",
        "takes_context": False,
        "run_after": None,
    }
    assert job.max_attempts == 3  # the backend's OPTIONS
    assert job.lease_seconds == settings.HOLDFAST_LEASE_SECONDS
    assert result.enqueued_at == job.created_at


@pytest.mark.django_db
def test_task_options_and_backend_defaults_reach_the_job():
    job = Job.objects.get(pk=int(tasks.with_options.enqueue("mon").id))
    assert (job.max_attempts, job.lease_seconds) == (4, 7.5)
    assert job.args["locks"] == ["reports"]
    assert job.locks == ["reports"]  # the engine holds it while the task runs
    job = Job.objects.get(pk=int(tasks.transfer.enqueue(7, amount=5).id))
    assert job.args["locks"] == ["account:7"]
    assert "locks" not in Job.objects.get(pk=int(tasks.add.enqueue(1, 1).id)).args

    once = tasks.add.using(backend="once")
    result = once.enqueue(1, 1)
    job = Job.objects.get(pk=int(result.id))
    assert (job.max_attempts, job.lease_seconds, job.args["backend"]) == (1, 30.0, "once")
    assert once.get_result(result.id).backend == "once"
    with pytest.raises(TaskResultDoesNotExist):  # results are per backend alias
        tasks.add.get_result(result.id)


def test_bad_task_options_are_refused_when_the_task_is_declared():
    for options in (
        {"max_attempts": 0},
        {"max_attempts": 2.5},
        {"max_attempts": True},
        {"lease_seconds": 0},
        {"lease_seconds": "60"},
        {"lease_seconds": math.inf},
        {"locks": "reports"},
        {"locks": ["ok", ""]},
        {"locks": [3]},
    ):
        with pytest.raises(InvalidTask):
            task(**options)(tasks.add.func)


@pytest.mark.django_db
def test_locks_computed_from_arguments_must_be_strings():
    bad = task(locks=lambda account, amount: account)(tasks.transfer.func)
    with pytest.raises(InvalidTask, match="locks"):
        bad.enqueue("acct", 1)
    assert not Job.objects.exists()
    # A locks() that raises (here: arguments it does not take) is refused the same way.
    with pytest.raises(InvalidTask, match=r"locks\(\) raised TypeError"):
        tasks.transfer.enqueue("acct", 1, memo="x")
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_arguments_must_be_json():
    with pytest.raises(InvalidTask, match="JSON"):
        tasks.add.enqueue(object(), 1)
    with pytest.raises(InvalidTask, match="JSON"):
        tasks.add.enqueue(math.nan, 1)
    with pytest.raises(InvalidTask, match="JSON"):
        tasks.add.enqueue(b"\xff", 1)
    assert not Job.objects.exists()
    # What JSON can carry is normalized, as Django's own backends do.
    result = tasks.add.enqueue((1, 2), b={"k": b"v"})
    assert (result.args, result.kwargs) == ([[1, 2]], {"b": {"k": "v"}})


# --- Django's contract -------------------------------------------------------------------


def test_the_backend_supports_every_feature():
    backend = task_backends["default"]
    assert isinstance(backend, HoldfastBackend)
    assert backend.supports_defer and backend.supports_priority
    assert backend.supports_get_result and backend.supports_async_task


@pytest.mark.django_db
def test_priority_must_be_within_djangos_bounds():
    with pytest.raises(InvalidTask, match="priority"):
        task(priority=101)(tasks.add.func)
    with pytest.raises(InvalidTask, match="priority"):
        tasks.add.using(priority=-101)
    with pytest.raises(InvalidTask, match="priority"):
        tasks.add.using(priority=1.5)
    for priority in (100, -100):
        result = tasks.add.using(priority=priority).enqueue(1, 1)
        assert Job.objects.get(pk=int(result.id)).priority == priority


@pytest.mark.django_db
def test_run_after_must_be_aware():
    with pytest.raises(InvalidTask, match="aware"):
        tasks.add.using(run_after=datetime(2030, 1, 1))
    with pytest.raises(TypeError, match="run_after"):
        task(run_after=timezone.now())(tasks.add.func)


@pytest.mark.django_db
def test_an_unknown_queue_is_refused(settings):
    with pytest.raises(InvalidTask, match="nope"):
        tasks.add.using(queue_name="nope")
    settings.HOLDFAST_LANES = {
        "default": {},
        "media": {},
        "photos": {"kinds": ["photo.*"]},
    }
    # Without QUEUES, every declared lane is a queue; the job runs in that lane.
    result = tasks.add.using(queue_name="media").enqueue(1, 1)
    assert Job.objects.get(pk=int(result.id)).lane == "media"
    assert tasks.add.get_result(result.id).task.queue_name == "media"
    with pytest.raises(InvalidTask, match="does not accept Django tasks"):
        tasks.add.using(queue_name="photos")
    # The "once" backend's QUEUES allows only "default".
    with pytest.raises(InvalidTask, match="media"):
        tasks.add.using(backend="once", queue_name="media")


@pytest.mark.django_db
def test_get_result_of_an_unknown_id_raises_task_result_does_not_exist():
    job = enqueueing.enqueue("test.echo", {"x": 1})
    for result_id in ("999999", "abc", "", "-1", "1e3", " 1", "9" * 40, str(job.pk)):
        with pytest.raises(TaskResultDoesNotExist):
            tasks.add.get_result(result_id)
    with pytest.raises(TaskResultDoesNotExist):
        async_to_sync(tasks.add.aget_result)("999999")


@pytest.mark.django_db
def test_get_result_of_another_tasks_id_raises_task_result_mismatch():
    result = tasks.explode.enqueue("x")
    with pytest.raises(TaskResultMismatch):
        tasks.add.get_result(result.id)
    assert tasks.explode.get_result(result.id).id == result.id


# --- system checks -----------------------------------------------------------------------


def backend(**params: Any) -> HoldfastBackend:
    return HoldfastBackend("broken", {"BACKEND": BACKEND, **params})


def messages(backend: HoldfastBackend) -> list[tuple[str, str]]:
    return [(message.id, message.msg) for message in backend.check()]


def test_the_system_check_reports_a_misconfigured_tasks_entry():
    assert messages(backend()) == []
    assert messages(backend(QUEUES=["default"], OPTIONS={"max_attempts": 2})) == []
    found = messages(
        backend(
            QUEUES=["default", "nope"],
            OPTIONS={"max_attempts": "3", "lease_seconds": 0, "retries": 2},
        )
    )
    assert [message_id for message_id, _ in found] == [
        "holdfast.E011",
        "holdfast.E012",
        "holdfast.E012",
        "holdfast.E012",
    ]
    text = "\n".join(message for _, message in found)
    assert "TASKS['broken']: QUEUES names 'nope', which is not a lane in HOLDFAST_LANES" in text
    assert "unknown option 'retries'" in text
    assert "max_attempts must be an integer from 1 to 1000000, not '3'" in text
    assert (
        "lease_seconds must be a number of seconds above 0 and at most 86400 (a day), not 0" in text
    )
    assert messages(backend(QUEUES="default")) == [
        ("holdfast.E011", "TASKS['broken']: QUEUES must be a list of lane names, not 'default'.")
    ]
    assert messages(backend(OPTIONS=None)) == [
        ("holdfast.E012", "TASKS['broken']: OPTIONS must be a dict, not NoneType.")
    ]


@pytest.fixture
def broken_tasks_setting(settings: Any) -> Iterator[None]:
    settings.TASKS = {
        "default": {"BACKEND": BACKEND, "QUEUES": ["bulk"], "OPTIONS": {"lease_seconds": -1}}
    }
    yield


@pytest.mark.django_db
def test_manage_py_check_runs_the_backend_check(broken_tasks_setting):
    found = {message.id for message in checks.run_checks() if message.id.startswith("holdfast")}
    assert found == {"holdfast.E011", "holdfast.E012"}


@pytest.mark.django_db
def test_the_project_settings_pass_the_check():
    assert [m for m in checks.run_checks() if m.id.startswith("holdfast")] == []


@pytest.mark.django_db
def test_enqueue_refuses_bad_options_clearly():
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="max_attempts must be an integer from 1"):
        backend(OPTIONS={"max_attempts": 0}).enqueue(tasks.add, [1, 1], {})
    assert not Job.objects.exists()
