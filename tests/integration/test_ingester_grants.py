"""Least privilege: the ingester role gets exactly the ingestion tables it writes."""

import pytest
from django.db import connection

from ingestion.grants import grant_ingester

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

ROLE = "holdfast_ingester_test"


@pytest.fixture
def role():
    with connection.cursor() as cursor:
        cursor.execute(f"DROP ROLE IF EXISTS {ROLE}")
        cursor.execute(f"CREATE ROLE {ROLE}")
    yield ROLE
    with connection.cursor() as cursor:
        cursor.execute(f"DROP OWNED BY {ROLE}")
        cursor.execute(f"DROP ROLE {ROLE}")


def allowed(role: str, table: str, privilege: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT has_table_privilege(%s, %s, %s)", [role, table, privilege])
        return cursor.fetchone()[0]


def test_the_role_may_apply_submissions_and_nothing_else(role):
    grant_ingester(connection, role)
    for table in ("labs", "facts"):
        assert all(allowed(role, table, p) for p in ("SELECT", "INSERT", "UPDATE"))
        assert not allowed(role, table, "DELETE")
    assert allowed(role, "ingested_submissions", "INSERT")
    assert not allowed(role, "ingested_submissions", "UPDATE")
    assert allowed(role, "ingestion_reconciliationissue", "INSERT")
    for table in ("jobs_job", "jobs_lease", "ops_opstoken"):
        assert not allowed(role, table, "SELECT")
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT has_sequence_privilege(%s, pg_get_serial_sequence('facts', 'id'), 'USAGE')",
            [role],
        )
        assert cursor.fetchone()[0]


def test_a_missing_role_is_a_clear_error():
    with pytest.raises(RuntimeError, match="does not exist"):
        grant_ingester(connection, "no_such_role_anywhere")
