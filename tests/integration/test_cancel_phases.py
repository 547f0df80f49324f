"""Cancellation at every phase of a job's life, driven through the engine (issue #6).

Each test plays the worker's part by hand (claim, ``ctx``, heartbeat, settle) so that the
cancel request lands at an exact point: while queued, just after the claim, between two
commits of the handler, and after the handler returned but before its settle. The same
phases with real worker processes are in ``tests/process/test_cancel_phases.py``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connections
from django.db.models import query as django_query
from structlog.testing import capture_logs

from jobs import Cancelled, StateConflict, engine, enqueueing, operations, sql
from jobs.context import JobContext
from jobs.events import events, one_event
from jobs.models import Job, Lease, Outcome, State
from jobs.sql import Claimed
from tests.testapp.models import Effect

from .helpers import claim_one, expire_lease, failure

pytestmark = pytest.mark.django_db


def event_log(job_id: int) -> list[tuple[str, int | None, dict[str, Any]]]:
    return [(e.event, e.lease_token, e.data) for e in events(job_id)]


def effect(ctx: JobContext, label: str) -> None:
    Effect.objects.create(
        job_id=ctx.job_id, attempt=ctx.attempt, lease_token=ctx.lease_token, label=label
    )


def request_cancel(claimed: Claimed, ctx: JobContext) -> None:
    """Cancel a running job and let its worker hear it, as its lease keeper would."""
    assert operations.cancel(claimed.id, actor="tester").state == State.RUNNING
    assert not ctx.cancel_requested  # nothing reaches the handler until the worker hears
    ctx.heartbeat()
    assert ctx.cancel_requested


def test_a_queued_job_is_cancelled_at_once_and_never_claimed() -> None:
    job = enqueueing.enqueue("test.locked", {"resources": ["r1"]})
    cancelled = operations.cancel(job.pk, actor="tester")
    assert cancelled.state == State.CANCELLED
    assert cancelled.finished_at is not None and cancelled.cancel_requested
    assert event_log(job.pk) == [("cancelled", None, {"by": "tester"})]

    assert engine.claim("w1") is None
    assert not Lease.objects.filter(job_id=job.pk).exists()
    assert not engine.held_locks().exists()
    with pytest.raises(StateConflict):
        operations.cancel(job.pk)
    assert len(event_log(job.pk)) == 1


def test_a_cancel_just_after_the_claim_stops_the_job_at_its_first_safe_point() -> None:
    enqueueing.enqueue("test.locked", {"resources": ["r2", "r1"]})
    claimed = claim_one("w1")
    ctx = JobContext(claimed, "w1")
    assert [lock.resource for lock in engine.held_locks(claimed.id)] == ["r1", "r2"]

    request_cancel(claimed, ctx)
    running = Job.objects.get(pk=claimed.id)
    assert (running.state, running.cancel_requested) == (State.RUNNING, True)
    engine.cancelled(claimed)  # the handler's first check raised ctx.Cancelled

    job = Job.objects.get(pk=claimed.id)
    assert job.state == State.CANCELLED and job.progress is None
    assert Lease.objects.get(job_id=job.pk).outcome == Outcome.CANCELLED
    token = claimed.lease_token
    assert [(name, lease) for name, lease, _ in event_log(job.pk)] == [
        ("claimed", token),
        ("cancel_requested", token),
        ("settled", token),
    ]
    assert event_log(job.pk)[-1][2] == {
        "state": "cancelled",
        "outcome": "cancelled",
        "cancel_requested": True,
    }
    assert one_event(job.pk, "cancel_requested").worker_id == "w1"
    # The cancelled attempt let go of its resources in the same commit.
    assert not engine.held_locks().exists()
    waiting = enqueueing.enqueue("test.locked", {"resources": ["r1"]})
    assert claim_one("w2").id == waiting.pk


def test_a_cancel_mid_progress_keeps_committed_progress_and_rolls_back_the_rest() -> None:
    enqueueing.enqueue("test.cancellable")
    claimed = claim_one("w1")
    ctx = JobContext(claimed, "w1")
    ctx.progress(1, 3, "first step")
    with ctx.atomic():
        effect(ctx, "first step")

    request_cancel(claimed, ctx)
    with pytest.raises(Cancelled), ctx.atomic():
        effect(ctx, "second step")  # uncommitted when the handler reaches its safe point
        if ctx.cancel_requested:
            raise ctx.Cancelled()
    engine.cancelled(claimed)

    job = Job.objects.get(pk=claimed.id)
    assert job.state == State.CANCELLED
    assert job.progress == {"done": 1, "total": 3, "note": "first step"}
    assert list(Effect.objects.values_list("label", flat=True)) == ["first step"]
    assert [name for name, _, _ in event_log(job.pk)] == [
        "claimed",
        "progress",
        "cancel_requested",
        "settled",
    ]
    assert event_log(job.pk)[-1][2]["state"] == "cancelled"


def test_a_cancel_after_the_handler_returned_leaves_its_completion_standing() -> None:
    enqueueing.enqueue("test.echo", {"n": 1})
    claimed = claim_one("w1")
    ctx = JobContext(claimed, "w1")
    result = {"n": 1}  # the handler has returned; the worker has yet to settle

    request_cancel(claimed, ctx)
    engine.settle_and_claim(claimed, engine.succeeded(result), None, None)

    job = Job.objects.get(pk=claimed.id)
    assert (job.state, job.result, job.cancel_requested) == (State.SUCCEEDED, result, True)
    assert Lease.objects.get(job_id=job.pk).outcome == Outcome.SUCCEEDED
    # Recorded as not honoured: the completion stands, and the log says it was asked.
    assert event_log(job.pk)[-1] == (
        "settled",
        claimed.lease_token,
        {"state": "succeeded", "outcome": "succeeded", "cancel_requested": True},
    )
    with pytest.raises(StateConflict):
        operations.cancel(job.pk)


def test_a_cancel_after_the_completion_committed_is_refused() -> None:
    enqueueing.enqueue("test.effect")
    claimed = claim_one("w1")
    ctx = JobContext(claimed, "w1")
    with ctx.atomic(complete=True, result="done"):
        effect(ctx, "complete")

    with pytest.raises(StateConflict):
        operations.cancel(claimed.id)
    job = Job.objects.get(pk=claimed.id)
    assert (job.state, job.cancel_requested) == (State.SUCCEEDED, False)
    assert [name for name, _, _ in event_log(job.pk)] == ["claimed", "settled"]
    assert event_log(job.pk)[-1][2]["cancel_requested"] is False


def test_a_cancel_requested_of_an_attempt_that_died_ends_the_job_at_its_reclaim() -> None:
    """The worker died (or froze) before hearing the request: the reclaim ends the job
    ``cancelled``, never runs it again (it queued it for a next attempt, which a handler
    that does not check ran to its end: the operator's cancel was lost)."""
    enqueueing.enqueue("test.cancellable")
    first = claim_one("w1")
    assert operations.cancel(first.id).state == State.RUNNING
    expire_lease(first.id)
    with capture_logs() as logs:
        assert engine.reclaim_expired() == [first.id]
    job = Job.objects.get(pk=first.id)
    assert (job.state, job.cancel_requested) == (State.CANCELLED, True)
    assert job.finished_at is not None
    assert job.last_error == (
        f"cancelled on request: worker w1 stopped renewing lease {first.lease_token} "
        "before it stopped the job"
    )
    assert Lease.objects.get(job_id=job.pk).outcome == Outcome.LEASE_EXPIRED
    assert [e["new_state"] for e in logs if e["event"] == "lease_reclaimed"] == ["cancelled"]
    assert engine.claim("w2") is None
    assert [name for name, _, _ in event_log(first.id)] == [
        "claimed",
        "cancel_requested",
        "heartbeat_missed",
        "reclaimed",
    ]


def test_a_job_queued_with_a_cancel_request_its_attempt_missed_is_cancelled_unrun(
    run_worker, tmp_path
) -> None:
    """The attempt's retry settle was decided a moment before the request reached its
    worker: the job went back to the queue with the request. Its next claim cancels it
    without running the handler."""
    ran = tmp_path / "ran"  # the handler writes it first thing
    enqueueing.enqueue("test.cancellable", {"marker": str(ran)})
    claimed = claim_one("w1")
    assert operations.cancel(claimed.id).state == State.RUNNING
    engine.settle_and_claim(claimed, engine.failed(claimed, failure(), 0), None, None)
    assert Job.objects.get(pk=claimed.id).state == State.QUEUED

    with capture_logs() as logs:
        assert run_worker() == 1
    job = Job.objects.get(pk=claimed.id)
    assert (job.state, job.attempts) == (State.CANCELLED, 1)  # the unrun claim is uncharged
    assert job.last_error.startswith("cancelled on request, made while an earlier attempt")
    assert [e.get("before_run") for e in logs if e["event"] == "job_cancelled"] == [True]
    assert not ran.exists()
    second = Lease.objects.get(job_id=job.pk, lease_token=2)
    assert (second.outcome, second.settled_state) == (Outcome.CANCELLED, State.CANCELLED)


def test_a_failed_attempt_after_a_cancel_request_ends_the_job_cancelled(run_worker) -> None:
    """The handler heard the request, did not check it, and failed: the job is cancelled,
    not retried (it ran again, up to its max_attempts, each attempt ignoring the cancel).
    The attempt keeps its own outcome and error."""
    job = enqueueing.enqueue("test.cancelled_then_fail")
    with capture_logs() as logs:
        assert run_worker() == 1
    job = Job.objects.get(pk=job.pk)
    assert (job.state, job.attempts, job.cancel_requested) == (State.CANCELLED, 1, True)
    assert job.finished_at is not None
    assert job.last_error == (
        "cancelled on request; its attempt ended without stopping: "
        "RuntimeError: kept going and failed (attempt 1)"
    )
    lease = Lease.objects.get(job_id=job.pk)
    assert (lease.outcome, lease.error_class) == (Outcome.FAILED, "RuntimeError")
    assert lease.settled_state == State.CANCELLED
    [cancelled] = [e for e in logs if e["event"] == "job_cancelled"]
    assert cancelled["after"] == "job_retry_scheduled"
    assert not [e for e in logs if e["event"] in ("job_retry_scheduled", "cancel_not_honoured")]


@pytest.mark.django_db(transaction=True)
def test_a_cancel_racing_a_retry_settle_still_cancels_the_job(monkeypatch) -> None:
    """The running attempt fails and goes back to ``queued`` between the cancel's first
    guarded statement (queued -> cancelled: no match yet) and its last (running ->
    cancel_requested: no match any more). The cancel looks again and cancels it; it used
    to refuse, saying the queued job "has finished" (audit). PostgreSQL only: there an
    UPDATE matching nothing locks nothing, so a worker commits in between; on SQLite the
    cancel's write transaction keeps every other writer out."""
    if not sql.is_postgres():
        pytest.skip("SQLite's single writer rules this interleaving out")
    job = enqueueing.enqueue("test.fail")  # max_attempts=3: a failed attempt is retried
    claimed = claim_one()
    original = django_query.QuerySet.__bool__
    fired: list[bool] = []

    def settle_meanwhile(self: Any) -> bool:
        if not fired and self.model is Job:  # the cancel's first look after statement one
            fired.append(True)
            worker = threading.Thread(target=_fail_and_close, args=(claimed,))
            worker.start()
            worker.join()
        return original(self)

    monkeypatch.setattr(django_query.QuerySet, "__bool__", settle_meanwhile)
    assert operations.cancel(job.pk, actor="tester").state == State.CANCELLED
    assert fired
    assert Job.objects.get(pk=job.pk).state == State.CANCELLED


def _fail_and_close(claimed: Claimed) -> None:
    """A worker's retry settle, on a connection of its own."""
    try:
        engine.fail(claimed, failure(), 0)
    finally:
        connections.close_all()
