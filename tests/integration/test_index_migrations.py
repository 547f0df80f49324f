"""The engine's index migrations (jobs.indexes): back and forth on both databases, and on
PostgreSQL a concurrent build that failed is repaired by running the migration again."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.management import call_command
from django.db import IntegrityError, connection

from jobs import enqueueing

from .helpers import index_condition

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE_INDEXES = "0005_i15_job_counts"


@pytest.fixture
def migrated_forward() -> Iterator[None]:
    yield
    call_command("migrate", "jobs", verbosity=0)


def job_indexes() -> set[str]:
    with connection.cursor() as cursor:
        return {
            name
            for name, info in connection.introspection.get_constraints(cursor, "jobs_job").items()
            if info["index"]
        }


def test_the_index_migrations_run_back_and_forth(migrated_forward: None) -> None:
    enqueueing.enqueue("test.noop", {})
    call_command("migrate", "jobs", BEFORE_INDEXES, verbosity=0)
    assert "job_claim_idx" in job_indexes() and "job_runnable_idx" not in job_indexes()
    call_command("migrate", "jobs", "0014_i16_state_index", verbosity=0)
    indexes = job_indexes()
    assert {"job_runnable_idx", "job_blocked_idx", "job_next_due_idx"} <= indexes
    assert not {"job_claim_idx", "job_claim_any_lane_idx", "job_due_idx"} & indexes
    call_command("migrate", "jobs", verbosity=0)  # 0015: the next-due look-up walks runnable
    assert "job_next_due_idx" not in job_indexes()
    call_command("migrate", "jobs", "0014_i16_state_index", verbosity=0)
    assert "job_next_due_idx" in job_indexes()


@pytest.mark.postgres
def test_a_failed_concurrent_build_is_repaired_by_running_the_migration_again(
    migrated_forward: None,
) -> None:
    enqueueing.enqueue_many("test.noop", [{}, {}])  # one run_at: a unique build fails
    call_command("migrate", "jobs", "0010_i16_one_attempt_counter", verbosity=0)
    # What a build that failed (cancelled, timed out, killed) leaves: an invalid index
    # of the migration's name, which IF NOT EXISTS alone would keep for ever.
    with pytest.raises(IntegrityError), connection.cursor() as cursor:
        cursor.execute(
            "CREATE UNIQUE INDEX CONCURRENTLY job_next_due_idx ON jobs_job (run_at)"
            " WHERE state = 'queued' AND blocked_by IS NULL"
        )
    assert validity("job_next_due_idx") == (False, True)

    call_command("migrate", "jobs", "0014_i16_state_index", verbosity=0)
    assert validity("job_next_due_idx") == (True, False)  # valid, and the migration's own


def validity(name: str) -> tuple[bool, bool] | None:
    """(valid, unique) of the index ``name``, or None if there is none."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid, i.indisunique FROM pg_index i"
            " JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = %s",
            [name],
        )
        row = cursor.fetchone()
    return None if row is None else (row[0], row[1])


def state_index_condition() -> str | None:
    """``job_state_idx``'s condition (None: it indexes every job), and no leftover of a
    redefinition under its temporary name."""
    assert "job_state_idx_next" not in job_indexes()
    return index_condition("job_state_idx")


def test_the_state_index_is_redefined_back_and_forth(migrated_forward: None) -> None:
    enqueueing.enqueue("test.noop", {})
    assert "succeeded" not in state_index_condition()
    call_command("migrate", "jobs", "0013_lease_bound", verbosity=0)
    assert state_index_condition() is None
    call_command("migrate", "jobs", verbosity=0)
    assert "'dead'" in state_index_condition()


@pytest.mark.postgres
@pytest.mark.parametrize("old_index_left", [True, False])
def test_a_redefinition_that_failed_half_way_is_finished_by_running_it_again(
    migrated_forward: None, old_index_left: bool
) -> None:
    """What a killed run of 0014 leaves: the new index built under its temporary name, the
    old one dropped or not yet; migrating again drops the old and renames the new."""
    call_command("migrate", "jobs", "0013_lease_bound", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE INDEX CONCURRENTLY job_state_idx_next ON jobs_job (state, lane, kind)"
            " WHERE state = 'queued' OR state = 'running' OR state = 'dead'"
            " OR state = 'cancelled'"
        )
        if not old_index_left:
            cursor.execute("DROP INDEX CONCURRENTLY job_state_idx")
    call_command("migrate", "jobs", verbosity=0)
    assert "'cancelled'" in state_index_condition()
    assert validity("job_state_idx") == (True, False)
