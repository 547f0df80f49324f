"""An attempt's lease row is written once, when the attempt ends (jobs.attempts): while it
runs, the job row records it; the settle, a release or a reclaim writes the row complete.
A row a worker of an earlier release inserted at claim is completed, never doubled. Both
databases."""

from __future__ import annotations

import pytest
from django.utils import timezone

from jobs import attempts, engine, enqueueing
from jobs.events import events
from jobs.models import Job, Lease, Outcome, State
from jobs.serialization import job_detail_dict

from .helpers import claim_one, expire_lease, failure

pytestmark = pytest.mark.django_db(transaction=True)


def legacy_row(job: Job) -> Lease:
    """The lease row a worker of 0.2 inserted with its claim."""
    return Lease.objects.create(
        job=job,
        attempt=job.attempts,
        lease_token=job.lease_token,
        worker_id=job.leased_by or "",
        acquired_at=job.started_at or timezone.now(),
        expires_at=job.lease_expires_at or timezone.now(),
        outcome=Outcome.RUNNING,
    )


def test_a_running_attempt_is_shown_from_the_job_row():
    enqueueing.enqueue("test.echo")
    claimed = claim_one("w-running")
    job = Job.objects.get(pk=claimed.id)
    data = job_detail_dict(job)
    (lease,) = data["leases"]
    assert (lease["attempt"], lease["lease_token"], lease["worker_id"]) == (1, 1, "w-running")
    assert lease["outcome"] == "running" and lease["released_at"] is None
    assert [event["event"] for event in data["events"]] == ["claimed"]


def test_the_settle_writes_the_attempt_complete():
    enqueueing.enqueue("test.echo")
    claimed = claim_one("w-settle")
    started = Job.objects.get(pk=claimed.id).started_at
    engine.fail(claimed, failure("first"), backoff_seconds=0)
    engine.complete(claim_one("w-settle"), {"ok": True})
    first, second = Lease.objects.filter(job_id=claimed.id).order_by("lease_token")
    assert (first.attempt, first.outcome, first.error_message) == (1, Outcome.FAILED, "first")
    assert first.acquired_at == started and first.worker_id == "w-settle"
    assert first.released_at is not None and first.settled_state == State.QUEUED
    assert (second.attempt, second.outcome, second.settled_state) == (2, "succeeded", "succeeded")
    names = [event.event for event in events(claimed.id)]
    assert names == ["claimed", "settled", "claimed", "settled"]


def test_a_row_an_earlier_release_wrote_at_claim_is_completed_by_the_settle():
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    legacy_row(Job.objects.get(pk=claimed.id))
    engine.complete(claimed, {"ok": True})
    (lease,) = Lease.objects.filter(job_id=claimed.id)
    assert (lease.outcome, lease.settled_state) == (Outcome.SUCCEEDED, State.SUCCEEDED)
    assert lease.released_at is not None
    assert [event.event for event in events(claimed.id)] == ["claimed", "settled"]


@pytest.mark.parametrize("legacy", [False, True])
def test_a_reclaim_writes_the_attempt_as_its_workers_death(legacy: bool):
    enqueueing.enqueue("test.echo")
    claimed = claim_one("w-dead")
    job = Job.objects.get(pk=claimed.id)
    if legacy:
        legacy_row(job)
    expire_lease(claimed.id)
    engine.reclaim_expired()
    (lease,) = Lease.objects.filter(job_id=claimed.id)
    assert (lease.outcome, lease.error_class) == (Outcome.LEASE_EXPIRED, "LeaseExpired")
    assert "worker w-dead stopped renewing lease 1" in lease.error_message
    assert (lease.attempt, lease.worker_id, lease.acquired_at) == (1, "w-dead", job.started_at)
    assert lease.released_at is not None
    assert Job.objects.get(pk=claimed.id).state == State.QUEUED
    assert [each.lease_token for each in attempts.leases(Job.objects.get(pk=claimed.id))] == [1]
