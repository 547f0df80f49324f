"""The engine's session settings (``jobs.sql.configure_session``): on a connection of its
own, no JIT and generic plans for the prepared hot path; behind a pooler (prepared
statements off) nothing set on the session, and a worker says when JIT is on."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import override_settings
from structlog.testing import capture_logs

from jobs import workers

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def show(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SHOW {name}")
        return str(cursor.fetchone()[0])


def server_default(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT reset_val FROM pg_settings WHERE name = %s", [name])
        return str(cursor.fetchone()[0])


def test_a_direct_connection_compiles_nothing_and_keeps_generic_plans() -> None:
    connection.close()  # a fresh connection: connection_created runs
    assert show("jit") == "off"
    assert show("plan_cache_mode") == "force_generic_plan"


def warned() -> bool:
    with capture_logs() as logs:
        workers.register_worker("jit-w", None)
    return any(entry["event"] == "jit_enabled" for entry in logs)


def test_behind_a_pooler_the_session_is_left_as_the_server_has_it() -> None:
    with override_settings(HOLDFAST_PREPARED_STATEMENTS=False):
        connection.close()
        try:
            assert show("plan_cache_mode") == server_default("plan_cache_mode")
            assert show("jit") == server_default("jit")
            with connection.cursor() as cursor:
                cursor.execute("SET jit TO on")  # as a role without ALTER ROLE … jit = off
            assert warned()
            with connection.cursor() as cursor:
                cursor.execute("SET jit TO off")  # as after ALTER ROLE … SET jit = off
            assert not warned()
        finally:
            connection.close()


def reltuples() -> float:
    with connection.cursor() as cursor:
        cursor.execute("SELECT reltuples FROM pg_class WHERE oid = 'jobs_job'::regclass")
        return float(cursor.fetchone()[0])


def test_a_starting_worker_analyzes_a_jobs_table_the_server_never_analyzed() -> None:
    # Without statistics the claim's update walked every queued row (job_due_idx).
    from jobs import enqueueing

    enqueueing.enqueue_many("test.noop", [{}] * 50)
    with connection.cursor() as cursor:  # as a new install: never analyzed nor vacuumed
        cursor.execute("UPDATE pg_class SET reltuples = -1 WHERE oid = 'jobs_job'::regclass")
    assert reltuples() < 0
    with capture_logs() as logs:
        workers.register_worker("analyze-w", None)
    assert reltuples() >= 50
    assert any(entry["event"] == "jobs_table_analyzed" for entry in logs)
    with capture_logs() as logs:  # analyzed once: the next worker leaves it to autovacuum
        workers.register_worker("analyze-w2", None)
    assert not any(entry["event"] == "jobs_table_analyzed" for entry in logs)
