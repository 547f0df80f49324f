"""Deploys with running workers (PostgreSQL): a migration alters the engine's tables (or
builds and drops its indexes, CONCURRENTLY) under three busy workers, and prepared
statements become invalid under them. No worker exits, every job succeeds once, and no
attempt is charged or failed for it (DESIGN §2, issue 12).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from django.db import connection

from jobs import enqueueing
from tests.process.helpers import busy_fleet, drained_uncharged, job_summary, succeeded
from tests.support.workers import WorkerPool, wait_until

pytestmark = [pytest.mark.process, pytest.mark.postgres, pytest.mark.timeout(120)]

JOBS = 150  # room for both migrations to meet a busy fleet, on a slow machine too


@pytest.fixture
def restore_jobs_table(transactional_db: None) -> Iterator[None]:
    """Undo the test's ALTER TABLEs, so later tests see the migrated schema."""
    yield
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE jobs_job DROP COLUMN IF EXISTS deploy_note")
        cursor.execute("ALTER TABLE jobs_job ALTER COLUMN kind TYPE varchar(200)")


def test_alter_table_under_three_busy_workers_charges_no_attempt(
    workers: WorkerPool, restore_jobs_table: None
) -> None:
    # Both ways a job completes: settled by the worker's fused settle-and-claim statement
    # (test.sleep returns), and inside the handler's own transaction (test.effect's
    # ctx.atomic(complete=True)). Both run prepared statements.
    ids = [
        job.pk for job in enqueueing.enqueue_many("test.sleep", [{"seconds": 0.05}] * (JOBS // 2))
    ]
    ids += [
        job.pk for job in enqueueing.enqueue_many("test.effect", [{"sleep": 0.05}] * (JOBS // 2))
    ]
    procs = [workers.start(f"deploy-{n}") for n in range(3)]

    def describe() -> str:
        return f"{job_summary(ids)}\n{workers.describe()}"

    threshold = 10
    for statement in (
        "ALTER TABLE jobs_job ALTER COLUMN kind TYPE varchar(300)",  # changes the result type
        "ALTER TABLE jobs_job ADD COLUMN deploy_note text",
    ):
        wait_until(
            lambda t=threshold: succeeded() >= t,
            40,
            interval=0.05,
            message=lambda s=statement: f"no progress before {s}\n{describe()}",
        )
        assert succeeded() < JOBS - 10, "the queue drained before the migration: add jobs"
        with connection.cursor() as cursor:
            cursor.execute(statement)
        threshold = succeeded() + 5  # progress after it: the statements were re-planned

    wait_until(lambda: succeeded() == JOBS, 60, interval=0.1, message=describe)
    # The workers did meet the invalidated statements, and re-prepared.
    assert any(proc.events("prepared_statement_replanned") for proc in procs), describe()
    drained_uncharged(ids, procs, describe, "the migrations")


@pytest.fixture
def writable_again(transactional_db: None) -> Iterator[None]:
    yield
    with connection.cursor() as cursor:
        cursor.execute(f'ALTER DATABASE "{connection.settings_dict["NAME"]}" RESET ALL')


def terminate_other_sessions() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


def test_a_failover_under_busy_workers_charges_no_attempt(
    workers: WorkerPool, writable_again: None
) -> None:
    """What workers see in a failover: their sessions end (the old primary goes away),
    the next server refuses writes for a while (a standby not yet promoted, or a demoted
    primary: read-only transactions), then one accepts them (the new primary)."""
    # Leases (30 s) outlast the switch: an attempt charged here could only be the switch's.
    sleeps = enqueueing.enqueue_many("test.sleep", [{"seconds": 0.05}] * 30, lease_seconds=30)
    effects = enqueueing.enqueue_many("test.effect", [{"sleep": 0.05}] * 30, lease_seconds=30)
    ids = [job.pk for job in [*sleeps, *effects]]
    procs = [workers.start(f"failover-{n}") for n in range(3)]

    def describe() -> str:
        return f"{job_summary(ids)}\n{workers.describe()}"

    wait_until(lambda: succeeded() >= 10, 40, interval=0.05, message=describe)
    name = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        cursor.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
    terminate_other_sessions()
    wait_until(
        lambda: any(proc.events("database_unavailable") for proc in procs),
        20,
        interval=0.1,
        message=describe,
    )
    progress = succeeded()
    time.sleep(1.5)  # read-only: nothing can be claimed or completed
    assert succeeded() == progress, describe()
    with connection.cursor() as cursor:
        cursor.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
    terminate_other_sessions()

    drained_uncharged(ids, procs, describe, "the failover")


def job_indexes() -> dict[str, bool]:
    """jobs_job's indexes by name, each with whether it is valid (a CONCURRENTLY build
    that failed leaves an invalid one behind)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE i.indrelid = 'jobs_job'::regclass"
        )
        return dict(cursor.fetchall())


def test_index_migrations_under_three_busy_workers_charge_no_attempt(
    workers: WorkerPool, migrated_forward: None
) -> None:
    """``manage.py migrate`` of the engine's index migrations (0011: an index built and
    one dropped, both CONCURRENTLY; 0014: one redefined so; 0015: one dropped so; 0016:
    one built so), back and forth, while three workers drain a queue.
    A concurrent build waits out every transaction open when it starts: a worker holding
    one across handler code would hold up the deploy for as long as its handler ran.
    The queue holds about 25 s of work for three workers: on a loaded CI machine 600 jobs
    (10 s) drained before the migrations ended."""
    total = 1500
    ids, procs, describe = busy_fleet(workers, total, "index")
    for target, present, absent in (
        ("0010_i16_one_attempt_counter", "job_due_idx", "job_next_due_idx"),
        ("0011_i16_next_due_index", "job_next_due_idx", "job_due_idx"),
        # 0014 redefines job_state_idx under its own name, through job_state_idx_next
        # (0012 and 0013 run no SQL here).
        ("0014_i16_state_index", "job_state_idx", "job_state_idx_next"),
        # 0015 drops job_next_due_idx (CONCURRENTLY); its way back built it again above.
        ("0015_i16_next_due_by_runnable", "job_runnable_idx", "job_next_due_idx"),
        # 0016 builds job_ended_badly_idx (CONCURRENTLY).
        ("0016_dead_listing_index", "job_ended_badly_idx", "job_next_due_idx"),
    ):
        before = succeeded()
        result = workers.command("migrate", "jobs", target, timeout=60)
        assert result.returncode == 0, result.describe()
        indexes = job_indexes()
        assert indexes.get(present) is True and absent not in indexes, indexes
        assert succeeded() > before, f"no job ran during the migration\n{describe()}"
    assert succeeded() < total, "the queue drained before the migrations ended: add jobs"

    drained_uncharged(ids, procs, describe, "the index migrations")
