"""Every state transition of the engine, and the guard that protects it (I1, I2, I3)."""

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone
from structlog.testing import capture_logs

from jobs import LeaseLost, attempts, engine, enqueueing, operations
from jobs.context import JobContext
from jobs.models import Job, Lease, Outcome, State
from tests.testapp.models import Effect

from .helpers import claim_one, expire_lease, failure

pytestmark = pytest.mark.django_db


def test_claim_takes_highest_priority_then_oldest_then_lowest_id():
    low = enqueueing.enqueue("test.echo", {"n": "low"}, priority=-5)
    first = enqueueing.enqueue("test.echo", {"n": "first"})
    second = enqueueing.enqueue("test.echo", {"n": "second"})
    high = enqueueing.enqueue("test.echo", {"n": "high"}, priority=5)
    enqueueing.enqueue("test.echo", {"n": "later"}, delay=3600)
    order = [claim_one().id for _ in range(4)]
    assert order == [high.pk, first.pk, second.pk, low.pk]
    assert engine.claim("w1") is None  # the delayed job is not runnable yet


def test_claim_records_the_attempt_on_the_job_row_and_increments_the_fencing_token():
    job = enqueueing.enqueue("test.echo")
    claimed = claim_one("worker-a")
    assert (claimed.id, claimed.attempt, claimed.lease_token) == (job.pk, 1, 1)
    row = Job.objects.get(pk=job.pk)
    assert row.state == State.RUNNING
    assert row.leased_by == "worker-a"
    assert row.lease_expires_at > row.heartbeat_at
    # The running attempt is the job row's; its lease row is written when it ends.
    assert not Lease.objects.filter(job=job).exists()
    (lease,) = attempts.leases(row)
    assert (lease.lease_token, lease.attempt, lease.outcome) == (1, 1, Outcome.RUNNING)
    assert (lease.worker_id, lease.acquired_at) == ("worker-a", row.started_at)
    assert lease.expires_at == row.lease_expires_at
    assert engine.claim("worker-b") is None  # I1: one live lease per job


def test_claim_serves_only_the_requested_lanes():
    enqueueing.enqueue("test.echo", lane="default")
    assert engine.claim("w", lanes=["other"]) is None
    assert engine.claim("w", lanes=["other", "default"]) is not None


def test_complete_is_fenced_by_state_and_token():
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    engine.complete(claimed, {"ok": True})
    job = Job.objects.get(pk=claimed.id)
    assert job.state == State.SUCCEEDED and job.result == {"ok": True}
    assert job.finished_at is not None and job.leased_by is None
    assert Lease.objects.get(job=job).outcome == Outcome.SUCCEEDED
    with pytest.raises(LeaseLost):
        engine.complete(claimed)  # completing twice is refused


def test_failure_retries_with_backoff_then_goes_dead():
    enqueueing.enqueue("test.fail")  # max_attempts=3
    for attempt in (1, 2):
        claimed = claim_one()
        assert claimed.attempt == attempt
        assert engine.fail(claimed, failure(f"boom {attempt}"), backoff_seconds=0) == State.QUEUED
    job = Job.objects.get()
    assert job.state == State.QUEUED and job.last_error == "RuntimeError: boom 2"
    claimed = claim_one()
    assert engine.fail(claimed, failure("boom 3"), backoff_seconds=0) == State.DEAD
    job = Job.objects.get()
    assert (job.state, job.attempts) == (State.DEAD, 3)
    leases = list(job.leases.order_by("lease_token"))
    assert [lease.outcome for lease in leases] == [Outcome.FAILED] * 3
    assert [lease.error_message for lease in leases] == ["boom 1", "boom 2", "boom 3"]
    assert all("Traceback" in lease.traceback for lease in leases)


def test_backoff_delays_the_next_attempt():
    enqueueing.enqueue("test.fail")
    engine.fail(claim_one(), failure(), backoff_seconds=600)
    job = Job.objects.get()
    assert job.state == State.QUEUED
    assert job.run_at > timezone.now() + timedelta(seconds=500)
    assert engine.claim("w1") is None


def test_permanent_error_goes_dead_at_once():
    enqueueing.enqueue("test.echo")
    assert engine.fail(claim_one(), failure(permanent=True), backoff_seconds=0) == State.DEAD
    assert Job.objects.get().attempts == 1


def test_release_gives_the_job_back_without_charging_the_attempt():
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    engine.release(claimed)
    job = Job.objects.get()
    assert (job.state, job.attempts, job.lease_token) == (State.QUEUED, 0, 1)
    assert Lease.objects.get().outcome == Outcome.RELEASED
    again = claim_one()
    assert (again.attempt, again.lease_token) == (1, 2)


def test_reclaim_requeues_an_expired_lease_and_fences_out_the_old_worker():
    enqueueing.enqueue("test.echo")
    old = claim_one("old-worker")
    expire_lease(old.id)
    assert engine.reclaim_expired() == [old.id]
    job = Job.objects.get()
    assert job.state == State.QUEUED and "LeaseExpired" in job.last_error
    assert Lease.objects.get().outcome == Outcome.LEASE_EXPIRED
    with pytest.raises(LeaseLost):  # back before anyone claimed it again: still refused
        engine.complete(old, "late")
    new = claim_one("new-worker")
    assert new.lease_token == old.lease_token + 1
    # The old worker comes back: every write it attempts is rejected (I2).
    for late_write in (
        lambda: engine.complete(old, "late"),
        lambda: engine.fail(old, failure(), 0),
        lambda: engine.release(old),
        lambda: engine.heartbeat(old),
        lambda: engine.fence(old.id, old.lease_token),
    ):
        with pytest.raises(LeaseLost):
            late_write()
    # The refused settles wrote no lease row: the reclaimed attempt's record stands.
    assert Lease.objects.get().outcome == Outcome.LEASE_EXPIRED
    engine.complete(new, "fresh")
    assert Job.objects.get().result == "fresh"
    outcomes = list(Lease.objects.order_by("lease_token").values_list("lease_token", "outcome"))
    assert outcomes == [(1, Outcome.LEASE_EXPIRED), (2, Outcome.SUCCEEDED)]


def test_reclaim_never_clobbers_a_completion_that_landed_first():
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    expire_lease(claimed.id)
    engine.complete(claimed, "won the race")  # completion lands before the reclaimer
    assert engine.reclaim_expired() == []
    job = Job.objects.get()
    assert job.state == State.SUCCEEDED and job.result == "won the race"
    assert Lease.objects.get().outcome == Outcome.SUCCEEDED


def test_reclaim_leaves_live_leases_alone():
    enqueueing.enqueue("test.echo")
    claim_one()
    assert engine.reclaim_expired() == []
    assert Job.objects.get().state == State.RUNNING


def test_reclaim_of_a_spent_job_makes_it_dead():
    enqueueing.enqueue("test.echo", max_attempts=1)
    claimed = claim_one()
    expire_lease(claimed.id)
    with capture_logs() as logs:
        assert engine.reclaim_expired() == [claimed.id]
    job = Job.objects.get()
    assert job.state == State.DEAD and job.finished_at is not None
    # The error-level line operators alert on, as a failed last attempt's settle logs.
    [dead] = [e for e in logs if e["event"] == "job_dead"]
    assert dead["log_level"] == "error" and dead["reason"] == "lease_expired"
    assert (dead["job_id"], dead["kind"], dead["attempt"]) == (claimed.id, "test.echo", 1)
    assert dead["error"].startswith("LeaseExpired: worker w1 stopped renewing lease 1")


def test_a_reclaim_pass_of_many_jobs_logs_its_dead_ones_in_one_error_line():
    enqueueing.enqueue_many("test.echo", [{} for _ in range(101)], max_attempts=1)
    for _ in range(101):
        claim_one()
    Job.objects.update(lease_expires_at=timezone.now() - timedelta(minutes=5))
    with capture_logs() as logs:
        assert len(engine.reclaim_expired()) == 101
    [dead] = [e for e in logs if e["event"] == "jobs_dead"]
    assert (dead["log_level"], dead["count"], dead["reason"]) == ("error", 101, "lease_expired")


def test_heartbeat_extends_the_lease_and_reports_cancel_requests():
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    Job.objects.filter(pk=claimed.id).update(lease_expires_at=timezone.now())
    assert engine.heartbeat(claimed) is False
    job = Job.objects.get()
    assert job.lease_expires_at > timezone.now() + timedelta(seconds=30)
    assert not Lease.objects.exists()  # a heartbeat writes the job row alone
    assert attempts.leases(job)[0].expires_at == job.lease_expires_at
    Job.objects.filter(pk=claimed.id).update(cancel_requested=True)
    assert engine.heartbeat(claimed) is True


def test_requeue_dead_gives_a_fresh_budget_and_keeps_history():
    enqueueing.enqueue("test.fail")
    for _ in range(3):
        engine.fail(claim_one(), failure(), backoff_seconds=0)
    dead = Job.objects.get()
    assert dead.state == State.DEAD
    assert operations.requeue_dead(operations.dead_jobs(kind="test.fail")) == [dead.pk]
    job = Job.objects.get()
    assert (job.state, job.attempts, job.max_attempts) == (State.QUEUED, 3, 6)
    assert job.finished_at is None
    assert claim_one().attempt == 4
    assert operations.requeue_dead([job]) == []  # not dead any more: nothing happens


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_an_open_fenced_block_holds_no_lock_and_a_stale_one_rolls_back():
    """While a handler is inside ctx.atomic() its job row is not locked: reclaim (and
    cancel, heartbeats) never wait behind it, even a frozen one. The block checks the
    lease at its end, in its own transaction: reclaimed meanwhile, it rolls back (I2)."""
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    expire_lease(claimed.id)  # committed: to a reclaimer the lease looks expired
    inside, release, outcome = threading.Event(), threading.Event(), {}

    def block() -> None:
        try:
            with JobContext(claimed, "w1").atomic():
                Effect.objects.create(job_id=claimed.id, attempt=1, lease_token=1, label="x")
                inside.set()
                release.wait(10)
        except LeaseLost as exc:
            outcome["error"] = exc
        finally:
            connection.close()

    holder = threading.Thread(target=block)
    holder.start()
    try:
        assert inside.wait(5)
        started = time.monotonic()
        assert engine.reclaim_expired() == [claimed.id]  # not blocked by the open block
        assert operations.cancel(claimed.id).state == State.CANCELLED  # nor is a cancel
        assert time.monotonic() - started < 3
    finally:
        release.set()
        holder.join()
    assert isinstance(outcome.get("error"), LeaseLost)
    assert not Effect.objects.filter(job_id=claimed.id).exists()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_end_of_block_fence_and_its_commit_serialize_with_reclaim():
    """The fence is the block's last statement and locks the row until the commit right
    after it: a reclaim meanwhile skips the row (never waits), and after the commit finds
    the lease renewed; a fence that comes second finds the job reclaimed and rolls back."""
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    expire_lease(claimed.id)
    fenced, commit = threading.Event(), threading.Event()

    def fence_then_wait() -> None:
        try:
            with transaction.atomic():
                engine.fence(claimed.id, claimed.lease_token, claimed.lease_seconds)
                fenced.set()
                commit.wait(10)
        finally:
            connection.close()

    holder = threading.Thread(target=fence_then_wait)
    holder.start()
    try:
        assert fenced.wait(5)
        started = time.monotonic()
        assert engine.reclaim_expired() == []  # skipped, not waited on
        assert time.monotonic() - started < 3
    finally:
        commit.set()
        holder.join()
    assert engine.reclaim_expired() == []  # the fence renewed the lease when it committed
    assert Job.objects.get().state == State.RUNNING
    expire_lease(claimed.id)
    assert engine.reclaim_expired() == [claimed.id]
    with pytest.raises(LeaseLost), transaction.atomic():
        engine.fence(claimed.id, claimed.lease_token, claimed.lease_seconds)


LANE_SET = {"default": {}, "a": {}, "b": {}}


@pytest.mark.django_db(transaction=True)
def test_claims_follow_priority_then_age_then_id_across_lanes_whatever_the_mix():
    """The any-lane claim walks (lane, priority) pairs of the runnable index one by one;
    the list claim, lane by lane. Either way jobs come out best first across lanes
    (priority, then run_at, then id), delayed ones never, for random mixes."""
    from django.test import override_settings
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    job = st.tuples(st.sampled_from(sorted(LANE_SET)), st.integers(-2, 2), st.booleans())

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(job, min_size=1, max_size=12), st.booleans())
    def check(specs: list[tuple[str, int, bool]], listed: bool) -> None:
        Job.objects.all().delete()
        with override_settings(HOLDFAST_LANES=LANE_SET):
            made = [
                enqueueing.enqueue(
                    "test.echo", {"n": n}, lane=lane, priority=p, delay=3600 if late else None
                )
                for n, (lane, p, late) in enumerate(specs)
            ]
            due = [m for m, (_, _, late) in zip(made, specs, strict=True) if not late]
            expected = [m.pk for m in sorted(due, key=lambda m: (-m.priority, m.run_at, m.pk))]
            lanes = sorted(LANE_SET) if listed else None
            got = []
            while (claimed := engine.claim("w", lanes=lanes)) is not None:
                got.append(claimed.id)
            assert got == expected

    check()


@pytest.mark.django_db(transaction=True)
def test_a_sqlite_settle_that_fails_midway_commits_nothing_of_it(monkeypatch):
    """SQLite's hot path runs settle and claim in the sqlite3 connection's own BEGIN
    IMMEDIATE: a statement failing after the job row was settled rolls all of it back."""
    from jobs import sql

    if sql.is_postgres():
        pytest.skip("SQLite's own transaction")
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    monkeypatch.setattr(sql, "SQLITE_COUNT_ATTEMPT", "SELECT no_such_function()")
    with pytest.raises(Exception, match="no_such_function"):
        engine.complete(claimed)
    job = Job.objects.get(pk=claimed.id)
    assert job.state == State.RUNNING and job.lease_token == claimed.lease_token
    assert not Lease.objects.filter(job=job).exists()  # the lease row's write rolled back too
    assert not connection.in_atomic_block and connection.get_autocommit()
    monkeypatch.undo()
    engine.complete(claimed)  # the connection is usable, the lease still ours
    assert Job.objects.get(pk=claimed.id).state == State.SUCCEEDED
