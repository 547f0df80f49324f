"""Small builders shared by the integration tests: real rows, no mocks."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from jobs import engine
from jobs.models import Job
from jobs.sql import Claimed


def claim_one(worker_id: str = "w1", lanes: list[str] | None = None) -> Claimed:
    job = engine.claim(worker_id, lanes)
    assert job is not None, "expected a runnable job"
    return job


def expire_lease(job_id: int) -> None:
    """Move a running job's lease expiry into the past, as if its worker had vanished."""
    Job.objects.filter(pk=job_id).update(lease_expires_at=timezone.now() - timedelta(minutes=5))


def failure(message: str = "boom", permanent: bool = False) -> engine.Failure:
    return engine.Failure(
        error_class="RuntimeError",
        message=message,
        traceback="Traceback (most recent call last):\nRuntimeError: " + message,
        context={"job_id": 0},
        permanent=permanent,
    )


def query_plan(query: str) -> str:
    """The plan of ``query`` (as Django captured it, parameters inlined): SQLite's ``EXPLAIN
    QUERY PLAN`` lines, or PostgreSQL's ``EXPLAIN`` with sequential scans off, as on a
    table too big for them."""
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("EXPLAIN QUERY PLAN " + query.replace("%", "%%"))
            return "\n".join(row[3] for row in cursor.fetchall())
        cursor.execute("SET enable_seqscan = off")
        try:
            cursor.execute("EXPLAIN " + query.replace("%", "%%"))
            return "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("RESET enable_seqscan")


def index_condition(name: str) -> str | None:
    """The condition of the index ``name`` of the engine's tables (None: it has none)."""
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("SELECT sql FROM sqlite_master WHERE name = %s", [name])
            (definition,) = cursor.fetchone()
            return definition.partition(" WHERE ")[2] or None
        cursor.execute(
            "SELECT pg_get_expr(indpred, indrelid) FROM pg_index WHERE indexrelid = %s::regclass",
            [name],
        )
        return cursor.fetchone()[0]


def run(*args: str) -> str:
    """Run a management command in-process; return what it printed."""
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def run_json(*args: str) -> dict:
    return json.loads(run(*args, "--json"))


def exit_code(*args: str) -> int:
    """The exit code a failing command reports (its CommandError's returncode)."""
    with pytest.raises(CommandError) as raised:
        run(*args)
    return raised.value.returncode
