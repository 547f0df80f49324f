"""Enqueue: transactional, validated, deduplicated, routed to lanes."""

from datetime import datetime, timedelta

import pytest
from django.db import transaction
from django.test import override_settings
from django.utils import timezone
from structlog.testing import capture_logs

from jobs import InvalidJob, LaneFull, LaneRefused, UnknownKind
from jobs.enqueueing import enqueue, enqueue_many
from jobs.models import Job, State

pytestmark = pytest.mark.django_db


def test_job_exists_only_if_the_callers_transaction_commits():
    with pytest.raises(RuntimeError), transaction.atomic():
        enqueue("test.echo", {"a": 1})
        raise RuntimeError("caller rolls back")
    assert Job.objects.count() == 0
    with transaction.atomic():
        job = enqueue("test.echo", {"a": 1})
    assert Job.objects.get().pk == job.pk


def test_defaults_come_from_the_handler_and_the_database_clock():
    job = enqueue("test.fail")
    assert job.state == State.QUEUED
    assert job.max_attempts == 3  # the handler's max_attempts
    assert job.lease_seconds == 60
    assert job.run_at is not None and job.created_at is not None
    assert enqueue("test.echo").max_attempts == 10  # DESIGN default


def test_unique_key_returns_the_active_job_and_frees_up_when_it_finishes():
    first = enqueue("test.echo", {"n": 1}, unique_key="k")
    again = enqueue("test.echo", {"n": 2}, unique_key="k")
    assert again.pk == first.pk
    assert Job.objects.count() == 1
    Job.objects.filter(pk=first.pk).update(state=State.SUCCEEDED)
    third = enqueue("test.echo", {"n": 3}, unique_key="k")
    assert third.pk != first.pk


def test_enqueue_many_returns_jobs_in_order():
    jobs = enqueue_many("test.echo", [{"i": i} for i in range(250)], priority=3)
    assert [job.args["i"] for job in jobs] == list(range(250))
    assert all(job.pk and job.priority == 3 and job.run_at for job in jobs)
    assert Job.objects.filter(state=State.QUEUED).count() == 250


@pytest.mark.parametrize(
    ("kind", "args", "options", "error"),
    [
        ("no.such.kind", {}, {}, UnknownKind),
        ("test.echo", ["not", "an", "object"], {}, InvalidJob),
        ("test.echo", {"when": datetime.now()}, {}, InvalidJob),
        ("test.echo", {}, {"run_at": datetime(2030, 1, 1)}, InvalidJob),  # naive
        ("test.echo", {}, {"delay": 5, "run_at": timezone.now()}, InvalidJob),
        ("test.echo", {}, {"delay": -1}, InvalidJob),
        ("test.echo", {}, {"max_attempts": 0}, InvalidJob),
        ("test.echo", {}, {"priority": 10**6}, InvalidJob),
        ("test.echo", {}, {"priority": True}, InvalidJob),  # PostgreSQL: a raw cast error
        ("test.echo", {}, {"lane": "nowhere"}, LaneRefused),
    ],
)
def test_bad_enqueues_are_refused_and_nothing_is_written(kind, args, options, error):
    with pytest.raises(error):
        enqueue(kind, args, **options)
    assert Job.objects.count() == 0


def test_delay_and_run_at_put_the_job_in_the_future():
    delayed = enqueue("test.echo", delay=timedelta(hours=1))
    at = enqueue("test.echo", run_at=timezone.now() + timedelta(days=1))
    assert delayed.run_at > delayed.created_at + timedelta(minutes=59)
    assert at.run_at > timezone.now() + timedelta(hours=23)


LANES = {
    "default": {},
    "media": {"kinds": ["photo.*", "test.echo"], "max_queued": 2},
    "bulk": {"kinds": ["test.noop"], "max_queued": 1, "on_full": "drop"},
}


@override_settings(HOLDFAST_LANES=LANES)
def test_lanes_route_refuse_and_bound():
    assert enqueue("test.echo").lane == "media"  # first lane whose patterns match
    assert enqueue("test.fail").lane == "default"
    assert enqueue("test.echo", lane="default").lane == "default"  # explicit wins
    with pytest.raises(LaneRefused, match="does not accept"):
        enqueue("test.fail", lane="media")
    enqueue("test.echo")
    with pytest.raises(LaneFull):
        enqueue("test.echo")
    assert enqueue("test.noop") is not None
    assert enqueue("test.noop") is None  # dropped, not raised
    assert Job.objects.filter(lane="bulk").count() == 1


@override_settings(HOLDFAST_LANES=LANES)
def test_a_batch_too_big_for_a_lane_says_how_much_room_is_left():
    """It said the lane "is full (0 of 2 queued)", and nothing was logged (audit)."""
    with capture_logs() as logs, pytest.raises(LaneFull) as refused:
        enqueue_many("test.echo", [{}, {}, {}])
    assert str(refused.value) == (
        "lane 'media' has room for 2 more jobs (0 of 2 queued), not 3: nothing enqueued"
    )
    [line] = [e for e in logs if e["event"] == "lane_full"]
    assert (line["log_level"], line["lane"], line["error"]) == (
        "warning",
        "media",
        str(refused.value),
    )
    assert not Job.objects.exists()
    assert len(enqueue_many("test.echo", [{}, {}])) == 2


@override_settings(HOLDFAST_LANES=LANES)
def test_a_full_lane_returns_the_job_holding_a_repeated_unique_key():
    """Only new jobs count against ``max_queued``: a key already held adds nothing. A
    repeat was refused with ``LaneFull``, and on a ``drop`` lane answered ``None``
    ("dropped") although its job existed (helper-29 #3)."""
    first = enqueue("test.echo", unique_key="a")
    enqueue("test.echo", unique_key="b")  # the lane is full now
    assert enqueue("test.echo", unique_key="a").pk == first.pk
    held = enqueue_many("test.echo", [{}, {}], unique_keys=["b", "a"])
    assert [job.unique_key for job in held] == ["b", "a"]
    with pytest.raises(LaneFull, match=r"is full \(2 of 2 queued\)"):
        enqueue_many("test.echo", [{}, {}], unique_keys=["a", "c"])
    dropped_lane = enqueue("test.noop", unique_key="n")
    assert enqueue("test.noop", unique_key="n").pk == dropped_lane.pk
    assert enqueue("test.noop", unique_key="other") is None
    assert Job.objects.count() == 3


def test_enqueue_many_with_unique_keys_dedupes_each_job_in_bulk(django_assert_max_num_queries):
    held = enqueue("test.echo", {"n": 1}, unique_key="k1")
    finished = enqueue("test.echo", {"n": 2}, unique_key="k2")
    Job.objects.filter(pk=finished.pk).update(state=State.SUCCEEDED)  # frees its key
    keys = ["k1", "k2", "k3", "k3"] + [f"bulk:{i}" for i in range(500)]
    with django_assert_max_num_queries(12):  # bounded, whatever the count
        jobs = enqueue_many("test.echo", [{"n": i} for i in range(len(keys))], unique_keys=keys)
    assert jobs[0].pk == held.pk  # an active holder is returned
    assert jobs[1].pk != finished.pk and jobs[1].args == {"n": 1}  # a finished one is not
    assert jobs[2].pk == jobs[3].pk  # one key, one job, even within the call
    assert [job.unique_key for job in jobs] == keys
    assert Job.objects.filter(state=State.QUEUED).count() == 1 + 2 + 500
    again = enqueue_many("test.echo", [{}, {}], unique_keys=["bulk:7", "bulk:8"])
    assert [job.pk for job in again] == [jobs[11].pk, jobs[12].pk]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unique_keys": ["only-one"]}, "one key per job"),
        ({"unique_keys": ["a", ""]}, "1 to 255"),
        ({"unique_keys": ["a", "b" * 256]}, "1 to 255"),
        ({"unique_keys": ["a", "b"], "unique_key": "c"}, "not both"),
        ({"unique_key": "c"}, "one job"),
    ],
)
def test_bad_unique_keys_are_refused(options, message):
    with pytest.raises(InvalidJob, match=message):
        enqueue_many("test.echo", [{}, {}], **options)
    assert not Job.objects.exists()


@override_settings(HOLDFAST_LANES=LANES)
def test_a_continuation_is_not_refused_by_a_full_lane():
    """The rest of admitted work (the enqueuing job completes in the same transaction):
    neither ``reject`` nor ``drop`` applies to it; new work is still bounded."""
    enqueue("test.echo")
    enqueue("test.echo")
    with pytest.raises(LaneFull):
        enqueue("test.echo")
    assert enqueue("test.echo", continuation=True).lane == "media"
    enqueue("test.noop")
    assert enqueue("test.noop") is None
    assert enqueue("test.noop", continuation=True).lane == "bulk"
