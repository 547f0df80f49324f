"""``ctx.progress`` is throttled (one write per PROGRESS_INTERVAL) and never loses the last
value: the next write, the next fenced block, or the worker's settle carries it."""

from __future__ import annotations

import pytest

from jobs import context, enqueueing
from jobs.context import JobContext
from jobs.models import Job, JobEvent

from .helpers import claim_one

pytestmark = pytest.mark.django_db


def progress_events(job_id: int) -> list[dict]:
    return list(
        JobEvent.objects.filter(job_id=job_id, event="progress")
        .order_by("pk")
        .values_list("data", flat=True)
    )


def test_a_burst_of_progress_writes_once_then_keeps_the_last_value():
    job = enqueueing.enqueue("test.echo")
    ctx = JobContext(claim_one(), "w1")
    for done in range(1, 101):
        ctx.progress(done, 100, f"item {done}")
    assert len(progress_events(job.pk)) == 1, "one write for the burst"
    assert Job.objects.get(pk=job.pk).progress == {"done": 1, "total": 100, "note": "item 1"}
    ctx.flush_progress()
    assert Job.objects.get(pk=job.pk).progress == {"done": 100, "total": 100, "note": "item 100"}
    assert len(progress_events(job.pk)) == 2
    ctx.flush_progress()  # nothing pending: no write
    assert len(progress_events(job.pk)) == 2


def test_the_last_value_commits_with_the_completion(monkeypatch):
    monkeypatch.setattr(context, "PROGRESS_INTERVAL", 3600.0)
    job = enqueueing.enqueue("test.echo")
    ctx = JobContext(claim_one(), "w1")
    ctx.progress(1, 3)
    ctx.progress(3, 3, "done")
    with ctx.atomic(complete=True, result={"ok": True}):
        pass
    finished = Job.objects.get(pk=job.pk)
    assert finished.state == "succeeded"
    assert finished.progress == {"done": 3, "total": 3, "note": "done"}


def test_a_rolled_back_block_keeps_the_pending_value(monkeypatch):
    monkeypatch.setattr(context, "PROGRESS_INTERVAL", 3600.0)
    job = enqueueing.enqueue("test.echo")
    ctx = JobContext(claim_one(), "w1")
    ctx.progress(1, 2)
    ctx.progress(2, 2)
    with pytest.raises(RuntimeError), ctx.atomic():
        raise RuntimeError("the block fails")
    assert Job.objects.get(pk=job.pk).progress == {"done": 1, "total": 2, "note": ""}
    ctx.flush_progress()
    assert Job.objects.get(pk=job.pk).progress == {"done": 2, "total": 2, "note": ""}


def test_the_worker_writes_the_last_value_before_it_settles(run_worker, monkeypatch):
    monkeypatch.setattr(context, "PROGRESS_INTERVAL", 3600.0)
    job = enqueueing.enqueue("test.cancellable", {"seconds": 0.35})
    assert run_worker() == 1
    finished = Job.objects.get(pk=job.pk)
    assert finished.state == "succeeded"
    events = progress_events(job.pk)
    assert len(events) == 2, events  # the first call, then the last value before the settle
    assert finished.progress["done"] == events[-1]["done"] > 1


def test_progress_rolled_back_with_the_handlers_own_transaction_is_written_again(
    run_worker,
):
    """The progress write joined the handler's transaction, which rolled back: the value
    stays pending and the worker writes it before the settle."""
    job = enqueueing.enqueue("test.misuse", {"how": "progress_rolled_back"})
    assert run_worker() == 1
    finished = Job.objects.get(pk=job.pk)
    assert finished.state == "succeeded"
    assert finished.progress == {"done": 5, "total": 10, "note": "halfway"}
    assert [e["done"] for e in progress_events(job.pk)] == [5]


@pytest.mark.parametrize(
    ("call", "problem"),
    [
        ((float("nan"), 1), "done must be a finite number, not nan"),
        ((1, float("inf")), "total must be a finite number, not inf"),
        (("3", 10), "done must be a number, not '3'"),
        ((True, 10), "done must be a number, not True"),
        ((1, 2, "a\x00b"), "note must not contain a NUL character"),
        ((1, 2, None), "note must be a string, not NoneType"),
    ],
)
def test_a_progress_value_that_cannot_be_stored_is_refused_at_the_call(monkeypatch, call, problem):
    """It was held back by the throttle, then failed the next fenced block with a raw
    database error: the completion rolled back on every attempt until the job was dead
    (helper-29 #2). Refused where the handler made it, the pending value stays good."""
    monkeypatch.setattr(context, "PROGRESS_INTERVAL", 3600.0)
    job = enqueueing.enqueue("test.echo")
    ctx = JobContext(claim_one(), "w1")
    ctx.progress(0, 2)
    ctx.progress(1, 2, "half")
    with pytest.raises(ValueError) as refused:
        ctx.progress(*call)
    assert str(refused.value) == f"ctx.progress(): {problem}"
    with ctx.atomic(complete=True, result={"ok": True}):
        pass
    finished = Job.objects.get(pk=job.pk)
    assert (finished.state, finished.progress) == (
        "succeeded",
        {"done": 1, "total": 2, "note": "half"},
    )


def test_a_long_note_is_cut_and_a_heartbeat_after_the_completion_does_nothing(
    monkeypatch, django_capture_on_commit_callbacks
):
    """DESIGN §5's example heartbeats after its ``complete=True`` block: that raised
    ``LeaseLost`` (a warning on every job) where there is no lease left to renew."""
    monkeypatch.setattr(context, "PROGRESS_INTERVAL", 3600.0)
    job = enqueueing.enqueue("test.echo")
    ctx = JobContext(claim_one(), "w1")
    ctx.progress(1, None, "x" * 5000)
    with django_capture_on_commit_callbacks(execute=True), ctx.atomic(complete=True):
        pass
    ctx.heartbeat()
    finished = Job.objects.get(pk=job.pk)
    assert finished.progress == {"done": 1, "total": None, "note": "x" * 1000}
