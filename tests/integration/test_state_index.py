"""``job_state_idx`` holds every job but the succeeded ones (migration 0014_i16), and each
query that looks jobs up by state still finds it, on both databases.

SQLite uses a partial index only for a query that repeats one of its condition's terms
(``state = 'queued'``, or ``state = 'queued' OR state = 'running'``), never for
``state IN (…)``: a query written that way reads the whole table, ten million finished
rows included. The plans below are the ones the engine, ``queue_status``, the metrics, the
operators' commands and discovery run.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.db import connection
from django.db.models import QuerySet
from django.utils import timezone

from ingestion.discovery import active_jobs
from jobs import counts, enqueueing, operations
from jobs.models import Job, State
from ops.metrics import oldest_runnable

from .helpers import claim_one

pytestmark = pytest.mark.django_db

LOOKUPS: dict[str, Callable[[], QuerySet]] = {
    "queued and running per lane (queue_status, metrics)": counts.active,
    "a lane's queued jobs (max_queued at enqueue)": lambda: Job.objects.filter(
        lane="default", state=State.QUEUED
    ),
    "the oldest due job per lane": lambda: oldest_runnable(timezone.now()),
    "live leases": lambda: Job.objects.filter(state=State.RUNNING).order_by("lease_expires_at"),
    "dead jobs of a kind and lane (requeue_dead, dead-jobs/)": lambda: operations.dead_jobs(
        kind="test.noop", lane="default"
    ),
    "a source's discovery run, queued or running": lambda: active_jobs("docs"),
    "cancelled jobs (list_jobs --state cancelled)": lambda: Job.objects.filter(
        state=State.CANCELLED
    ).order_by("-pk"),
}


def plan(queryset: QuerySet) -> str:
    query, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("EXPLAIN QUERY PLAN " + query, params)
            return "\n".join(row[3] for row in cursor.fetchall())
        cursor.execute("SET enable_seqscan = off")  # as on a big table
        try:
            cursor.execute("EXPLAIN " + query, params)
            return "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("RESET enable_seqscan")


@pytest.mark.parametrize("name", LOOKUPS)
def test_each_lookup_by_state_goes_through_an_index(name: str) -> None:
    for _ in range(3):
        enqueueing.enqueue("test.echo")
        job = claim_one()
        Job.objects.filter(pk=job.id).update(state=State.SUCCEEDED)
    found = plan(LOOKUPS[name]())
    assert "SCAN jobs_job" not in found.replace("SCAN jobs_job USING", ""), found
    assert "Seq Scan on jobs_job " not in found, found
    assert any(index in found for index in ("job_state_idx", "job_runnable_idx")), found


def test_the_state_index_leaves_out_succeeded_jobs_only() -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("SELECT sql FROM sqlite_master WHERE name = 'job_state_idx'")
        else:
            cursor.execute(
                "SELECT pg_get_expr(indpred, indrelid) FROM pg_index"
                " WHERE indexrelid = 'job_state_idx'::regclass"
            )
        (definition,) = cursor.fetchone()
    kept = {state for state in State.values if f"'{state}'" in definition}
    assert kept == set(State.values) - {State.SUCCEEDED}, definition


@pytest.mark.parametrize("job_filter", ["", "AND id = %(job_id)s"])
def test_sqlite_reclaim_reads_the_running_rows_through_the_state_index(job_filter: str) -> None:
    if connection.vendor != "sqlite":
        pytest.skip("PostgreSQL's reclaim plan: tests/integration/test_claim_plan.py")
    from jobs.sql import SQLITE_EXPIRED, _sqlite_native

    query = _sqlite_native(SQLITE_EXPIRED.format(job_filter=job_filter))
    connection.ensure_connection()
    rows = connection.connection.execute("EXPLAIN QUERY PLAN " + query, {"limit": 1, "job_id": 1})
    found = "\n".join(row[3] for row in rows)
    assert "job_state_idx" in found or "INTEGER PRIMARY KEY" in found, found
