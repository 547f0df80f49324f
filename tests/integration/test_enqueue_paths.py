"""Enqueue's fast paths: one statement per batch on PostgreSQL (several pipelined, the
wake-up inside the first), one executemany on SQLite. The jobs returned are the rows
written, in order, with their locks and options; bad input is refused as before."""

from datetime import timedelta
from unittest import mock

import psycopg
import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from jobs import InvalidJob, enqueueing, sql
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


# --- COPY: large batches on PostgreSQL ---------------------------------------------------

# Columns that differ between two calls by nature (each job's own, or the call's clock).
OWN = {"id", "args", "locks", "run_at", "created_at", "updated_at"}


@pytest.fixture
def copied(monkeypatch: pytest.MonkeyPatch) -> int:
    """Batches of 20 jobs or more go through COPY, seven rows a write."""
    monkeypatch.setattr(sql, "COPY_THRESHOLD", 20)
    monkeypatch.setattr(sql, "COPY_CHUNK", 7)
    return 20


def _columns(job_id: int) -> dict[str, object]:
    """A row as the database holds it, every column."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM jobs_job WHERE id = %s", [job_id])
        names = [column.name for column in cursor.description]
        return dict(zip(names, cursor.fetchone(), strict=True))


def _same_call(rows: list[dict[str, object]]) -> None:
    """The rows of one call share its clock: created_at = updated_at, one run_at."""
    assert len({(row["created_at"], row["updated_at"], row["run_at"]) for row in rows}) == 1
    assert rows[0]["created_at"] == rows[0]["updated_at"]


@pytest.mark.postgres
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"priority": -3, "delay": timedelta(minutes=5), "max_attempts": 4, "lease_seconds": 7.5},
        {"lane": "default", "delay": 0.25},
    ],
)
def test_copy_writes_the_rows_the_statement_writes(options):
    """25,000 jobs through COPY: ids ascending in the caller's order, and every column as
    the one-statement path writes it (compared with a small batch through that path)."""
    count = 25_000
    assert count >= sql.COPY_THRESHOLD > 3
    args = [
        {"resources": [f"item:{i % 3}", "shared"], "i": i, "s": "tab\t\\ é"} for i in range(count)
    ]
    copied_jobs = enqueue_many("test.locked", args, **options)
    plain_jobs = enqueue_many("test.locked", args[:3], **options)  # one statement
    assert [job.args["i"] for job in copied_jobs] == list(range(count))
    ids = [job.pk for job in copied_jobs]
    assert ids == sorted(ids) and len(set(ids)) == count
    assert Job.objects.filter(pk__in=ids).count() == count
    copied_rows = [_columns(job.pk) for job in copied_jobs[:3]] + [_columns(ids[-1])]
    plain_rows = [_columns(job.pk) for job in plain_jobs]
    for copied_row, plain_row in zip(copied_rows, plain_rows, strict=False):
        assert {k: v for k, v in copied_row.items() if k not in OWN} == {
            k: v for k, v in plain_row.items() if k not in OWN
        }
        assert (copied_row["args"], copied_row["locks"]) == (plain_row["args"], plain_row["locks"])
    for rows in (copied_rows, plain_rows):
        _same_call(rows)
        delay = rows[0]["run_at"] - rows[0]["created_at"]  # type: ignore[operator]
        expected = options.get("delay", 0)
        assert delay == (
            expected if isinstance(expected, timedelta) else timedelta(seconds=expected)
        )
    assert copied_rows[0]["created_at"] < plain_rows[0]["created_at"]
    assert_rows_match(copied_jobs[:50] + copied_jobs[-50:])


@pytest.mark.postgres
def test_copy_with_run_at_and_no_locks(copied):
    when = timezone.now() + timedelta(hours=2)
    jobs = enqueue_many("test.echo", [{"n": n} for n in range(30)], run_at=when, priority=2)
    assert {job.run_at for job in Job.objects.filter(pk__in=[job.pk for job in jobs])} == {when}
    assert all(job.locks == [] for job in jobs)
    assert_rows_match(jobs)


@pytest.mark.postgres
def test_a_rolled_back_caller_keeps_no_copied_batch(copied):
    with pytest.raises(RuntimeError), transaction.atomic():
        enqueue_many("test.echo", [{"n": n} for n in range(40)])
        raise RuntimeError("caller rolls back")
    assert not Job.objects.exists()


@pytest.mark.postgres
def test_bad_args_deep_in_a_copied_batch_write_nothing(copied):
    args = [{"n": n} for n in range(40)]
    args[33] = {"s": "nul \x00 here"}
    with pytest.raises(InvalidJob, match="contain a NUL character"):
        enqueue_many("test.echo", args)
    assert not Job.objects.exists()


@pytest.mark.postgres
def test_a_failure_in_the_middle_of_a_copy_leaves_no_row_and_the_caller_usable(copied):
    """The server refuses a row in the middle of the COPY (its id is taken): nothing of the
    batch stays, and inside the caller's transaction only the batch's savepoint is lost.
    A failure on this side in the middle (building the jobs) ends the COPY the same way."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT nextval(pg_get_serial_sequence('jobs_job', 'id'))")
        (last,) = cursor.fetchone()
    squatter = Job.objects.create(id=last + 30, kind="test.echo", args={"squatter": True})
    with transaction.atomic():
        mine = enqueue("test.echo", {"mine": True})
        with pytest.raises(IntegrityError):
            enqueue_many("test.echo", [{"n": n} for n in range(40)])
        assert set(Job.objects.values_list("pk", flat=True)) == {squatter.pk, mine.pk}
    assert set(Job.objects.values_list("pk", flat=True)) == {squatter.pk, mine.pk}

    calls = 0
    real = enqueueing._add_jobs

    def fail_third(*args: object, **kwargs: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("this side fails mid-COPY")
        real(*args, **kwargs)  # type: ignore[arg-type]

    with mock.patch.object(enqueueing, "_add_jobs", fail_third), pytest.raises(RuntimeError):
        enqueue_many("test.echo", [{"n": n} for n in range(40)])
    assert set(Job.objects.values_list("pk", flat=True)) == {squatter.pk, mine.pk}
    assert len(enqueue_many("test.echo", [{"n": n} for n in range(40)])) == 40  # usable


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_copy_wake_up_is_delivered_once_and_only_on_commit(copied):
    channels, payload = _wake_up("default", None, None), "default"
    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as listener:
        for channel in channels:
            listener.execute(f"LISTEN {channel}")

        def heard() -> list[tuple[str, str]]:
            notes = listener.notifies(timeout=0.5, stop_after=10)
            return sorted((note.channel, note.payload) for note in notes)

        with pytest.raises(RuntimeError), transaction.atomic():
            enqueue_many("test.echo", [{"n": n} for n in range(40)])
            raise RuntimeError("caller rolls back")
        assert heard() == []
        jobs = enqueue_many("test.echo", [{"n": n} for n in range(40)])  # its own transaction
        assert len(jobs) == 40
        assert heard() == sorted((channel, payload) for channel in channels)
        enqueue_many("test.echo", [{"n": n} for n in range(40)], delay=60)
        assert heard() == []  # a delayed batch wakes no one now
        with transaction.atomic():
            enqueue_many("test.echo", [{"n": n} for n in range(40)])
            assert heard() == []  # not before the caller commits
        assert heard() == sorted((channel, payload) for channel in channels)
