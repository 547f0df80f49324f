"""``jobs.0012_i16_rowid_ids`` under three busy workers (issue 16).

On SQLite the migration rebuilds ``jobs_lease`` and ``jobs_outcomecount`` (a copy of
their rows under the write lock) to drop ``AUTOINCREMENT``; backwards it rebuilds them
with it. Workers wait on their busy timeout meanwhile, or back off and retry: none exits,
every job succeeds on its one charged attempt, and each attempt keeps its record. On
PostgreSQL the migration runs no SQL, and the same checks hold.
"""

from __future__ import annotations

import pytest
from django.db import connection

from jobs.models import OutcomeCount
from tests.process.helpers import busy_fleet, drained_uncharged, succeeded
from tests.support.workers import WorkerPool, wait_until

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


def autoincrement() -> bool | None:
    """Whether jobs_lease's id is AUTOINCREMENT (SQLite; None on PostgreSQL)."""
    if connection.vendor != "sqlite":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT sql FROM sqlite_master WHERE name = 'jobs_lease'")
        return "AUTOINCREMENT" in cursor.fetchone()[0].upper()


def test_rowid_migration_back_and_forth_under_three_busy_workers_charges_no_attempt(
    workers: WorkerPool, migrated_forward: None
) -> None:
    total = 450
    ids, procs, describe = busy_fleet(workers, total, "rowid")
    sqlite = connection.vendor == "sqlite"
    for target, with_autoincrement in (
        ("0011_i16_next_due_index", True),
        ("0012_i16_rowid_ids", False),
    ):
        before = succeeded()
        result = workers.command("migrate", "jobs", target, timeout=60)
        assert result.returncode == 0, result.describe()
        assert autoincrement() == (with_autoincrement if sqlite else None)
        wait_until(
            lambda before=before: succeeded() > before,
            20,
            interval=0.05,
            message=lambda target=target: f"no job ran after migrating to {target}\n{describe()}",
        )
    assert succeeded() < total, "the queue drained before the migrations ended: add jobs"

    drained_uncharged(ids, procs, describe, "the rowid migration")
    counted = sum(OutcomeCount.objects.filter(outcome="succeeded").values_list("count", flat=True))
    assert counted == total, f"attempt counters: {counted} succeeded of {total}"
