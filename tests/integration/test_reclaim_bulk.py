"""Reclaim is set-based and never fights live workers (I3).

10,000 expired leases (a crashed fleet) are reclaimed in one pass with a bounded number of
statements, while a live worker's heartbeat on another connection keeps renewing its own
lease without ever waiting for a lock; the reclaim takes no renewed lease, deletes no lock
row of a live lease, and leaves every reclaimed job its place in the queue.
"""

from __future__ import annotations

import statistics
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import engine, enqueueing
from jobs.events import one_event
from jobs.models import Job, JobLock, Lease, Outcome, State

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

EXPIRED = 10_000
LOCKED = 500  # of the expired jobs, this many held a resource lock


def crash_a_fleet(ids: list[int]) -> None:
    """Make ``ids`` running under leases of dead workers that expired a minute ago."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE jobs_job SET state = 'running', attempts = 1, lease_token = 1, "
            "leased_by = 'dead-' || (id %% 50), started_at = now() - interval '3 minutes', "
            "heartbeat_at = now() - interval '2 minutes', "
            "lease_expires_at = now() - interval '1 minute' WHERE id = ANY(%s)",
            [ids],
        )
        cursor.execute(
            "INSERT INTO jobs_lease (job_id, attempt, lease_token, worker_id, acquired_at, "
            "expires_at, outcome, error_class, error_message, traceback, context) "
            "SELECT id, 1, 1, leased_by, started_at, lease_expires_at, 'running', '', '', '', "
            "'{}' FROM jobs_job WHERE id = ANY(%s)",
            [ids],
        )
        cursor.execute(
            "INSERT INTO jobs_joblock (resource, job_id, lease_token, acquired_at) "
            "SELECT 'res:' || id, id, 1, now() FROM jobs_job WHERE id = ANY(%s)",
            [ids[:LOCKED]],
        )


def test_ten_thousand_expired_leases_in_one_pass_beside_a_live_heartbeat():
    jobs = enqueueing.enqueue_many("test.noop", [{"n": n} for n in range(EXPIRED)])
    ids = [job.pk for job in jobs]
    run_at = dict(Job.objects.filter(pk__in=ids[:100]).values_list("pk", "run_at"))
    crash_a_fleet(ids)
    # A live worker's job, holding a lock, lease renewed by its heartbeat throughout.
    enqueueing.enqueue("test.locked", {"resources": ["live:1"]}, lease_seconds=60)
    live = engine.claim("live-worker")
    assert live is not None

    reclaiming, done = threading.Event(), threading.Event()
    beats: list[tuple[float, float]] = []  # (start, seconds) of each heartbeat
    backend: list[int] = []
    lock_waits: list[str] = []

    def heartbeats() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                backend.append(cursor.fetchone()[0])
            reclaiming.wait(10)
            while not done.is_set():
                started = time.monotonic()
                engine.heartbeat(live)
                beats.append((started, time.monotonic() - started))
                time.sleep(0.005)
        finally:
            connection.close()

    def watch_for_lock_waits() -> None:
        """Sample what the heartbeat's backend waits for: it must never be a lock."""
        try:
            with connection.cursor() as cursor:
                while not done.is_set():
                    cursor.execute(
                        "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s",
                        backend,
                    )
                    row = cursor.fetchone()
                    if row and row[0] == "Lock":
                        lock_waits.append(str(row))
                    time.sleep(0.002)
        finally:
            connection.close()

    beater = threading.Thread(target=heartbeats)
    beater.start()
    while not backend:
        time.sleep(0.01)
    watcher = threading.Thread(target=watch_for_lock_waits)
    watcher.start()
    try:
        with CaptureQueriesContext(connection) as queries:
            reclaiming.set()
            started = time.monotonic()
            reclaimed = engine.reclaim_expired()
            took = time.monotonic() - started
    finally:
        done.set()
        beater.join()
        watcher.join()

    assert len(reclaimed) == EXPIRED and set(reclaimed) == set(ids)
    # one statement per pass, the blocked jobs' sweep and the wake-ups (NOTIFY)
    assert len(queries) <= 4, [q["sql"][:80] for q in queries]
    during = [seconds for begun, seconds in beats if begun < started + took]
    assert during, "no heartbeat ran while the reclaim did"
    assert lock_waits == [], f"the live heartbeat waited for a lock: {lock_waits}"
    # Never delayed behind the reclaim: lock waits would show; CPU contention on a loaded
    # machine may still slow single statements, so the latency check keeps a margin.
    assert statistics.median(during) < 0.1, during
    assert max(during) < max(1.0, took / 2), (max(during), took)

    # The live lease and its lock are untouched; the expired ones are all ended.
    job = Job.objects.get(pk=live.id)
    assert (job.state, job.lease_token, job.leased_by) == (State.RUNNING, 1, "live-worker")
    assert list(JobLock.objects.values_list("resource", "job_id")) == [("live:1", live.id)]
    assert Job.objects.filter(pk__in=ids, state=State.QUEUED).count() == EXPIRED
    assert Lease.objects.filter(job_id__in=ids, outcome=Outcome.LEASE_EXPIRED).count() == EXPIRED
    lease = Lease.objects.get(job_id=ids[0])
    assert lease.error_class == "LeaseExpired" and lease.released_at is not None
    assert "died, stopped responding or lost the database during attempt 1" in lease.error_message
    # Each keeps its place in the queue: run_at unchanged, claimed in the old order.
    assert dict(Job.objects.filter(pk__in=ids[:100]).values_list("pk", "run_at")) == run_at
    newer = enqueueing.enqueue("test.noop", {"n": "enqueued after the crash"})
    first = engine.claim("survivor")
    assert first is not None and first.id == ids[0] and first.id != newer.pk
    assert one_event(ids[1], "reclaimed").data["state"] == "queued"


def test_a_row_an_open_transaction_holds_is_skipped_not_waited_for():
    """One expired job whose row a frozen transaction holds (a fence before its commit)
    never holds up the reclaim of the others: it is skipped, and reclaimed once free."""
    held, free = (job.pk for job in enqueueing.enqueue_many("test.noop", [{"n": 1}, {"n": 2}]))
    for _ in range(2):
        engine.claim("dead-worker")
    Job.objects.filter(pk__in=[held, free]).update(
        lease_expires_at=timezone.now() - timedelta(minutes=5)
    )
    locked, release = threading.Event(), threading.Event()

    def hold_the_row() -> None:
        try:
            with transaction.atomic():
                list(Job.objects.select_for_update().filter(pk=held))
                locked.set()
                release.wait(30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_the_row)
    holder.start()
    try:
        assert locked.wait(10)
        # Waiting for the row would end in the reclaim's 1 s lock_timeout, failing it all.
        assert engine.reclaim_expired() == [free]
    finally:
        release.set()
        holder.join()
    assert engine.reclaim_expired() == [held]
