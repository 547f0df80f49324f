"""The engine's own statements never change the handler's transaction, and a worker
back from an outage gives back claims it never heard of."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from jobs import LeaseLost, StateConflict, engine, enqueueing, operations, workers
from jobs.context import JobContext
from jobs.events import events
from jobs.models import Job, Lease, Outcome, State

from .helpers import claim_one, expire_lease


def settings_now() -> tuple[str, str, str]:
    with connection.cursor() as cursor:
        values = []
        for name in ("synchronous_commit", "lock_timeout", "statement_timeout"):
            cursor.execute(f"SHOW {name}")
            values.append(cursor.fetchone()[0])
    return tuple(values)  # type: ignore[return-value]


@pytest.mark.postgres
@pytest.mark.parametrize("own_connection", [False, True], ids=["bare", "own-connection"])
@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_inside_ctx_atomic_leaves_the_transactions_settings_alone(own_connection):
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    ctx = JobContext(claimed, "w1", own_connection=own_connection)
    before = settings_now()
    with ctx.atomic():
        inside = settings_now()
        ctx.heartbeat()
        assert settings_now() == inside == before  # synchronous_commit, lock_timeout...
    assert settings_now() == before
    ctx.heartbeat()  # outside a transaction: its settings are its own statement's only
    assert settings_now() == before
    assert Job.objects.get().heartbeat_at is not None


@pytest.mark.django_db(transaction=True)
def test_after_an_outage_a_worker_gives_back_a_claim_it_never_heard_of(run_worker, monkeypatch):
    """The claim committed but its acknowledgement was lost with the connection: the job
    is leased to this worker, which never ran it. Reconnected, the worker releases it
    (uncharged) before claiming again, then runs it as attempt 1."""
    job = enqueueing.enqueue("test.echo")
    real_claim = engine.claim
    lost: list[object] = []

    def claim_losing_the_ack(*args, **kwargs):
        if not lost:
            lost.append(real_claim(*args, **kwargs))  # committed...
            raise OperationalError("server closed the connection unexpectedly")  # ...no ack
        return real_claim(*args, **kwargs)

    monkeypatch.setattr(engine, "claim", claim_losing_the_ack)
    assert run_worker(worker_id="w-lost") == 1
    job = Job.objects.get(pk=job.pk)
    assert (job.state, job.attempts, job.lease_token) == (State.SUCCEEDED, 1, 2)
    outcomes = list(
        Lease.objects.filter(job=job).order_by("lease_token").values_list("lease_token", "outcome")
    )
    assert outcomes == [(1, Outcome.RELEASED), (2, Outcome.SUCCEEDED)]


def _cancel_over_http() -> Callable[[int], object]:
    """``POST jobs/{id}/cancel/``, raising StateConflict for its 409 and OperationalError
    for its 503 as ``cancel`` does
    (its token written now: a write would wait for the lock the test holds)."""
    from django.test import Client

    from ops import tokens

    token = tokens.create("ops-bot", "write")[1]

    def cancel(job_id: int) -> object:
        response = Client().post(
            f"/internal/v1/jobs/{job_id}/cancel/",
            data="",
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}"},
        )
        if response.status_code == 409:
            raise StateConflict(response.json()["error"])
        if response.status_code == 503:
            raise OperationalError(response.json()["error"])
        assert response.status_code == 200, response.content
        return response

    return cancel


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "make_cancel", [lambda: operations.cancel, _cancel_over_http], ids=["cli", "api"]
)
def test_cancel_answers_within_seconds_though_a_frozen_transaction_holds_the_job(make_cancel):
    """A worker froze between its fence and its commit (PostgreSQL: it holds the job row;
    SQLite: the database's write lock): cancel_job waits a bounded time, then says the
    job is busy and changes nothing."""
    cancel = make_cancel()
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    holding, release = threading.Event(), threading.Event()

    def frozen_fence() -> None:
        try:
            with transaction.atomic():
                engine.fence(claimed.id, claimed.lease_token, claimed.lease_seconds)
                holding.set()
                release.wait(20)
        finally:
            connection.close()

    holder = threading.Thread(target=frozen_fence)
    holder.start()
    try:
        assert holding.wait(5)
        started = time.monotonic()
        if connection.vendor == "postgresql":  # the job's own row: a 409
            with pytest.raises(StateConflict, match="locked by an open transaction"):
                cancel(claimed.id)
        else:  # the whole database's lock, whoever holds it: busy, a 503 (helper-26 #3)
            with pytest.raises(OperationalError, match=r"locked by another|unavailable"):
                cancel(claimed.id)
        assert time.monotonic() - started < 5
    finally:
        release.set()
        holder.join()
    job = Job.objects.get(pk=claimed.id)
    assert (job.state, job.cancel_requested) == (State.RUNNING, False)
    assert operations.cancel(claimed.id).cancel_requested  # once the holder is gone


@pytest.mark.django_db
def test_cancel_of_a_running_job_whose_lease_expired_ends_it_at_once():
    """Its worker died or froze: the cancel ends that attempt as a reclaim would."""
    enqueueing.enqueue("test.locked", {"resources": ["r"]})
    claimed = claim_one()
    expire_lease(claimed.id)
    job = operations.cancel(claimed.id, actor="tester")
    assert (job.state, job.cancel_requested) == (State.CANCELLED, True)
    assert job.last_error == "cancelled by tester after its worker stopped renewing lease 1"
    assert Lease.objects.get(job=job).outcome == Outcome.LEASE_EXPIRED
    assert not engine.held_locks().exists()
    assert [e.event for e in events(job.pk)][-2:] == ["heartbeat_missed", "reclaimed"]
    with pytest.raises(LeaseLost):
        engine.complete(claimed)


@pytest.mark.django_db
def test_a_restarted_worker_leaves_its_previous_incarnations_job_to_reclaim():
    """Same worker id (a systemd unit restarted after its process died): the job the dead
    process held is not this process's claim, so it is not given back uncharged; its
    lease expires and reclaim charges it (a job that kills its worker still goes dead)."""
    enqueueing.enqueue("test.echo")
    earlier = claim_one("host-1")
    Job.objects.filter(pk=earlier.id).update(started_at=timezone.now() - timedelta(minutes=1))
    workers.register_worker("host-1", None, ["test.echo"])  # the restarted process
    assert engine.release_orphans("host-1") == []
    assert Job.objects.get(pk=earlier.id).state == State.RUNNING
    enqueueing.enqueue("test.echo")
    mine = claim_one("host-1")
    assert engine.release_orphans("host-1", keep=None) == [mine.id]


@pytest.mark.django_db(transaction=True)
def test_cancel_inside_a_callers_transaction_leaves_its_lock_wait_alone():
    """``cancel_job`` bounds its own lock waits; called from inside a transaction (a
    handler cancelling another job), the rest of that transaction keeps its own."""
    queued = enqueueing.enqueue("test.echo")
    with transaction.atomic():
        before = lock_wait_now()
        assert operations.cancel(queued.pk).state == State.CANCELLED
        assert lock_wait_now() == before
    with transaction.atomic():
        before = lock_wait_now()
        with pytest.raises(StateConflict):
            operations.cancel(queued.pk)  # finished: refused, rolled back to its savepoint
        assert lock_wait_now() == before


def lock_wait_now() -> str:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SHOW lock_timeout")
        else:
            cursor.execute("PRAGMA busy_timeout")
        return str(cursor.fetchone()[0])


@pytest.mark.django_db(transaction=True)
def test_a_threads_sqlite_lock_wait_outlives_a_reconnect() -> None:
    """A lease keeper's bounded wait for the write lock holds on the connection it opens
    after closing one on "database is locked"; it waited the settings' 20 s there, so a
    frozen holder of the lock was looked for every 20 s, and healthy workers' shorter
    leases ran out meanwhile. Other threads keep the settings' wait."""
    from jobs import sql

    if connection.vendor != "sqlite":
        pytest.skip("SQLite's busy timeout")
    seen: dict[str, str] = {}

    def keeper() -> None:
        try:
            sql.sqlite_busy_timeout(750)
            seen["before"] = lock_wait_now()
            connection.close()
            seen["after"] = lock_wait_now()  # a new connection
        finally:
            connection.close()

    thread = threading.Thread(target=keeper)
    thread.start()
    thread.join()
    assert seen == {"before": "750", "after": "750"}
    connection.close()
    assert lock_wait_now() == "20000"  # this thread: the settings' wait
