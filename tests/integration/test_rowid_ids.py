"""The attempt record and its counter are keyed by a plain rowid on SQLite (issue 16).

``AUTOINCREMENT`` would write ``sqlite_sequence`` on every settle (the lease insert, and
the counter upsert even when it updates): one page more in each SQLite job's commit. On
PostgreSQL the same field is the identity column it always was.
"""

from __future__ import annotations

import pytest
from django.db import connection

from jobs import engine, enqueueing
from jobs.models import Lease, OutcomeCount

from .helpers import claim_one

pytestmark = pytest.mark.django_db

TABLES = ("jobs_lease", "jobs_outcomecount")


def sequences() -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT name, seq FROM sqlite_sequence")
        return dict(cursor.fetchall())


def test_settling_jobs_draws_no_sequence_for_attempt_rows():
    for _ in range(3):
        enqueueing.enqueue("test.echo")
    if connection.vendor == "sqlite":
        before = sequences()
    for _ in range(3):
        engine.complete(claim_one(), result=None)
    assert Lease.objects.count() == 3
    assert OutcomeCount.objects.get().count == 3
    if connection.vendor == "sqlite":
        changed = {name for name, seq in sequences().items() if before.get(name) != seq}
        assert not changed & set(TABLES), sequences()
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name IN (%s, %s)",
                TABLES,
            )
            for name, sql in cursor.fetchall():
                assert "AUTOINCREMENT" not in sql.upper(), name
    else:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT table_name, is_identity FROM information_schema.columns"
                " WHERE table_name IN (%s, %s) AND column_name = 'id'",
                TABLES,
            )
            assert dict(cursor.fetchall()) == dict.fromkeys(TABLES, "YES")
