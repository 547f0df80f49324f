"""Django's Tasks framework on Holdfast: ``TASKS = {"default": {"BACKEND": ...}}``.

Every Django task becomes a job of one kind, ``django.task``, whose args name the task
and carry its arguments; the job's lane is the task's ``queue_name``, its priority the
task's priority and its ``run_at`` the task's ``run_after``. The worker runs it with the
handler below, so tasks get what every job gets: a lease, retries with backoff, ``dead``
when the attempts are spent, and recovery when a worker dies (docs/django-tasks.md).

A task's ``TaskResult`` is read back from the job and its attempts (``jobs.attempts``):
``queued`` → READY, ``running`` → RUNNING, ``succeeded`` → SUCCESSFUL, ``dead`` and
``cancelled`` → FAILED.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from traceback import format_exception
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, transaction
from django.tasks import Task, TaskContext, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import TaskError
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.json import normalize_json
from django.utils.module_loading import import_string

from . import lanes as lane_config
from . import options
from .exceptions import Cancelled, InvalidJob, LaneFull, LaneRefused, PermanentError, UnknownKind
from .registry import TASK_KIND, handler

if TYPE_CHECKING:
    from .context import JobContext
    from .models import Job, Lease

KIND = TASK_KIND

# The backend's OPTIONS: defaults for every task it enqueues (a task's own @task(...)
# options win).
OPTION_NAMES = ("max_attempts", "lease_seconds")

LocksOption = Sequence[str] | Callable[..., Iterable[str]] | None

# A job's primary key as this backend writes it (no leading zero: "026" is no result's id);
# longer would overflow bigint.
_RESULT_ID = re.compile(r"[1-9][0-9]{0,17}")


class InvalidTaskArguments(InvalidTask, InvalidJob, TypeError):
    """Task arguments that JSON cannot carry. A ``TypeError``, as Django's own backends
    raise for them, and also Django's ``InvalidTask`` and Holdfast's ``InvalidJob``."""


class LeaseExpired(Exception):
    """An attempt whose worker stopped renewing its lease (killed, frozen, or cut off from
    the database); the attempt was reclaimed. Never raised: it names such attempts in
    ``TaskResult.errors``, whose traceback is then the engine's one-line account."""


# --- options -----------------------------------------------------------------------------


def _locks_problem(locks: Any) -> str | None:
    if locks is None or callable(locks):
        return None
    if isinstance(locks, str) or not isinstance(locks, Sequence):
        return f"locks must be a list of strings or a callable returning one, not {locks!r}"
    bad = [lock for lock in locks if not isinstance(lock, str) or not lock]
    if bad:
        return f"locks must be non-empty strings, not {bad[0]!r}"
    return None


def _options_problems(given: Any) -> list[str]:
    """What is wrong with a backend's OPTIONS (empty when nothing is)."""
    if not isinstance(given, Mapping):
        return [f"OPTIONS must be a dict, not {type(given).__name__}"]
    problems = [
        f"unknown option {name!r} (known: {', '.join(OPTION_NAMES)})"
        for name in given
        if name not in OPTION_NAMES
    ]
    if "max_attempts" in given:
        problems.append(options.max_attempts_problem(given["max_attempts"]) or "")
    if "lease_seconds" in given:
        problems.append(options.lease_seconds_problem(given["lease_seconds"]) or "")
    return [problem for problem in problems if problem]


# --- the task class ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class HoldfastTask(Task):
    """A Django ``Task`` with Holdfast's options, given as ``@task(...)`` keywords.

    ``max_attempts`` and ``lease_seconds`` default to the backend's OPTIONS, then to
    Holdfast's defaults (10 attempts; ``HOLDFAST_LEASE_SECONDS``). ``locks`` is a list of
    resource names, or a callable that receives the task's arguments and returns one; it
    is enforced by Holdfast's resource locks: the job runs only while it holds them all.
    """

    max_attempts: int | None = None
    lease_seconds: float | None = None
    locks: LocksOption = None

    def __post_init__(self) -> None:
        if isinstance(self.locks, list):  # hashable, like the rest of a frozen Task
            object.__setattr__(self, "locks", tuple(self.locks))
        Task.__post_init__(self)  # the backend validates the task


# --- the backend -------------------------------------------------------------------------


class HoldfastBackend(BaseTaskBackend):
    """Enqueue Django tasks as Holdfast jobs; read their results back from the jobs.

    ``QUEUES`` lists the lanes tasks may use; without it every declared lane is a queue.
    ``OPTIONS`` holds defaults for ``max_attempts`` and ``lease_seconds``.
    """

    task_class = HoldfastTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.params = params
        if "QUEUES" not in params:
            self.queues = set()  # any declared lane; validate_task checks HOLDFAST_LANES

    # --- validation --------------------------------------------------------------------

    def validate_task(self, task: Task[Any, Any]) -> None:
        super().validate_task(task)
        declared = lane_config.lanes()
        lane = declared.get(task.queue_name)
        if lane is None:
            raise InvalidTask(
                f"Queue '{task.queue_name}' is not a Holdfast lane "
                f"(HOLDFAST_LANES declares: {', '.join(sorted(declared))})."
            )
        if not lane.accepts(KIND):
            raise InvalidTask(
                f"Lane '{task.queue_name}' does not accept Django tasks: its kinds do not "
                f"match {KIND!r}."
            )
        max_attempts = getattr(task, "max_attempts", None)
        lease_seconds = getattr(task, "lease_seconds", None)
        for problem in (
            None if max_attempts is None else options.max_attempts_problem(max_attempts),
            None if lease_seconds is None else options.lease_seconds_problem(lease_seconds),
            _locks_problem(getattr(task, "locks", None)),
        ):
            if problem:
                raise InvalidTask(f"Task {task.module_path}: {problem}.")

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        """System checks (``manage.py check``) of this TASKS entry."""
        where = f"TASKS[{self.alias!r}]"
        errors: list[checks.CheckMessage] = []
        if not apps.is_installed("jobs"):
            errors.append(
                checks.Error(
                    f"{where} uses {type(self).__name__}, but 'jobs' is not in INSTALLED_APPS.",
                    hint="Add 'jobs' to INSTALLED_APPS and run manage.py migrate.",
                    obj=where,
                    id="holdfast.E010",
                )
            )
        errors.extend(
            checks.Error(f"{where}: {problem}.", obj=where, id="holdfast.E011")
            for problem in self._queues_problems()
        )
        errors.extend(
            checks.Error(f"{where}: {problem}.", obj=where, id="holdfast.E012")
            for problem in _options_problems(self.options)
        )
        return errors

    def _queues_problems(self) -> list[str]:
        if "QUEUES" not in self.params:
            return []
        queues = self.params["QUEUES"]
        if isinstance(queues, str) or not isinstance(queues, Iterable):
            return [f"QUEUES must be a list of lane names, not {queues!r}"]
        try:
            declared = lane_config.lanes()
        except (ValueError, TypeError):
            return []  # HOLDFAST_LANES itself is broken: holdfast.E001 says how
        problems = []
        for name in queues:
            lane = declared.get(name) if isinstance(name, str) else None
            if lane is None:
                problems.append(
                    f"QUEUES names {name!r}, which is not a lane in HOLDFAST_LANES "
                    f"(declared: {', '.join(sorted(declared))})"
                )
            elif not lane.accepts(KIND):
                problems.append(f"QUEUES names lane {name!r}, whose kinds do not accept {KIND!r}")
        return problems

    def _defaults(self) -> Mapping[str, Any]:
        problems = _options_problems(self.options)
        if problems:
            raise ImproperlyConfigured(f"TASKS[{self.alias!r}]: {'; '.join(problems)}.")
        return self.options

    # --- enqueue -----------------------------------------------------------------------

    def enqueue(
        self, task: Task[Any, Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> TaskResult[Any, Any]:
        """Write the task's job in the caller's transaction; it exists iff that commits."""
        from . import enqueueing  # imports the models: not before the app registry is ready

        self.validate_task(task)
        defaults = self._defaults()
        try:
            payload: dict[str, Any] = {
                "task": task.module_path,
                "args": normalize_json(args),
                "kwargs": normalize_json(kwargs),
                "backend": self.alias,
                "takes_context": task.takes_context,
                "run_after": task.run_after.isoformat() if task.run_after else None,
            }
            enqueueing.ARGS_ENCODER.encode([payload["args"], payload["kwargs"]])  # NaN, Infinity
        except (TypeError, ValueError) as exc:
            raise InvalidTaskArguments(
                f"Task {task.module_path}: arguments must be JSON-serializable ({exc})."
            ) from None
        locks = _locks_for(task, args, kwargs)
        if locks is not None:
            payload["locks"] = locks
        try:
            job = enqueueing.enqueue(
                KIND,
                payload,
                lane=task.queue_name,
                priority=int(task.priority),
                run_at=task.run_after,
                max_attempts=getattr(task, "max_attempts", None) or defaults.get("max_attempts"),
                lease_seconds=getattr(task, "lease_seconds", None) or defaults.get("lease_seconds"),
            )
        except InvalidJob as exc:
            raise InvalidTask(f"Task {task.module_path}: {exc}.") from None
        except LaneRefused as exc:
            raise InvalidTask(f"Queue '{task.queue_name}' is not valid: {exc}.") from None
        if job is None:
            raise LaneFull(
                f"lane {task.queue_name!r} is full and drops new jobs (on_full='drop'): "
                f"task {task.module_path} was not enqueued"
            )
        result: TaskResult[Any, Any] = TaskResult(
            task=task,
            id=str(job.pk),
            status=TaskResultStatus.READY,
            enqueued_at=job.created_at,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=payload["args"],
            kwargs=payload["kwargs"],
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        # The task is enqueued when the caller commits; a rollback enqueued nothing.
        transaction.on_commit(
            partial(task_enqueued.send, type(self), task_result=result), robust=True
        )
        return result

    # --- results -----------------------------------------------------------------------

    def get_result(self, result_id: str) -> TaskResult[Any, Any]:
        """The task's result, built from its job and attempts.

        TaskResultDoesNotExist for an id that is not a Django task's job enqueued through
        this backend alias (results are per alias, as in Django's other stores).
        """
        from .models import Job

        text = str(result_id)
        if not _RESULT_ID.fullmatch(text):
            raise TaskResultDoesNotExist(result_id)
        job = Job.objects.filter(pk=int(text), kind=KIND).first()
        if job is None or not isinstance(job.args, dict) or job.args.get("backend") != self.alias:
            raise TaskResultDoesNotExist(result_id)
        from .attempts import leases

        return task_result(job, leases(job))


def _locks_for(
    task: Task[Any, Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> list[str] | None:
    locks = getattr(task, "locks", None)
    if locks is None:
        return None
    if callable(locks):
        try:
            locks = locks(*args, **kwargs)
        except Exception as exc:  # e.g. arguments its signature does not take
            raise InvalidTask(
                f"Task {task.module_path}: locks() raised {type(exc).__name__}: {exc}"
            ) from exc
        if isinstance(locks, str) or not isinstance(locks, Iterable):
            raise InvalidTask(f"Task {task.module_path}: locks() must return a list of strings.")
        locks = list(locks)
        problem = _locks_problem(locks)
        if problem:
            raise InvalidTask(f"Task {task.module_path}: {problem}.")
    return list(locks)


# --- results from jobs -------------------------------------------------------------------

_STATUS = {
    "queued": TaskResultStatus.READY,
    "running": TaskResultStatus.RUNNING,
    "succeeded": TaskResultStatus.SUCCESSFUL,
    "dead": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
}


def task_result(job: Job, leases: Sequence[Lease]) -> TaskResult[Any, Any]:
    """The ``TaskResult`` of a ``django.task`` job and its attempts (leases, in order).

    Attempts a graceful shutdown gave back (``released``) are not charged and do not
    appear. Each charged attempt adds its worker to ``worker_ids`` (so ``attempts`` is the
    job's attempt count), and each failed or reclaimed one adds a ``TaskError``.
    """
    from .models import Outcome, State

    charged = [lease for lease in leases if lease.outcome != Outcome.RELEASED]
    errors = [
        TaskError(
            exception_class_path=_exception_class_path(lease.error_class),
            traceback=lease.traceback or lease.error_message,
        )
        for lease in charged
        if lease.outcome in (Outcome.FAILED, Outcome.LEASE_EXPIRED)
    ]
    if job.state == State.CANCELLED:
        errors.append(
            TaskError(
                exception_class_path=f"{Cancelled.__module__}.{Cancelled.__qualname__}",
                traceback=job.last_error or "cancelled",
            )
        )
    status = _STATUS[job.state]
    finished = status in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED)
    payload = job.args
    result: TaskResult[Any, Any] = TaskResult(
        task=_task_of(payload, job),
        id=str(job.pk),
        status=status,
        enqueued_at=job.created_at,
        started_at=charged[0].acquired_at if charged else None,
        finished_at=job.finished_at if finished else None,
        last_attempted_at=charged[-1].acquired_at if charged else None,
        args=payload.get("args", []),
        kwargs=payload.get("kwargs", {}),
        backend=payload.get("backend", ""),
        errors=errors,
        worker_ids=[lease.worker_id for lease in charged],
    )
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", job.result)
    return result


def _task_of(payload: Mapping[str, Any], job: Job) -> Task[Any, Any]:
    """The Task as it was enqueued: the module's task with the job's queue and priority."""
    path = payload.get("task")
    if not isinstance(path, str):
        raise InvalidTask(f"Job {job.pk} is not a Django task: its args name no task.")
    task = import_string(path)  # ImportError: not deployed here (yet)
    if not isinstance(task, Task):
        raise InvalidTask(f"{path!r} is not a Django task (decorate it with @task).")
    run_after = payload.get("run_after")
    return task.using(
        priority=job.priority,
        queue_name=job.lane,
        backend=payload.get("backend") or task.backend,
        run_after=parse_datetime(run_after) if isinstance(run_after, str) else None,
    )


def _exception_class_path(error_class: str) -> str:
    """An importable path for an attempt's recorded error class.

    The engine records builtins by bare name ("ValueError") and a reclaimed attempt as
    "LeaseExpired"; Django wants a dotted path that ``import_string`` resolves.
    """
    if error_class == "LeaseExpired":
        return f"{LeaseExpired.__module__}.{LeaseExpired.__qualname__}"
    if not error_class:
        return "builtins.Exception"
    if "." not in error_class:
        return f"builtins.{error_class}"
    return error_class


# --- running tasks -----------------------------------------------------------------------


def _declared_locks(args: dict[str, Any]) -> list[str]:
    """The resource locks a task's job declares; the engine holds them while it runs."""
    return list(args.get("locks") or [])


@handler(KIND, locks=_declared_locks)
def run_task(ctx: JobContext, **payload: Any) -> Any:
    """Run one Django task: Holdfast's job handler for every ``django.task`` job.

    Sends ``task_started`` at the start of every attempt and ``task_finished`` once the
    task has finished for good: after its success has committed, or when it fails with
    no attempt left (or a PermanentError). An attempt that will be retried sends none.
    """
    from .attempts import leases as attempts_of
    from .models import Job
    from .worker import refuse_transaction_left_open

    job = Job.objects.filter(pk=ctx.job_id).first()
    leases = [] if job is None else attempts_of(job)
    if job is None or not leases:
        raise PermanentError(f"job {ctx.job_id} has no attempt record")
    try:
        result = task_result(job, leases)  # RUNNING, this attempt included
    except InvalidTask as exc:
        raise PermanentError(str(exc)) from None
    task = result.task
    sender = type(task.get_backend())
    task_started.send_robust(sender, task_result=result)
    try:
        if task.takes_context:
            raw = task.call(TaskContext(task_result=result), *result.args, **result.kwargs)
        else:
            raw = task.call(*result.args, **result.kwargs)
        value = _json_result(raw)
        # A task that returned inside a transaction: completing in it would never commit
        # (PostgreSQL) or commit its half-done work (SQLite). The attempt fails here, where
        # its signals are sent; it sent SUCCESSFUL for an attempt that then failed.
        refuse_transaction_left_open()
    except BaseException as exc:
        # SystemExit and KeyboardInterrupt too (Django's backends record them as failures):
        # the worker's own shutdown never raises into a task, so whatever arrives here is
        # the task's. Recorded with its own class; the worker records the attempt likewise.
        result.errors.append(
            TaskError(
                exception_class_path=f"{type(exc).__module__}.{type(exc).__qualname__}",
                traceback="".join(format_exception(exc)),
            )
        )
        if _final_failure(exc, ctx):
            _finish(result, TaskResultStatus.FAILED)
            task_finished.send_robust(sender, task_result=result)  # exc_info is set here
        raise
    # Success commits first (fenced: LeaseLost if another attempt owns the job now), so
    # a task_finished receiver that reads the result back sees it SUCCESSFUL.
    with ctx.atomic(complete=True, result=value):
        pass
    object.__setattr__(result, "_return_value", value)
    _finish(result, TaskResultStatus.SUCCESSFUL)
    task_finished.send_robust(sender, task_result=result)
    return value


def _final_failure(exc: BaseException, ctx: JobContext) -> bool:
    """Whether this attempt's failure ends the task: a permanent error, or the last
    attempt failing. A database fault (a restart, a failover; ``sql.fault``) is neither:
    the worker gives the job back uncharged and it runs again."""
    from . import sql  # imports the models: not at this module's import (holdfast.E010)

    if isinstance(exc, DatabaseError) and sql.fault(exc) is not None:
        return False
    return ctx.attempt >= ctx.max_attempts or isinstance(
        exc, PermanentError | UnknownKind | Cancelled
    )


def _json_result(raw: Any) -> Any:
    """The task's return value as the job's result; PermanentError (inside the handled
    block, so ``task_finished`` is sent) for one that is not JSON or that the database
    cannot store (a NUL character, an unpaired surrogate: ``check_result``)."""
    from .context import check_result
    from .enqueueing import ARGS_ENCODER

    try:
        value = normalize_json(raw)
        ARGS_ENCODER.encode(value)  # strict: no NaN or Infinity either
    except (TypeError, ValueError) as exc:
        raise PermanentError(f"the task returned a value that is not JSON: {exc}") from None
    check_result(value)
    return value


def _finish(result: TaskResult[Any, Any], status: TaskResultStatus) -> None:
    object.__setattr__(result, "status", status)
    object.__setattr__(result, "finished_at", timezone.now())
