"""A job's options have one set of bounds (jobs.options) whichever way they are given:
``@handler(...)`` refuses at import, ``enqueue()`` with ``InvalidJob``, a task backend's
OPTIONS by a system check. Out of them, a value the engine cannot store would have made a
poison job: a lease past the database's timestamps (every claim fails, on every worker),
a backoff that raises (the worker dies), a result that is not strict JSON (ten retries of
the same failure)."""

from __future__ import annotations

import functools
import importlib
import math
import os
import subprocess
import sys
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from django.core import checks
from django.db import connection
from django.test import override_settings
from structlog.testing import capture_logs

from jobs import InvalidJob, RetryPolicy, enqueue, enqueue_many, handler
from jobs.context import JobContext
from jobs.models import Job, State
from jobs.options import MAX_LEASE_SECONDS
from jobs.tasks_backend import _options_problems
from tests.conftest import REPO

pytestmark = pytest.mark.django_db


@handler("opt.bad_backoff", max_attempts=3, backoff=lambda attempt: 1 / 0)
def bad_backoff(ctx: JobContext) -> None:
    raise RuntimeError("the job's own failure")


@handler("opt.nan_backoff", max_attempts=2, backoff=lambda attempt: math.nan)
def nan_backoff(ctx: JobContext) -> None:
    raise RuntimeError("fails")


@handler("opt.nan_result", max_attempts=5, backoff=0)
def nan_result(ctx: JobContext) -> float:
    return math.nan


BLOCK_RAN: list[int] = []


@handler("opt.inf_complete", max_attempts=5, backoff=0)
def inf_complete(ctx: JobContext) -> None:
    with ctx.atomic(complete=True, result={"ratio": math.inf}):
        BLOCK_RAN.append(ctx.job_id)


@handler("opt.nul_result", max_attempts=5, backoff=0)
def nul_result(ctx: JobContext) -> dict[str, str]:
    return {"text": "a\x00b"}


@handler("opt.surrogate_complete", max_attempts=5, backoff=0)
def surrogate_complete(ctx: JobContext) -> None:
    with ctx.atomic(complete=True, result={"name": "\udcff"}):
        BLOCK_RAN.append(ctx.job_id)


HANDLER_OPTIONS = [
    ({"max_attempts": 0}, "max_attempts"),
    ({"max_attempts": 2.5}, "max_attempts"),
    ({"max_attempts": True}, "max_attempts"),
    ({"max_attempts": 10**12}, "max_attempts"),
    ({"max_attempts": "5"}, "max_attempts"),
    ({"lease_seconds": math.inf}, "lease_seconds"),
    ({"lease_seconds": math.nan}, "lease_seconds"),
    ({"lease_seconds": 1e12}, "lease_seconds"),
    ({"lease_seconds": "x"}, "lease_seconds"),
    ({"lease_seconds": 0}, "lease_seconds"),
    ({"backoff": math.inf}, "backoff"),
    ({"backoff": math.nan}, "backoff"),
    ({"backoff": 1e300}, "backoff"),
    ({"backoff": -1}, "backoff"),
    ({"backoff": "soon"}, "backoff"),
    ({"backoff": RetryPolicy(base=-1)}, "RetryPolicy.base"),
    ({"backoff": RetryPolicy(cap=math.inf)}, "RetryPolicy.cap"),
    ({"backoff": RetryPolicy(jitter=2)}, "RetryPolicy.jitter"),
    ({"schedule": 0}, "schedule"),
    ({"schedule": -5}, "schedule"),
    ({"schedule": True}, "schedule"),
    ({"schedule": math.nan}, "schedule"),
    ({"lane": ""}, "lane"),
    ({"lane": 5}, "lane"),
    ({"locks": ["a"]}, "locks"),
    ({"unique": "yes"}, "unique must be True or False"),  # was taken as truthy
    ({"unique": 1}, "unique must be True or False"),
]


@pytest.mark.parametrize(
    ("given", "named"), HANDLER_OPTIONS, ids=[repr(g) for g, _ in HANDLER_OPTIONS]
)
def test_handler_refuses_options_the_engine_cannot_use_at_import(given: dict[str, Any], named: str):
    with pytest.raises(ValueError, match=f"handler 'opt.refused': {named}"):
        handler("opt.refused", **given)


@pytest.mark.parametrize("kind", ["", "x" * 201, "a\x1fb", "a\x00", "line\nbreak", 5])
def test_handler_refuses_a_kind_that_is_not_a_printable_name(kind: Any):
    with pytest.raises(ValueError, match="a job kind is a non-empty string of at most 200"):
        handler(kind)


async def _coroutine(ctx: JobContext) -> None:
    return None


async def _async_generator(ctx: JobContext) -> Any:
    yield None


def _generator(ctx: JobContext) -> Any:
    yield None


class _AsyncCallable:
    async def __call__(self, ctx: JobContext) -> None:
        return None


@functools.wraps(_coroutine)
def _wrapped_coroutine(ctx: JobContext) -> Any:
    return _coroutine(ctx)


def _no_ctx() -> None:
    return None


def _keywords_only(*, item: int = 0) -> None:
    return None


@pytest.mark.parametrize(
    ("func", "why"),
    [
        (_coroutine, "an async function cannot be a handler"),
        (_async_generator, "an async function cannot be a handler"),
        (_generator, "a generator function cannot be a handler"),
        ("not a function", "is not callable"),
        # Accepted before (helper-29 #5): each job dead, or every enqueue refused.
        (_AsyncCallable(), "an async function cannot be a handler"),
        (_wrapped_coroutine, "an async function cannot be a handler"),
        (_no_ctx, "takes the job's context as its first positional argument"),
        (_keywords_only, "takes the job's context as its first positional argument"),
    ],
)
def test_handler_refuses_what_the_worker_cannot_run(func: Any, why: str):
    """Each would make every job of its kind dead with "not JSON", its body never run."""
    with pytest.raises(ValueError, match=f"handler 'opt.shape': .*{why}"):
        handler("opt.shape")(func)


def test_handler_keeps_every_valid_form():
    handler("opt.valid", max_attempts=1_000_000, lease_seconds=MAX_LEASE_SECONDS, backoff=0)
    handler("opt.valid2", backoff=RetryPolicy(base=1, cap=60, jitter=0), schedule=0.5)
    handler("opt.valid3", backoff=lambda attempt: attempt, schedule="*/5 * * * *", lane="x")


ENQUEUE_OPTIONS = [
    ({"lease_seconds": 1e12}, "lease_seconds"),
    ({"lease_seconds": MAX_LEASE_SECONDS + 1}, "lease_seconds"),
    ({"delay": "5"}, "delay"),
    ({"delay": True}, "delay"),
    ({"delay": timedelta(days=-1)}, "delay"),
    ({"run_at": "2030-01-01T00:00:00Z"}, "run_at"),
    ({"lane": ""}, "lane"),
    ({"max_attempts": 10**7}, "max_attempts"),
]


@pytest.mark.parametrize(
    ("given", "named"), ENQUEUE_OPTIONS, ids=[repr(g) for g, _ in ENQUEUE_OPTIONS]
)
def test_enqueue_refuses_with_invalid_job_naming_the_option(given: dict[str, Any], named: str):
    with pytest.raises(InvalidJob, match=named):
        enqueue("test.echo", **given)
    assert not Job.objects.exists()


def test_unique_keys_as_one_string_is_refused_not_split_into_characters():
    with pytest.raises(InvalidJob, match="a list of keys"):
        enqueue_many("test.echo", [{}, {}], unique_keys="ab")
    assert not Job.objects.exists()


def test_the_longest_lease_is_stored_and_claimed(run_worker):
    job = enqueue("test.echo", lease_seconds=MAX_LEASE_SECONDS)
    assert run_worker() == 1
    job.refresh_from_db()
    assert job.state == State.SUCCEEDED


def test_a_backoff_that_raises_is_a_failed_attempt_not_a_dead_worker(run_worker):
    job = enqueue("opt.bad_backoff")
    with capture_logs() as logs:
        run_worker()
    job.refresh_from_db()
    assert job.state == State.QUEUED and job.attempts == 1  # retried on the default policy
    assert "RuntimeError: the job's own failure" in job.last_error
    assert 1 <= (job.run_at - datetime.now(job.run_at.tzinfo)).total_seconds() <= 6
    (failed,) = [entry for entry in logs if entry["event"] == "backoff_failed"]
    assert failed["error"] == "ZeroDivisionError: division by zero"


def test_a_backoff_of_nan_falls_back_to_the_default_policy(run_worker):
    job = enqueue("opt.nan_backoff")
    run_worker()
    job.refresh_from_db()
    assert job.state == State.QUEUED and job.attempts == 1
    # The default policy's first delay: 5 s less up to a quarter of jitter.
    assert 1 <= (job.run_at - datetime.now(job.run_at.tzinfo)).total_seconds() <= 6


@pytest.mark.parametrize("kind", ["opt.nan_result", "opt.inf_complete"])
def test_a_result_that_is_not_strict_json_is_dead_at_once_with_the_reason(run_worker, kind):
    job = enqueue(kind)
    run_worker()
    job.refresh_from_db()
    assert (job.state, job.attempts) == (State.DEAD, 1)
    assert "result is not JSON" in job.last_error
    assert BLOCK_RAN == []  # complete=True refused the result before its block ran


@pytest.mark.parametrize(
    ("kind", "problem"),
    [("opt.nul_result", "a NUL character"), ("opt.surrogate_complete", "an unpaired surrogate")],
)
def test_a_result_postgresql_cannot_store_is_dead_at_once_on_both_databases(
    run_worker, kind, problem
):
    """SQLite would keep a NUL or a lone surrogate that PostgreSQL refuses: the same
    handler must end the same way on both, with the reason, not a refused settle."""
    job = enqueue(kind)
    run_worker()
    job.refresh_from_db()
    assert (job.state, job.attempts) == (State.DEAD, 1)
    assert "result cannot be stored" in job.last_error and problem in job.last_error
    assert BLOCK_RAN == []


def test_task_options_have_the_same_bounds():
    assert any("max_attempts" in p for p in _options_problems({"max_attempts": 10**7}))
    assert any("lease_seconds" in p for p in _options_problems({"lease_seconds": 1e12}))
    assert _options_problems({"max_attempts": 5, "lease_seconds": 30}) == []


@override_settings(HOLDFAST_LEASE_SECONDS=30)
def test_the_default_lease_applies_when_none_is_given():
    job = enqueue("test.echo")
    assert job is not None and job.lease_seconds == 30
    with connection.cursor() as cursor:
        cursor.execute("SELECT lease_seconds FROM jobs_job WHERE id = %s", [job.pk])
        assert cursor.fetchone()[0] == 30


@pytest.mark.parametrize("lease", [0, 1e12, math.nan])
def test_the_check_refuses_a_default_lease_outside_the_bounds(lease):
    with override_settings(HOLDFAST_LEASE_SECONDS=lease):
        found = [m for m in checks.run_checks() if m.id == "holdfast.E003"]
    assert len(found) == 1 and "at most 86400" in found[0].msg


def test_the_settings_refuse_a_default_lease_outside_the_bounds_from_the_environment():
    done = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=REPO,
        env={**os.environ, "HOLDFAST_LEASE_SECONDS": "1e12"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "HOLDFAST_LEASE_SECONDS must be at most 86400" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_migration_gives_a_stored_poison_lease_a_day():
    """Jobs enqueued before the bound (``lease_seconds=1e12``): their lease becomes a day,
    and a running one's expiry (PostgreSQL had committed the year 33715) at most a day."""
    from django.apps import apps
    from django.db import connection as db
    from django.utils import timezone

    bound = importlib.import_module("jobs.migrations.0013_lease_bound")
    queued = enqueue("test.echo")
    running = enqueue("test.echo")
    assert queued is not None and running is not None
    Job.objects.filter(pk=queued.pk).update(lease_seconds=1e12)
    far = timezone.now() + timedelta(days=3650)
    Job.objects.filter(pk=running.pk).update(
        lease_seconds=1e12, state=State.RUNNING, lease_expires_at=far
    )
    bound.bound_leases(apps, SimpleNamespace(connection=db))  # it reads only the alias
    queued.refresh_from_db()
    running.refresh_from_db()
    assert queued.lease_seconds == running.lease_seconds == MAX_LEASE_SECONDS
    assert running.lease_expires_at <= timezone.now() + timedelta(days=1)


def by_hand_lease(stored: float) -> float:
    """``stored`` as a lease the database can hold (SQLite keeps neither NaN nor a float
    JSON cannot write back)."""
    if connection.vendor == "sqlite":
        if math.isnan(stored):
            pytest.skip("SQLite stores NaN as NULL, which the column refuses")
        if math.isinf(stored):
            return 1e308  # SQLite's largest finite float
    return stored


@pytest.mark.parametrize("stored", [1e12, math.inf, math.nan])
def test_a_lease_stored_past_the_bound_by_hand_is_claimed_and_renewed_for_a_day(
    stored: float,
):
    """A job row written around the engine (SQL by hand, a restore) with a lease no
    enqueue accepts: its claim and heartbeats take a day, as the engine never stores more,
    instead of failing every claim (SQLite: a TypeError; PostgreSQL: interval or timestamp
    out of range) or committing an expiry no reclaim reaches."""
    from django.utils import timezone

    from jobs import engine, sql

    job = enqueue("test.echo")
    assert job is not None
    Job.objects.filter(pk=job.pk).update(lease_seconds=by_hand_lease(stored))
    claimed = engine.claim("by-hand", None)
    assert claimed is not None and claimed.lease_seconds == MAX_LEASE_SECONDS
    horizon = timezone.now() + timedelta(seconds=MAX_LEASE_SECONDS + 60)
    assert claimed.lease_expires_at <= horizon
    assert sql.heartbeat(claimed) is False
    assert Job.objects.get(pk=job.pk).lease_expires_at <= horizon
    engine.complete(claimed, None)
    assert Job.objects.get(pk=job.pk).state == State.SUCCEEDED


@pytest.mark.parametrize("stored", [1e12, math.nan])
def test_one_job_with_such_a_lease_among_good_ones_holds_none_of_them_back(
    run_worker, stored: float
):
    """The poison row first in claim order, good jobs behind it: one worker runs them all
    and keeps running (before, its first claim failed on every try)."""
    poison = enqueue("test.echo", priority=5)
    good = [enqueue("test.echo") for _ in range(3)]
    assert poison is not None
    Job.objects.filter(pk=poison.pk).update(lease_seconds=by_hand_lease(stored))
    assert run_worker() == 4
    ids = [poison.pk, *(job.pk for job in good if job is not None)]
    assert set(Job.objects.filter(pk__in=ids).values_list("state", flat=True)) == {State.SUCCEEDED}
