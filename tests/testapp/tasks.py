"""Ordinary Django tasks (``django.tasks.task``), as an application would write them.

They run on Holdfast through the ``TASKS`` setting in tests/settings.py; the worker
imports this module by the path stored on each task's job.
"""

import asyncio
import os
import sys
import time
from typing import Any

from django.tasks import TaskContext, task

from jobs import PermanentError


@task
def add(a: int, b: int) -> int:
    return a + b


@task
async def greet(name: str) -> str:
    await asyncio.sleep(0)
    return f"hello {name}"


@task(takes_context=True)
def describe(context: TaskContext, label: str) -> dict[str, Any]:
    """Returns what its TaskContext says about this attempt."""
    result = context.task_result
    return {
        "label": label,
        "attempt": context.attempt,
        "id": result.id,
        "status": result.status,
        "worker_ids": result.worker_ids,
    }


@task(takes_context=True)
async def describe_async(context: TaskContext, label: str) -> dict[str, Any]:
    await asyncio.sleep(0)
    return {"label": label, "attempt": context.attempt}


@task(max_attempts=1)
def explode(message: str) -> None:
    raise ValueError(message)


@task
def refuse() -> None:
    raise PermanentError("retrying cannot help")


@task(takes_context=True, max_attempts=3)
def flaky(context: TaskContext, fail_until: int) -> int:
    """Fails its first attempts, then returns the attempt that succeeded."""
    if context.attempt < fail_until:
        raise ConnectionError(f"transient failure on attempt {context.attempt}")
    return context.attempt


@task
def shapes() -> dict[str, Any]:
    """Returns values JSON has no literal for; they come back normalized, as Django does."""
    return {"pair": (1, 2), "raw": b"bytes", "none": None, "nested": [{"x": 1.5}]}


@task
def nothing() -> None:
    return None


@task
def not_json() -> object:
    return object()


@task
def unstorable() -> dict[str, str]:
    return {"text": "a\x00b"}  # JSON, but no database column holds a NUL


@task(max_attempts=4, lease_seconds=7.5, locks=["reports"])
def with_options(day: str) -> str:
    return day


@task(locks=lambda account, amount: [f"account:{account}"])
def transfer(account: int, amount: int) -> int:
    return amount


@task(takes_context=True, lease_seconds=2, max_attempts=5)
def sleep_on_first_attempt(context: TaskContext, marker: str, seconds: float) -> dict[str, Any]:
    """Writes ``marker`` and sleeps on its first attempt (kill the worker there)."""
    if context.attempt == 1:
        with open(marker, "w") as handle:
            handle.write(str(os.getpid()))
        time.sleep(seconds)
    return {"attempt": context.attempt, "worker_ids": context.task_result.worker_ids}


class ReportMissing(LookupError):
    """An application's own exception class: a failed task records it, not a wrapper."""


@task(max_attempts=1)
def missing_report(day: str) -> None:
    raise ReportMissing(f"no report for {day}")


@task(max_attempts=1)
def exits(code: int) -> None:
    sys.exit(code)


@task(max_attempts=1)
def interrupts() -> None:
    raise KeyboardInterrupt("the task pressed Ctrl-C")


@task(max_attempts=1)
def loses_its_database() -> None:
    """Meets a database fault (the server went away): not the task's failure."""
    import psycopg
    from django.db import OperationalError

    lost = psycopg.OperationalError("server closed the connection unexpectedly")
    raise OperationalError(str(lost)) from lost


@task(max_attempts=2)
def leaves_a_transaction_open(label: str) -> str:
    """Returns with autocommit off and a write pending: its transaction is never closed."""
    from django.db import transaction

    from tests.testapp.models import Effect

    transaction.set_autocommit(False)
    Effect.objects.create(job_id=0, attempt=0, lease_token=0, label=label)
    return "looks fine"
