"""Blocked jobs leave the claim's path and come back when their lock frees (issue 16).

A queued job whose resource lock is held is marked ``blocked_by`` (PostgreSQL) after a
claim walks past it, and promoted when the lock is released: it is never lost (no lost
wake-up), and the operators' views still count it ``queued``. SQLite never marks: there
the tests check that the same waits end the same way.
"""

from __future__ import annotations

import threading

import psycopg
import pytest
from django.db import connection, transaction

from jobs import engine, enqueueing, operations, sql
from jobs.models import Job, JobLock, State
from jobs.serialization import job_detail_dict
from jobs.status import queue_status

from .helpers import claim_one, expire_lease

pytestmark = pytest.mark.django_db


def locked(*resources: str, **options):
    return enqueueing.enqueue("test.locked", {"resources": list(resources)}, **options)


def blocked_by(job) -> str | None:
    return Job.objects.get(pk=job.pk).blocked_by


def test_a_blocked_job_is_claimed_as_soon_as_its_lock_frees():
    holder = locked("source:a")
    first, second = locked("source:a"), locked("source:a")
    free = enqueueing.enqueue("test.noop")
    held = claim_one("w1")
    assert held.id == holder.pk
    assert claim_one("w2").id == free.pk  # walks past the two blocked jobs
    if sql.is_postgres():
        assert blocked_by(first) == blocked_by(second) == "source:a"
    assert engine.claim("w2") is None
    # The operators' views: still queued, and show_job says what it waits for.
    status = queue_status()
    assert status["totals"]["queued"] == 2
    detail = job_detail_dict(Job.objects.get(pk=first.pk))
    assert detail["state"] == "queued"
    assert detail["waiting_for"] == ("source:a" if sql.is_postgres() else None)
    engine.complete(held)  # the release promotes the best blocked job, in order
    if sql.is_postgres():
        assert blocked_by(first) is None and blocked_by(second) == "source:a"
    again = claim_one("w2")
    assert again.id == first.pk
    assert engine.claim("w3") is None  # the second still waits: its lock is held again
    # Settle and claim, fused. PostgreSQL: the claim reads the snapshot from before the
    # settle, where the lock is still held; the promotion that follows puts the job back
    # at once. SQLite: the claim runs after the settle, in its transaction.
    fused = engine.settle_and_claim(again, engine.succeeded(), "w2", None)
    assert (fused or claim_one("w3")).id == second.pk


def test_a_job_blocked_on_one_of_two_locks_waits_for_both():
    a_holder, b_holder = locked("a"), locked("b")
    both = locked("a", "b")
    ha, hb = claim_one("w1"), claim_one("w2")
    assert {ha.id, hb.id} == {a_holder.pk, b_holder.pk}
    assert engine.claim("w3") is None
    engine.complete(ha)
    assert engine.claim("w3") is None  # "b" is still held: blocked again (on "b")
    engine.complete(hb)
    assert claim_one("w3").id == both.pk


def test_a_reclaimed_holder_frees_its_blocked_waiters():
    holder = locked("r")
    waiter = locked("r")
    held = claim_one("w1")
    assert engine.claim("w2") is None
    expire_lease(held.id)
    assert engine.reclaim_expired() == [held.id]  # frees "r", then the sweep promotes
    again = claim_one("w2")
    assert again.id == holder.pk  # the reclaimed job kept its place in the queue
    assert engine.claim("w3") is None
    engine.complete(again)
    assert claim_one("w3").id == waiter.pk


@pytest.mark.postgres
def test_the_sweep_promotes_what_a_crashed_releaser_left_blocked():
    locked("r")
    waiter = locked("r")
    held = claim_one("w1")
    assert engine.claim("w2") is None
    assert blocked_by(waiter) == "r"
    # The releaser's settle committed, and it died before its promotion ran.
    JobLock.objects.filter(job_id=held.id).delete()
    Job.objects.filter(pk=held.id).update(state=State.SUCCEEDED, lease_expires_at=None)
    assert engine.claim("w2") is None  # still out of the claim's path...
    engine.reclaim_expired()  # ...until the next reclaim pass's sweep
    assert claim_one("w2").id == waiter.pk


@pytest.mark.postgres
def test_cancel_and_requeue_keep_blocked_jobs_right():
    locked("r")
    waiter = locked("r")
    held = claim_one("w1")
    assert engine.claim("w2") is None and blocked_by(waiter) == "r"
    operations.cancel(waiter.pk, actor="op")
    assert Job.objects.get(pk=waiter.pk).state == State.CANCELLED
    engine.complete(held)
    assert engine.claim("w2") is None


# --- no lost wake-up: the mark against a concurrent release (PostgreSQL) ---------------


def _other_connection() -> psycopg.Connection:
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return psycopg.connect(**params)


def _passed(job) -> list:
    """The claim's report of the range it walked past ``job`` in (the whole range)."""
    return [[job.lane, job.priority, None, None]]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_mark_never_waits_for_and_never_outlives_a_release_in_progress():
    """The release deleted the lock row and has not committed: the mark skips that lock
    (SKIP LOCKED), so the job stays runnable and is claimed once the release commits."""
    locked("r")
    waiter = locked("r")
    held = claim_one("w1")
    with _other_connection() as other:
        other.execute("DELETE FROM jobs_joblock WHERE job_id = %s", [held.id])  # uncommitted
        sql._mark_blocked(_passed(waiter), None)
        assert blocked_by(waiter) is None  # not marked: its lock is going away
        other.execute(
            "UPDATE jobs_job SET state = 'succeeded', lease_expires_at = NULL WHERE id = %s",
            [held.id],
        )
        other.commit()
    assert claim_one("w2").id == waiter.pk


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_release_waits_for_a_mark_in_progress_and_then_promotes_it():
    """The mark holds the lock row FOR KEY SHARE until it commits: a release that deletes
    the row meanwhile waits for it, and the promotion after the release sees the mark."""
    locked("r")
    waiter = locked("r")
    held = claim_one("w1")
    deleting, released = threading.Event(), threading.Event()

    def release() -> None:  # a settle: the lock row's delete, then (later) the promotion
        try:
            with _other_connection() as other:
                deleting.set()
                other.execute("DELETE FROM jobs_joblock WHERE job_id = %s", [held.id])
                other.execute(
                    "UPDATE jobs_job SET state = 'succeeded', lease_expires_at = NULL"
                    " WHERE id = %s",
                    [held.id],
                )
                other.commit()
            sql.promote_blocked(["r"])
            released.set()
        finally:
            connection.close()

    thread = threading.Thread(target=release)
    with transaction.atomic():
        sql._mark_blocked(_passed(waiter), None)  # holds "r" FOR KEY SHARE until commit
        assert blocked_by(waiter) == "r"
        thread.start()
        assert deleting.wait(5)
        assert not released.wait(0.5)  # the delete waits for this mark to commit
    thread.join(10)
    assert released.is_set()
    assert blocked_by(waiter) is None  # promoted: no lost wake-up
    assert claim_one("w2").id == waiter.pk
