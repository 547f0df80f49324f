"""The job event log: one event per state change, written in the change's own transaction."""

from datetime import timedelta

import pytest
from django.db import transaction

from jobs import LeaseLost, engine, enqueueing, operations
from jobs.context import JobContext
from jobs.events import events, one_event
from jobs.models import Job, JobEvent

from .helpers import claim_one, expire_lease, failure, run, run_json

pytestmark = pytest.mark.django_db


def log_of(job_id: int) -> list[tuple[str, int | None]]:
    return [(e.event, e.lease_token) for e in events(job_id)]


def test_claim_and_settle_write_their_events_with_token_and_worker():
    job = enqueueing.enqueue("test.echo")
    claimed = claim_one("worker-a")
    engine.complete(claimed, result={"ok": True})
    logged = events(job.pk)
    assert [(e.event, e.lease_token, e.worker_id) for e in logged] == [
        ("claimed", 1, "worker-a"),
        ("settled", 1, "worker-a"),
    ]
    assert logged[0].data["attempt"] == 1
    assert logged[1].data == {
        "state": "succeeded",
        "outcome": "succeeded",
        "cancel_requested": False,
    }


def test_retry_dead_requeue_and_release_each_leave_an_event():
    job = enqueueing.enqueue("test.fail")
    engine.fail(claim_one(), failure(), backoff_seconds=0)
    engine.fail(claim_one(), failure(permanent=True), backoff_seconds=0)
    operations.requeue_one(job.pk)
    engine.release(claim_one())
    assert log_of(job.pk) == [
        ("claimed", 1),
        ("settled", 1),
        ("claimed", 2),
        ("settled", 2),
        ("requeued", None),
        ("claimed", 3),
        ("settled", 3),
    ]
    outcomes = [e.data.get("outcome") for e in events(job.pk) if e.event == "settled"]
    assert outcomes == ["failed", "failed", "released"]


def test_reclaim_records_the_missed_heartbeat_and_the_reclaim():
    job = enqueueing.enqueue("test.echo")
    claim_one("gone-worker")
    expire_lease(job.pk)
    engine.reclaim_expired()
    logged = events(job.pk)
    assert [(e.event, e.lease_token, e.worker_id) for e in logged] == [
        ("claimed", 1, "gone-worker"),
        ("heartbeat_missed", 1, "gone-worker"),
        ("reclaimed", 1, "gone-worker"),
    ]
    assert logged[1].data["last_heartbeat_at"]
    assert logged[2].data["state"] == "queued"


def test_cancel_of_a_queued_and_of_a_running_job():
    queued = enqueueing.enqueue("test.echo")
    operations.cancel(queued.pk)
    assert log_of(queued.pk) == [("cancelled", None)]
    running = enqueueing.enqueue("test.echo")
    claimed = claim_one("w1")
    operations.cancel(running.pk, actor="ops")
    engine.cancelled(claimed)
    logged = events(running.pk)
    assert [e.event for e in logged] == ["claimed", "cancel_requested", "settled"]
    assert (logged[1].lease_token, logged[1].worker_id, logged[1].data) == (1, "w1", {"by": "ops"})
    assert logged[2].data["state"] == "cancelled"


def test_a_cancel_the_handler_ignored_is_recorded_as_not_honoured():
    job = enqueueing.enqueue("test.echo")
    claimed = claim_one()
    operations.cancel(job.pk)
    engine.complete(claimed)  # the handler finished anyway
    settled = one_event(job.pk, "settled")
    assert settled.data == {"state": "succeeded", "outcome": "succeeded", "cancel_requested": True}


def test_progress_is_an_event_and_a_stale_progress_writes_none():
    job = enqueueing.enqueue("test.echo")
    stale = claim_one()
    JobContext(stale, "w1").progress(1, 3, "first page")
    expire_lease(job.pk)
    engine.reclaim_expired()
    with pytest.raises(LeaseLost):
        JobContext(stale, "w1").progress(2, 3, "late")
    progress = [e.data for e in events(job.pk) if e.event == "progress"]
    assert progress == [{"done": 1, "total": 3, "note": "first page"}]


def test_a_lost_settle_writes_no_event():
    job = enqueueing.enqueue("test.echo")
    stale = claim_one()
    expire_lease(job.pk)
    engine.reclaim_expired()
    with pytest.raises(LeaseLost):
        engine.complete(stale)
    assert [e for e, _ in log_of(job.pk)].count("settled") == 0


def test_a_rolled_back_change_leaves_no_event():
    job = enqueueing.enqueue("test.echo")
    claimed = claim_one()
    with pytest.raises(RuntimeError), transaction.atomic():
        engine.complete(claimed)
        raise RuntimeError("the caller's transaction failed")
    assert log_of(job.pk) == [("claimed", 1)]


def test_show_job_prints_the_event_log():
    job = enqueueing.enqueue("test.echo")
    engine.complete(claim_one("w9"))
    shown = run_json("show_job", str(job.pk))
    assert [e["event"] for e in shown["events"]] == ["claimed", "settled"]
    assert shown["events"][0]["worker_id"] == "w9"
    text = run("show_job", str(job.pk))
    assert "events (2):" in text and "claimed token 1 on w9" in text


def test_pruning_a_job_deletes_its_events():
    job = enqueueing.enqueue("test.echo")
    engine.complete(claim_one())
    Job.objects.filter(pk=job.pk).update(finished_at=engine.db_now() - timedelta(days=30))
    assert operations.prune(timedelta(days=7)) == 1
    assert not JobEvent.objects.filter(job_id=job.pk).exists()
    assert events(job.pk) == []


def test_an_attempt_is_logged_by_its_lease_row_alone():
    """The claimed and settled events are read from the lease row the claim and the settle
    write anyway (two row writes fewer per job), and still carry all they did."""
    job = enqueueing.enqueue("test.echo")
    claimed = claim_one("w3")
    assert log_of(job.pk) == [("claimed", 1)]
    engine.complete(claimed, result=None)
    assert not JobEvent.objects.filter(job_id=job.pk).exists()
    claim, settle = events(job.pk)
    assert (claim.at, claim.worker_id, claim.data["attempt"]) == (
        Job.objects.get(pk=job.pk).leases.get().acquired_at,
        "w3",
        1,
    )
    assert settle.data == {"state": "succeeded", "outcome": "succeeded", "cancel_requested": False}


def test_events_stored_by_an_older_worker_are_shown_once():
    """Workers of 0.1 inserted claimed and settled rows (and left the lease's
    settled_state empty): during an upgrade both kinds of attempts are in one log."""
    job = enqueueing.enqueue("test.flaky", {"fail_times": 0})
    old = claim_one("old")
    JobEvent.objects.create(job_id=job.pk, event="claimed", lease_token=1, worker_id="old")
    engine.fail(old, failure(), backoff_seconds=0)
    old_lease = Job.objects.get(pk=job.pk).leases.get()
    old_lease.settled_state = None  # as an old worker's settle left it
    old_lease.save(update_fields=["settled_state"])
    JobEvent.objects.create(
        job_id=job.pk, event="settled", lease_token=1, worker_id="old", data={"state": "queued"}
    )
    engine.complete(claim_one("new"), result=None)
    assert log_of(job.pk) == [("claimed", 1), ("settled", 1), ("claimed", 2), ("settled", 2)]


def test_an_event_between_attempts_stays_between_them():
    job = enqueueing.enqueue("test.noop", max_attempts=1)
    engine.fail(claim_one(), failure(permanent=True), backoff_seconds=0)
    assert operations.requeue_dead([Job.objects.get(pk=job.pk)], actor="ops") == [job.pk]
    engine.complete(claim_one(), result=None)
    assert [name for name, _ in log_of(job.pk)] == [
        "claimed",
        "settled",
        "requeued",
        "claimed",
        "settled",
    ]
