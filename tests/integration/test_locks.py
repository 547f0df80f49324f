"""Resource locks (I8): all-or-nothing, canonical order, tied to the lease, never spun on."""

import threading

import psycopg
import pytest
from django.db import IntegrityError, connection

from jobs import InvalidJob, engine, enqueueing, sql
from jobs.context import JobContext
from jobs.models import Job, JobLock, State

from .helpers import claim_one, expire_lease, failure, run_json

pytestmark = pytest.mark.django_db


def locked(*resources: str, **options):
    return enqueueing.enqueue("test.locked", {"resources": list(resources)}, **options)


def held() -> dict[str, int]:
    return dict(JobLock.objects.values_list("resource", "job_id"))


def test_enqueue_stores_the_locks_sorted_and_once():
    job = locked("b", "a", "b")
    assert job.locks == ["a", "b"]
    assert Job.objects.get(pk=job.pk).locks == ["a", "b"]
    assert enqueueing.enqueue("test.echo").locks == []  # a handler without locks


def test_enqueue_many_stores_each_jobs_own_locks():
    jobs = enqueueing.enqueue_many("test.locked", [{"resources": ["x"]}, {"resources": ["y", "x"]}])
    assert [job.locks for job in jobs] == [["x"], ["x", "y"]]
    assert [Job.objects.get(pk=job.pk).locks for job in jobs] == [["x"], ["x", "y"]]


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"resources": None},
        {"resources": "x"},
        {"resources": [""]},
        {"resources": [7]},
        {"resources": ["x" * 256]},
        {"resources": ["holdfast:lane:default:0"]},
    ],
    ids=["missing", "none", "string", "empty-name", "not-a-string", "too-long", "reserved"],
)
def test_locks_that_cannot_be_derived_are_bad_input(args):
    with pytest.raises(InvalidJob, match="lock"):
        enqueueing.enqueue("test.locked", args)
    assert not Job.objects.exists()


def test_claim_takes_all_locks_with_the_job():
    job = locked("item:1", "item:2")
    claimed = claim_one("w1")
    assert claimed.id == job.pk
    assert claimed.locks == ("item:1", "item:2")
    assert held() == {"item:1": job.pk, "item:2": job.pk}
    assert set(JobLock.objects.values_list("lease_token", flat=True)) == {claimed.lease_token}


def test_a_job_whose_locks_are_held_is_skipped_not_waited_on():
    first = locked("item:1")
    blocked = locked("item:1", "item:2")  # shares item:1: must wait
    free = locked("item:3")  # unrelated: runs in parallel
    assert claim_one("w1").id == first.pk
    assert claim_one("w2").id == free.pk  # the blocked job was skipped, in order
    assert engine.claim("w3") is None
    assert Job.objects.get(pk=blocked.pk).state == State.QUEUED
    assert "item:2" not in held()  # all or nothing: no partial acquisition


@pytest.mark.parametrize("outcome", ["succeeded", "failed", "dead", "released", "cancelled"])
def test_every_settle_releases_the_locks_in_the_same_commit(outcome):
    first = locked("item:1")
    waiting = locked("item:1")
    claimed = claim_one()
    if outcome == "succeeded":
        engine.complete(claimed)
    elif outcome in ("failed", "dead"):
        engine.fail(claimed, failure(permanent=outcome == "dead"), backoff_seconds=3600)
    elif outcome == "released":
        engine.release(claimed)
    else:
        engine.cancelled(claimed)
    assert held() == {}
    # A released job is runnable again at once, so either may go next; a finished or
    # delayed one is not.
    expected = {first.pk, waiting.pk} if outcome == "released" else {waiting.pk}
    next_job = claim_one("w2")
    assert next_job.id in expected
    assert held() == {"item:1": next_job.id}


def test_settle_and_claim_hands_the_lock_on_in_order():
    """One worker, a chain of jobs on one resource: each settle lets the next one run."""
    chain = [locked("item:1") for _ in range(3)]
    job = claim_one()
    seen = [job.id]
    for _ in range(2):
        job = engine.settle_and_claim(job, engine.succeeded(), "w1", None) or claim_one()
        seen.append(job.id)
    assert seen == [j.pk for j in chain]


def test_reclaim_frees_the_locks_of_an_expired_lease():
    job = locked("item:1")
    waiting = locked("item:1")
    claimed = claim_one()
    expire_lease(job.pk)
    assert engine.reclaim_expired() == [job.pk]
    assert held() == {}
    next_job = claim_one("w2")
    assert next_job.id in (job.pk, waiting.pk)
    # The old worker's late completion is refused and cannot release the new holder's lock.
    with pytest.raises(engine.LeaseLost):
        engine.complete(claimed)
    assert held() == {"item:1": next_job.id}


def test_a_stale_fenced_write_cannot_touch_a_relocked_resource():
    locked("item:1")
    stale = claim_one()
    expire_lease(stale.id)
    engine.reclaim_expired()
    fresh = claim_one("w2")
    assert fresh.id == stale.id and fresh.lease_token == stale.lease_token + 1
    with pytest.raises(engine.LeaseLost), JobContext(stale, "w1").atomic():
        pass
    assert held() == {"item:1": stale.id}
    assert JobLock.objects.get(resource="item:1").lease_token == fresh.lease_token


def test_show_job_and_queue_status_report_held_locks():
    job = locked("item:2", "item:1")
    claim_one()
    shown = run_json("show_job", str(job.pk))
    assert shown["locks"] == ["item:1", "item:2"]
    assert shown["declared_locks"] == ["item:1", "item:2"]
    assert run_json("queue_status")["locks_held"] == 2


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_claim_that_loses_a_lock_race_rolls_back_and_claims_again():
    """Two claimers pass the 'lock is free' check at once: the key decides, nobody waits.

    A second connection holds an uncommitted lock row (a claimer mid-statement). Our claim
    of a job needing that resource inserts the same key, waits for the other transaction,
    fails on the key when it commits, and retries: the job stays queued, the unrelated job
    is claimed instead, and nothing of the failed attempt (lease, token, event) remains.
    """
    holder = locked("item:1")
    contender = locked("item:1")
    unrelated = locked("item:9")
    settings = connection.settings_dict
    other = psycopg.connect(
        dbname=settings["NAME"],
        user=settings.get("USER") or None,
        host=settings.get("HOST") or None,
        port=settings.get("PORT") or None,
    )
    Job.objects.filter(pk=holder.pk).update(state=State.RUNNING)  # not a candidate
    other.execute(
        "INSERT INTO jobs_joblock (resource, job_id, lease_token, acquired_at) "
        "VALUES ('item:1', %s, 1, now())",
        [holder.pk],
    )
    result: dict = {}

    def claim() -> None:
        try:
            result["job"] = engine.claim("w1")
        finally:
            connection.close()

    claimer = threading.Thread(target=claim)
    claimer.start()
    claimer.join(timeout=1.0)
    assert claimer.is_alive(), "the claim should wait for the other claimer's lock row"
    other.commit()
    claimer.join(timeout=10)
    other.close()
    assert result["job"].id == unrelated.pk
    contender_row = Job.objects.get(pk=contender.pk)
    assert (contender_row.state, contender_row.lease_token) == (State.QUEUED, 0)
    assert not contender_row.leases.exists()
    assert not contender_row.events.exists()
    assert held() == {"item:1": holder.pk, "item:9": unrelated.pk}


@pytest.mark.django_db(transaction=True)
def test_endless_lost_lock_races_never_fail_the_job_being_settled(monkeypatch):
    """The races belong to the next claim: the finished job still settles, nothing is
    claimed this time, and a plain claim gives up quietly instead of raising."""
    job = enqueueing.enqueue("test.echo")
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    real = sql._settle_and_claim_limited

    def always_racing(params, settle, worker_id, lanes, limits, kinds):
        if worker_id is not None:
            raise IntegrityError("duplicate key value violates unique constraint")
        return real(params, settle, worker_id, lanes, limits, kinds)

    monkeypatch.setattr(sql, "_settle_and_claim_limited", always_racing)
    assert engine.settle_and_claim(claimed, engine.succeeded(), "w1", None) is None
    assert Job.objects.get(pk=job.pk).state == State.SUCCEEDED
    assert engine.claim("w1") is None
    assert Job.objects.filter(state=State.QUEUED).count() == 1
