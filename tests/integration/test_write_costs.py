"""What a job costs in row writes (issue 16), counted by PostgreSQL itself.

``pg_stat_get_xact_*`` count the rows the current transaction (the test's) inserted,
updated (HOT or not) and deleted per table, so each figure is exact and machine-free.
"""

from __future__ import annotations

import pytest
from django.db import connection

from jobs import engine, enqueueing
from jobs.events import events
from jobs.models import Job

from .helpers import claim_one

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]

TABLES = ("jobs_job", "jobs_lease", "jobs_jobevent", "jobs_outcomecount", "jobs_jobcount")


def writes() -> dict[str, tuple[int, int, int, int]]:
    """Per table: (inserted, updated, HOT-updated, deleted) rows in this transaction."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, pg_stat_get_xact_tuples_inserted(oid),"
            " pg_stat_get_xact_tuples_updated(oid), pg_stat_get_xact_tuples_hot_updated(oid),"
            " pg_stat_get_xact_tuples_deleted(oid)"
            " FROM pg_class WHERE relname = ANY(%s)",
            [list(TABLES)],
        )
        return {name: tuple(counts) for name, *counts in cursor.fetchall()}


def delta(before: dict, after: dict) -> dict[str, tuple[int, ...]]:
    changed = {t: tuple(a - b for a, b in zip(after[t], before[t], strict=True)) for t in TABLES}
    return {t: d for t, d in changed.items() if any(d)}


def test_a_job_costs_four_row_writes():
    """Claim and settle of a job: the job row twice, its lease row once (inserted by the
    settle, complete) and one counter upsert; the attempt's events are its lease row."""
    enqueueing.enqueue("test.echo")
    before = writes()
    engine.complete(claim_one(), result=None)
    spent = delta(before, writes())
    rows = {table: i + u + d for table, (i, u, _, d) in spent.items()}
    assert rows == {"jobs_job": 2, "jobs_lease": 1, "jobs_outcomecount": 1}, spent
    assert spent["jobs_job"][0] == 0 and spent["jobs_lease"][:2] == (1, 0), spent
    assert [e.event for e in events(Job.objects.get().pk)] == ["claimed", "settled"]


def test_a_heartbeat_is_a_hot_update_of_the_job_row_alone():
    """No index holds lease_expires_at or heartbeat_at (and pages keep room): renewing a
    lease adds no index entry to jobs_job, and writes no lease row."""
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    before = writes()
    for _ in range(5):
        engine.heartbeat(claimed)
    spent = delta(before, writes())
    assert spent == {"jobs_job": (0, 5, 5, 0)}, spent
    assert [e.event for e in events(claimed.id)] == ["claimed"]
