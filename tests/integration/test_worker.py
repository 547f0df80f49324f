"""The worker loop in-process: handlers run, settle, retry, die and fence correctly."""

import threading

import pytest
from django.db import connection
from django.db.models.functions import Now
from structlog.testing import capture_logs

from jobs import InvalidJob, context, engine, enqueueing
from jobs.context import JobContext
from jobs.models import Job, Lease, Outcome, State, Worker
from tests.testapp.models import Effect

from .helpers import claim_one, expire_lease, run, run_json

pytestmark = pytest.mark.django_db(transaction=True)


def test_jobs_succeed_retry_and_die(run_worker):
    ok = enqueueing.enqueue("test.echo", {"x": 1})
    flaky = enqueueing.enqueue("test.flaky", {"fail_times": 2})
    doomed = enqueueing.enqueue("test.fail", {"message": "disk full"})
    permanent = enqueueing.enqueue("test.permanent")
    assert run_worker() == 1 + 3 + 3 + 1
    assert Job.objects.get(pk=ok.pk).result == {"args": {"x": 1}, "attempt": 1}
    flaky_job = Job.objects.get(pk=flaky.pk)
    assert (flaky_job.state, flaky_job.result, flaky_job.attempts) == (State.SUCCEEDED, 3, 3)
    dead = Job.objects.get(pk=doomed.pk)
    assert (dead.state, dead.attempts) == (State.DEAD, 3)
    assert dead.last_error == "RuntimeError: disk full (attempt 3)"
    leases = list(dead.leases.order_by("lease_token"))
    assert [lease.error_class for lease in leases] == ["RuntimeError"] * 3
    assert all('raise RuntimeError(f"{message}' in lease.traceback for lease in leases)
    assert leases[0].context["job_id"] == dead.pk
    assert leases[0].context["lease_token"] == 1
    perm = Job.objects.get(pk=permanent.pk)
    assert (perm.state, perm.attempts) == (State.DEAD, 1)
    assert perm.last_error.startswith("jobs.exceptions.PermanentError")


def test_args_that_do_not_fit_the_handler_are_refused_at_enqueue():
    """A job that could only die at its first run is bad input (audit): an argument the
    handler does not take, or a required one missing; for a batch, which job."""
    with pytest.raises(InvalidJob, match=r"args do not match handler 'test\.flaky': .*unexpected"):
        enqueueing.enqueue("test.flaky", {"fail_times": 1, "unexpected": 1})
    with pytest.raises(InvalidJob, match="missing a required keyword-only argument: 'fail_times'"):
        enqueueing.enqueue("test.flaky", {})
    with pytest.raises(InvalidJob, match=r"^job 1 of 2: args do not match handler"):
        enqueueing.enqueue_many("test.flaky", [{"fail_times": 1}, {}])
    assert not Job.objects.exists()


def test_args_a_handler_no_longer_takes_are_a_permanent_error(run_worker):
    """A job enqueued for an earlier release of its handler, whose args it no longer takes."""
    job = enqueueing.enqueue("test.flaky", {"fail_times": 0})
    Job.objects.filter(pk=job.pk).update(args={"unexpected": 1})
    run_worker()
    job = Job.objects.get(pk=job.pk)
    assert job.state == State.DEAD and job.attempts == 1
    assert "args do not match handler" in job.last_error


def test_a_kind_without_handler_waits_uncharged_for_a_worker_that_knows_it(run_worker):
    """New code enqueued a kind this worker has no handler for: it is not claimed (not
    charged, not killed); queue_status names it; a worker that knows the kind runs it."""
    job = enqueueing.enqueue("test.echo")
    other = enqueueing.enqueue("test.echo")
    Job.objects.filter(pk=job.pk).update(kind="vanished.kind")
    assert run_worker(worker_id="old-code") == 1  # only the job it knows
    job = Job.objects.get(pk=job.pk)
    assert (job.state, job.attempts, job.lease_token) == (State.QUEUED, 0, 0)
    assert Job.objects.get(pk=other.pk).state == State.SUCCEEDED
    assert engine.claim("w", kinds=["test.echo"]) is None
    # A (stopped) worker that knew it does not count: only live workers serve.
    Worker.objects.create(id="gone", host="h", pid=1, kinds=["vanished.kind"], stopped_at=Now())
    Worker.objects.create(id="live", host="h", pid=2, kinds=["test.echo"])
    unserved = run_json("queue_status")["unserved_kinds"]
    assert [(u["kind"], u["lane"], u["queued"], u["reason"]) for u in unserved] == [
        ("vanished.kind", "default", 1, "no live worker has a handler for it")
    ]
    # A worker that knows the kind but serves other lanes: the lane is what is missing.
    Worker.objects.create(id="other-lane", host="h", pid=4, kinds=None, lanes=["bulk"])
    [unserved] = run_json("queue_status")["unserved_kinds"]
    assert unserved["reason"] == "the live workers with its handler do not serve lane default"
    assert f"in lane default: {unserved['reason']}" in run("queue_status")
    Worker.objects.filter(pk="other-lane").delete()
    Worker.objects.create(id="new-code", host="h", pid=3, kinds=["test.echo", "vanished.kind"])
    assert run_json("queue_status")["unserved_kinds"] == []
    claimed = engine.claim("new-code", kinds=["vanished.kind"])
    assert claimed is not None and (claimed.id, claimed.attempt) == (job.pk, 1)


def test_effects_in_atomic_complete_land_exactly_once(run_worker):
    jobs = enqueueing.enqueue_many("test.effect", [{} for _ in range(5)])
    run_worker()
    for job in jobs:
        assert Job.objects.get(pk=job.pk).state == State.SUCCEEDED
        assert Effect.objects.filter(job_id=job.pk, label="complete").count() == 1


def test_every_transition_logs_one_event_with_the_job_bound(run_worker):
    job = enqueueing.enqueue("test.flaky", {"fail_times": 1})
    with capture_logs() as logs:
        run_worker(worker_id="w-log")
    events = [entry for entry in logs if entry.get("job_id") == job.pk]
    names = [entry["event"] for entry in events]
    assert names == ["job_claimed", "job_retry_scheduled", "job_claimed", "job_succeeded"]
    for entry in events:
        assert entry["kind"] == "test.flaky" and entry["lane"] == "default"
        assert entry["lease_token"] == entry["attempt"]
    assert events[0]["worker_id"] == "w-log"


def test_stale_attempt_cannot_commit_domain_writes():
    """I2: a ctx.atomic() block of a reclaimed attempt rolls back entirely."""
    enqueueing.enqueue("test.effect")
    old = claim_one("old")
    ctx = JobContext(old, "old")
    expire_lease(old.id)
    engine.reclaim_expired()
    new = claim_one("new")
    with pytest.raises(engine.LeaseLost), ctx.atomic(complete=True):
        Effect.objects.create(job_id=old.id, attempt=1, lease_token=1, label="stale")
    assert ctx.lease_lost
    assert not Effect.objects.exists()
    with JobContext(new, "new").atomic(complete=True, result="ok"):
        Effect.objects.create(job_id=new.id, attempt=2, lease_token=2, label="complete")
    assert Job.objects.get().state == State.SUCCEEDED
    assert list(Effect.objects.values_list("label", flat=True)) == ["complete"]


def test_atomic_complete_then_normal_return_does_not_settle_twice(run_worker):
    job = enqueueing.enqueue("test.effect")
    run_worker()
    assert Lease.objects.get(job_id=job.pk).outcome == Outcome.SUCCEEDED
    assert Job.objects.get(pk=job.pk).result == "done"


def test_a_handler_cancelling_its_job_unasked_says_so_with_its_reason(run_worker):
    job = enqueueing.enqueue("test.misuse", {"how": "cancel_itself"})
    with capture_logs() as logs:
        run_worker()
    job = Job.objects.get(pk=job.pk)
    assert (job.state, job.attempts) == (State.CANCELLED, 1)
    assert job.last_error == "cancelled by its handler: its source was removed"
    [event] = [e for e in logs if e["event"] == "job_cancelled"]
    assert event["by"] == "handler" and event["reason"] == job.last_error
    assert not [e for e in logs if e["event"] == "cancel_not_honoured"]


def test_progress_is_recorded_and_fenced(monkeypatch):
    monkeypatch.setattr(context, "PROGRESS_INTERVAL", 0.0)  # no throttle: every call writes
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    ctx = JobContext(claimed, "w1")
    ctx.progress(3, 10, "pages")
    assert Job.objects.get().progress == {"done": 3, "total": 10, "note": "pages"}
    engine.complete(claimed)
    with pytest.raises(engine.LeaseLost):
        ctx.progress(4, 10)


@pytest.mark.postgres
def test_concurrent_claims_never_share_a_job():
    """I1 under contention: 4 threads claim 200 jobs; every job is claimed exactly once."""
    enqueueing.enqueue_many("test.noop", [{} for _ in range(200)])
    claimed: list[int] = []
    lock = threading.Lock()

    def claimer(name: str) -> None:
        try:
            while (job := engine.claim(name)) is not None:
                with lock:
                    claimed.append(job.id)
        finally:
            connection.close()

    threads = [threading.Thread(target=claimer, args=(f"t{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(claimed) == 200 and len(set(claimed)) == 200
    assert Job.objects.filter(state="running", attempts=1, lease_token=1).count() == 200


def test_a_completion_that_rolls_back_logs_no_success():
    """``job_succeeded`` was written inside the completing transaction: a handler whose own
    ``transaction.atomic()`` around ``ctx.atomic(complete=True)`` then failed showed a
    success that never committed (helper-29 #9). It is written at the commit."""
    from django.db import transaction

    job = enqueueing.enqueue("test.echo")
    ctx = JobContext(claim_one(), "w1")
    with capture_logs() as logs:
        with pytest.raises(RuntimeError), transaction.atomic():
            with ctx.atomic(complete=True, result={"first": True}):
                pass
            raise RuntimeError("the handler's own block fails after the completion")
        assert Job.objects.get(pk=job.pk).state == State.RUNNING
        assert [e for e in logs if e["event"] == "job_succeeded"] == []
        with ctx.atomic(complete=True, result={"second": True}):
            pass
    [line] = [e for e in logs if e["event"] == "job_succeeded"]
    assert line["job_id"] == job.pk
    assert Job.objects.get(pk=job.pk).result == {"second": True}
