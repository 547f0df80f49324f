"""Enqueue's fast paths: one statement per batch on PostgreSQL (several pipelined, the
wake-up inside the first), one executemany on SQLite. The jobs returned are the rows
written, in order, with their locks and options; bad input is refused as before."""

from datetime import timedelta

import psycopg
import pytest
from django.db import connection, transaction

from jobs import InvalidJob, sql
from jobs.enqueueing import _wake_up, enqueue, enqueue_many
from jobs.models import Job, State
from tests.conftest import database_url

pytestmark = pytest.mark.django_db

FIELDS = [f.attname for f in Job._meta.concrete_fields]


def assert_rows_match(jobs: list[Job]) -> None:
    """Each returned job equals its row as read back, field by field."""
    rows = Job.objects.in_bulk([job.pk for job in jobs])
    assert len(rows) == len(jobs)
    for job in jobs:
        assert {f: getattr(job, f) for f in FIELDS} == {f: getattr(rows[job.pk], f) for f in FIELDS}
        assert not job._state.adding and job._state.db == "default"


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sql, "BULK_INSERT_CHUNK", 7)  # 25 jobs: four statements, pipelined
    return 7


def test_batches_keep_order_locks_and_options(small_batches):
    args = [{"resources": [f"item:{i % 3}", "shared"], "i": i} for i in range(25)]
    jobs = enqueue_many("test.locked", args, priority=4, delay=timedelta(minutes=5))
    assert [job.args["i"] for job in jobs] == list(range(25))
    assert [job.pk for job in jobs] == sorted(job.pk for job in jobs)
    assert jobs[4].locks == ["item:1", "shared"]  # sorted, each once (I8)
    assert all(job.run_at >= job.created_at + timedelta(minutes=4, seconds=59) for job in jobs)
    assert all(job.priority == 4 and job.state == State.QUEUED for job in jobs)
    assert_rows_match(jobs)


@pytest.mark.parametrize("count", [1, 3, 25])
def test_returned_jobs_are_their_rows(small_batches, count):
    jobs = enqueue_many("test.echo", [{"n": n, "text": "tab\there \\ back"} for n in range(count)])
    assert_rows_match(jobs)
    assert_rows_match([enqueue("test.echo", {"one": True}, lane="default", max_attempts=2)])


def test_a_rolled_back_caller_keeps_no_batch(small_batches):
    with pytest.raises(RuntimeError), transaction.atomic():
        enqueue_many("test.echo", [{"n": n} for n in range(25)])
        enqueue("test.echo", {"n": 99})
        raise RuntimeError("caller rolls back")
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([{"a": 1}, {"x": float("nan")}, "not a dict"], "not JSON-serializable"),
        ([{"a": 1}, "not a dict", {"x": float("nan")}], "must be a JSON object, not str"),
        ([{"a": 1}, {"s": "nul \x00 here"}], "contain a NUL character"),
        ([{"s": "lone \ud800"}], "unpaired surrogate"),
        ([{"a": object()}], "not JSON-serializable"),
    ],
)
def test_bad_args_anywhere_in_a_batch_are_refused_as_before(args, message):
    with pytest.raises(InvalidJob, match=message):
        enqueue_many("test.echo", args)
    assert not Job.objects.exists()


def test_escapes_that_only_look_bad_are_stored():
    jobs = enqueue_many("test.echo", [{"s": "\\u0000 and \\ud800 as text"}, {"t": "é ☃"}])
    assert [job.args for job in Job.objects.order_by("pk")] == [job.args for job in jobs]


def test_unique_keys_conflicting_inside_one_batch(small_batches):
    """Keys repeated within one call and keys held already: one job per key."""
    held = enqueue("test.locked", {"resources": ["r:held"]}, unique_key="dup:held")
    keys = [f"dup:{n % 4}" for n in range(12)] + ["dup:held"]
    jobs = enqueue_many(
        "test.locked", [{"resources": [f"r:{n}"]} for n in range(13)], unique_keys=keys
    )
    assert (
        [job.pk for job in jobs[:4]]
        == [job.pk for job in jobs[4:8]]
        == [job.pk for job in jobs[8:12]]
    )
    assert jobs[12].pk == held.pk
    assert [job.locks for job in jobs[:4]] == [["r:0"], ["r:1"], ["r:2"], ["r:3"]]
    assert Job.objects.filter(unique_key__startswith="dup:").count() == 5


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_wake_up_is_sent_with_the_insert_and_only_on_commit(small_batches):
    channels, payload = _wake_up("default", None, None), "default"
    assert _wake_up("default", 60, None) == []  # a delayed job wakes no one now
    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as listener:
        listener.execute(f"LISTEN {channels[0]}")  # the lane's own channel

        def heard() -> list[str]:
            return [note.payload for note in listener.notifies(timeout=0.5, stop_after=10)]

        enqueue("test.echo", {"n": 1})  # outside a transaction: one statement
        assert heard() == [payload]
        with pytest.raises(RuntimeError), transaction.atomic():
            enqueue_many("test.echo", [{"n": n} for n in range(25)])
            raise RuntimeError("caller rolls back")
        assert heard() == []
        enqueue_many("test.echo", [{"n": n} for n in range(25)])  # four statements, one NOTIFY
        assert heard() == [payload]
