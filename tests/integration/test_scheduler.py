"""The scheduler's slot ledger (I5) with travelled time: the tick takes the time as input."""

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from io import StringIO
from zoneinfo import ZoneInfo

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection
from django.test import override_settings
from django.utils import timezone
from structlog.testing import capture_logs

from jobs import engine, enqueueing, operations, refresh, scheduler, schedules, sql
from jobs.exceptions import StateConflict
from jobs.models import Job, Schedule, State
from tests.testapp.models import Document

from .helpers import claim_one, failure

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def quiet_refresh(settings):
    """The test app's refresher declares the built-in refresh schedule; keep it out of
    these tests' ticks by making its interval longer than any travelled time."""
    settings.HOLDFAST_REFRESH_SECONDS = 10**9


NIGHTLY = {"kind": "test.echo", "cron": "0 3 * * *", "timezone": "Europe/Berlin"}
SWEEP = {"kind": "test.noop", "every": 300, "args": {"dir": "incoming"}}


def at(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def schedule(name: str) -> Schedule:
    return Schedule.objects.get(name=name)


def jobs_of(name: str) -> list[Job]:
    return list(Job.objects.filter(unique_key__startswith=f"schedule:{name}:").order_by("pk"))


@override_settings(HOLDFAST_SCHEDULES={"nightly": NIGHTLY})
def test_a_new_schedule_waits_for_its_next_slot_then_runs_exactly_once_per_slot():
    scheduler.sync(now=at(2026, 11, 30, 10))
    row = schedule("nightly")
    assert row.next_due_at == at(2026, 12, 1, 2)  # 03:00 in Berlin (CET)
    assert scheduler.tick(at(2026, 11, 30, 10)) == []  # no immediate run
    assert scheduler.tick(at(2026, 12, 1, 1, 59)) == []
    [job_id] = scheduler.tick(at(2026, 12, 1, 2, 0, 1))
    job = Job.objects.get(pk=job_id)
    assert (
        job.kind == "test.echo" and job.unique_key == "schedule:nightly:2026-12-01T02:00:00+00:00"
    )
    assert scheduler.tick(at(2026, 12, 1, 2, 0, 2)) == []  # the same slot never again
    row = schedule("nightly")
    assert (row.last_slot_at, row.last_job_id) == (at(2026, 12, 1, 2), job_id)
    assert row.next_due_at == at(2026, 12, 2, 2)


@override_settings(HOLDFAST_SCHEDULES={"sweep": SWEEP})
def test_interval_schedules_run_every_interval_on_a_fixed_grid():
    scheduler.sync(now=at(2026, 11, 30, 10))
    assert schedule("sweep").next_due_at == at(2026, 11, 30, 10, 5)
    ran = [scheduler.tick(at(2026, 11, 30, 10, minute, 30)) for minute in range(0, 21)]
    assert sum(len(ids) for ids in ran) == 4  # 10:05, 10:10, 10:15, 10:20
    assert [job.args for job in jobs_of("sweep")] == [{"dir": "incoming"}] * 4


@override_settings(HOLDFAST_SCHEDULES={"nightly": NIGHTLY})
def test_restarting_the_scheduler_neither_duplicates_nor_runs_early():
    scheduler.sync(now=at(2026, 11, 30, 10))
    scheduler.tick(at(2026, 12, 1, 2, 0, 1))
    for minutes in range(1, 30):  # a crash loop: sync and tick again and again
        now = at(2026, 12, 1, 2) + timedelta(minutes=minutes)
        scheduler.sync(now=now)
        assert scheduler.tick(now) == []
    assert len(jobs_of("nightly")) == 1
    assert schedule("nightly").next_due_at == at(2026, 12, 2, 2)


@pytest.mark.parametrize(("policy", "expected"), [("once", 1), ("skip", 0)])
def test_three_days_down_collapse_into_one_run_or_none(policy, expected):
    with override_settings(HOLDFAST_SCHEDULES={"nightly": {**NIGHTLY, "catch_up": policy}}):
        scheduler.sync(now=at(2026, 11, 26, 10))
        back = at(2026, 11, 30, 10, 30)  # missed the 27th, 28th, 29th and 30th
        scheduler.sync(now=back)
        assert len(scheduler.tick(back)) == expected
        assert scheduler.tick(back) == []
        assert schedule("nightly").next_due_at == at(2026, 12, 1, 2)
        if expected:
            assert jobs_of("nightly")[0].unique_key.endswith("2026-11-30T02:00:00+00:00")


@override_settings(HOLDFAST_SCHEDULES={"nightly": NIGHTLY})
def test_pruning_every_finished_job_does_not_make_a_slot_look_unrun():
    scheduler.sync(now=at(2026, 11, 30, 10))
    scheduler.tick(at(2026, 12, 1, 2, 0, 1))
    engine.complete(claim_one())
    Job.objects.filter(state=State.SUCCEEDED).update(
        finished_at=timezone.now() - timedelta(days=30)
    )
    assert operations.prune(timedelta(days=14)) == 1
    assert scheduler.tick(at(2026, 12, 1, 2, 0, 5)) == []
    assert Job.objects.count() == 0


@override_settings(HOLDFAST_SCHEDULES={"failing": {"kind": "test.fail", "every": 60}})
def test_a_schedule_whose_job_fails_still_advances():
    scheduler.sync(now=at(2026, 11, 30, 10))
    scheduler.tick(at(2026, 11, 30, 10, 1))
    for _ in range(3):
        engine.fail(claim_one(), failure(), backoff_seconds=0)
    assert jobs_of("failing")[0].state == State.DEAD
    assert len(scheduler.tick(at(2026, 11, 30, 10, 2))) == 1
    assert len(jobs_of("failing")) == 2


@override_settings(HOLDFAST_SCHEDULES={"nightly": NIGHTLY, "sweep": SWEEP})
def test_declarations_are_synced_changed_and_undeclared_never_deleted():
    scheduler.sync(now=at(2026, 11, 30, 10))
    with override_settings(HOLDFAST_SCHEDULES={"nightly": {**NIGHTLY, "cron": "0 4 * * *"}}):
        scheduler.sync(now=at(2026, 11, 30, 11))
    row = schedule("nightly")
    assert row.cron == "0 4 * * *" and row.next_due_at == at(2026, 12, 1, 3)
    sweep = schedule("sweep")
    assert not sweep.declared  # kept with its history, no longer run
    assert scheduler.tick(at(2026, 12, 5)) == [jobs_of("nightly")[0].pk]
    assert jobs_of("sweep") == []


@override_settings(HOLDFAST_SCHEDULES={"nightly": NIGHTLY})
def test_pause_resume_and_run_now():
    scheduler.sync(now=at(2026, 11, 30, 10))
    scheduler.pause("nightly")
    assert scheduler.tick(at(2026, 12, 3)) == []
    row = scheduler.resume("nightly")
    assert not row.paused and row.next_due_at > timezone.now()  # missed while paused: not run
    before = row.next_due_at
    job = scheduler.run_now("nightly")
    assert scheduler.run_now("nightly").pk == job.pk  # one manual run at a time
    assert schedule("nightly").next_due_at == before  # the next slot is not disturbed
    with pytest.raises(scheduler.ScheduleNotFound):
        scheduler.pause("nope")


@override_settings(HOLDFAST_SCHEDULES={"nightly": NIGHTLY})
def test_schedule_commands_and_overdue_status():
    scheduler.sync(now=at(2026, 11, 30, 10))  # next due 2026-12-01, long past the DB clock
    Schedule.objects.filter(name="nightly").update(next_due_at=timezone.now() - timedelta(hours=2))

    def run_json(*args: str) -> dict:
        out = StringIO()
        call_command(*args, "--json", stdout=out)
        return json.loads(out.getvalue())

    listed = {item["name"]: item for item in run_json("list_schedules")["schedules"]}
    assert listed["nightly"]["overdue"] and listed["nightly"]["status"] == "active"
    overdue = run_json("queue_status")["schedules_overdue"]
    assert [item["name"] for item in overdue] == ["nightly"]
    assert run_json("pause_schedule", "nightly")["paused"] is True
    assert run_json("resume_schedule", "nightly")["paused"] is False
    assert run_json("run_schedule_now", "nightly")["kind"] == "test.echo"
    with pytest.raises(CommandError) as raised:
        call_command("pause_schedule", "nope", stdout=StringIO())
    assert raised.value.returncode == 2


def test_refreshers_enqueue_due_refreshes_in_bounded_batches(run_worker):
    past = timezone.now() - timedelta(days=1)
    Document.objects.bulk_create(
        [Document(url=f"https://example.org/{i}", refresh_after=past) for i in range(250)]
        + [Document(url="https://example.org/fresh", refresh_after=past + timedelta(days=60))]
    )
    assert "holdfast.refresh" in schedules.declared()
    assert refresh.run_all()["test.documents"] == 100
    assert refresh.run_all()["test.documents"] == 100  # same 100 still queued: no doubles
    assert Job.objects.filter(kind="test.refresh_document").count() == 100
    for _ in range(3):
        enqueueing.enqueue("holdfast.refresh")
        run_worker()
    assert Document.objects.filter(refreshed=1).count() == 250
    assert Document.objects.get(url="https://example.org/fresh").refreshed == 0


@override_settings(HOLDFAST_SCHEDULES={"nightly": NIGHTLY})
def test_slots_enqueue_at_local_time_across_the_spring_dst_change():
    """03:00 Berlin is 02:00 UTC before the change on 29 March 2026, 01:00 UTC after it."""
    scheduler.sync(now=at(2026, 3, 27, 12))
    assert scheduler.tick(at(2026, 3, 28, 1, 59)) == []
    assert len(scheduler.tick(at(2026, 3, 28, 2, 0, 1))) == 1
    assert scheduler.tick(at(2026, 3, 29, 0, 59)) == []
    assert len(scheduler.tick(at(2026, 3, 29, 1, 0, 1))) == 1  # one hour earlier in UTC
    assert scheduler.tick(at(2026, 3, 29, 2, 0, 1)) == []  # not again at the old UTC hour
    assert [job.unique_key[-25:] for job in jobs_of("nightly")] == [
        "2026-03-28T02:00:00+00:00",
        "2026-03-29T01:00:00+00:00",
    ]


BAD_SCHEDULES = [
    {"bad": {**NIGHTLY, "timezone": None}},
    {"bad": {"kind": "test.echo", "every": "abc"}},
    {"bad": "oops"},
    {"bad": {"kind": "test.nokind", "every": 60}},
    {"bad": {"kind": "test.echo", "every": 60, "lane": "nolane"}},
    {"bad": {"kind": "test.echo", "every": 60, "args": {"x": float("nan")}}},
    {"b" * 201: {"kind": "test.echo", "every": 60}},
]


@pytest.mark.parametrize("declared_schedules", BAD_SCHEDULES)
@pytest.mark.parametrize(
    "command", [("runscheduler", "--once"), ("runworker", "--with-scheduler", "--burst")]
)
def test_a_scheduler_refuses_to_start_with_a_schedule_that_could_never_run(
    declared_schedules, command
):
    """Exit 2 with one line naming the schedule, before any row is synced: not a
    traceback, a database error, nor a worker failing its scheduler pass twice a second."""
    enqueueing.enqueue("test.echo")  # a worker that started would run it
    with (
        override_settings(HOLDFAST_SCHEDULES={**declared_schedules, "ok": SWEEP}),
        pytest.raises(CommandError) as raised,
    ):
        call_command(*command, stdout=StringIO(), stderr=StringIO())
    message = str(raised.value)
    assert raised.value.returncode == 2 and "\n" not in message
    assert message.startswith("schedule 'b"), message
    assert Schedule.objects.count() == 0
    assert Job.objects.get().state == State.QUEUED


def test_the_longest_schedule_name_enqueues_its_slots():
    """On SQLite a 201-character name used to be stored, then every slot failed: its
    unique key was over 255 characters. 200 (the column) always fits, microseconds too."""
    name = "n" * schedules.MAX_NAME_LENGTH
    with override_settings(HOLDFAST_SCHEDULES={name: {"kind": "test.echo", "every": 0.5}}):
        scheduler.sync(now=at(2026, 11, 30, 10, 0, 0, 123456))
        [job_id] = scheduler.tick(at(2026, 11, 30, 10, 0, 1))
    key = Job.objects.get(pk=job_id).unique_key
    assert key == f"schedule:{name}:2026-11-30T10:00:00.623456+00:00" and len(key) == 242


@override_settings(HOLDFAST_SCHEDULES={"sweep": SWEEP})
def test_a_schedule_this_process_cannot_enqueue_is_left_due_for_one_that_can():
    """A rolling deploy: a newer scheduler declared a schedule of a kind (or lane) this
    older one does not know. Its slots are not spent on refusals here; the others tick."""
    scheduler.sync(now=at(2026, 11, 30, 10))
    for name, kind, lane in (
        ("newer", "test.only_in_the_next_release", None),
        ("new-lane", "test.echo", "lane-of-the-next-release"),
    ):
        Schedule.objects.create(
            name=name,
            kind=kind,
            every=60,
            timezone="UTC",
            next_due_at=at(2026, 11, 30, 10, 1),
            args={},
            lane=lane,
        )
    unserved: set[int] = set()
    with capture_logs() as logs:
        for minute in (6, 11):
            assert len(scheduler.tick(at(2026, 11, 30, 10, minute), unserved=unserved)) == 1
    newer = Schedule.objects.filter(name__in=["newer", "new-lane"])
    assert {row.next_due_at for row in newer} == {
        at(2026, 11, 30, 10, 1)  # not advanced: the next release's scheduler runs them
    }
    assert unserved == set(newer.values_list("pk", flat=True))
    warned = [e for e in logs if e["event"] == "schedule_not_served_here"]
    assert sorted(e["schedule"] for e in warned) == ["new-lane", "newer"]  # once each
    assert "test.only_in_the_next_release" in next(
        e["error"] for e in warned if e["schedule"] == "newer"
    )
    assert [job.kind for job in jobs_of("sweep")] == ["test.noop", "test.noop"]
    assert jobs_of("newer") == [] and jobs_of("new-lane") == []


@override_settings(HOLDFAST_SCHEDULES={"sweep": SWEEP})
def test_a_schedule_row_whose_slot_cannot_be_computed_does_not_stop_the_others():
    scheduler.sync(now=at(2026, 11, 30, 10))
    Schedule.objects.create(  # stored before its interval was refused: zero as a timedelta
        name="tiny",
        kind="test.echo",
        every=1e-7,
        timezone="UTC",
        next_due_at=at(2026, 11, 30, 10),
        args={},
        lane=None,
    )
    with capture_logs() as logs:
        assert len(scheduler.tick(at(2026, 11, 30, 10, 6))) == 1
    assert [job.kind for job in jobs_of("sweep")] == ["test.noop"]
    failed = [e for e in logs if e["event"] == "schedule_failed"]
    assert [e["schedule"] for e in failed] == ["tiny"] and failed[0]["exc_info"], failed


@override_settings(
    HOLDFAST_LANES={
        "default": {},
        "tiny": {"kinds": ["test.echo"], "max_queued": 1, "on_full": "drop"},
    },
    HOLDFAST_SCHEDULES={"greet": {"kind": "test.echo", "every": 60, "lane": "tiny"}},
)
def test_run_now_into_a_full_dropping_lane_is_one_line_and_exit_1():
    scheduler.sync(now=at(2026, 11, 30, 10))
    enqueueing.enqueue("test.echo", {}, lane="tiny")
    with pytest.raises(CommandError) as raised:
        call_command("run_schedule_now", "greet", stdout=StringIO())
    assert raised.value.returncode == 1
    assert "the lane of schedule 'greet' is full" in str(raised.value)


@pytest.mark.parametrize("cron", ["*/30 2 * * *", "0,30 2 * * *", "0-59/30 2 * * *"])
def test_a_step_from_a_wildcard_keeps_the_dst_rule_of_fixed_times(cron):
    """cronsim treats a field starting with ``*`` as an interval and would skip the gap
    day and run the repeated hour twice; each spelling runs as the documented rule says."""
    berlin = ZoneInfo("Europe/Berlin")

    def local(start: datetime, count: int) -> list[str]:
        slots = schedules.slots_after(cron, None, "Europe/Berlin", start)
        return [next(slots).astimezone(berlin).isoformat() for _ in range(count)]

    assert local(at(2026, 3, 28, 12), 2) == [  # 02:00 and 02:30 fall in the gap: one run
        "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:00:00+02:00",
    ]
    assert local(at(2026, 10, 24, 12), 3) == [  # the repeated hour runs once
        "2026-10-25T02:00:00+02:00",
        "2026-10-25T02:30:00+02:00",
        "2026-10-26T02:00:00+01:00",
    ]


@pytest.mark.django_db(transaction=True)
@override_settings(HOLDFAST_SCHEDULES={"nightly": NIGHTLY})
def test_a_scheduler_frozen_inside_a_slot_holds_its_schedule_only_briefly(monkeypatch):
    """A scheduler frozen (SIGSTOP, a paused VM) between locking a due row and committing
    held the row for ever: the other schedulers skip locked rows, so the schedule never ran
    again, and ``pause_schedule`` hung. The server now ends that session, and an operator's
    pause meanwhile answers within seconds (audit)."""
    if not sql.is_postgres():
        pytest.skip("SQLite: a frozen holder of the write lock is FrozenHolderWatch's")
    monkeypatch.setattr(scheduler, "SLOT_IDLE_LIMIT", 1.5)
    monkeypatch.setattr(scheduler, "SCHEDULE_LOCK_WAIT", 0.2)
    scheduler.sync(now=at(2026, 11, 30, 10))
    slot_time = at(2026, 12, 1, 2, 0, 1)
    frozen, thaw = threading.Event(), threading.Event()
    enqueue_slot = scheduler._enqueue_slot

    def freeze_first(row: Schedule, unique_key: str) -> Job | None:
        if not frozen.is_set():  # the first scheduler stops inside its slot transaction
            frozen.set()
            thaw.wait(20)
        return enqueue_slot(row, unique_key)

    monkeypatch.setattr(scheduler, "_enqueue_slot", freeze_first)
    late: list[BaseException] = []

    def frozen_scheduler() -> None:
        try:
            scheduler.tick(slot_time)
        except DatabaseError as exc:
            late.append(exc)
        finally:
            connection.close()

    first = threading.Thread(target=frozen_scheduler)
    first.start()
    try:
        assert frozen.wait(10)
        with pytest.raises(StateConflict, match="locked by a scheduler's open transaction"):
            scheduler.pause("nightly")
        assert not schedule("nightly").paused
        enqueued, deadline = [], time.monotonic() + 15
        while not enqueued and time.monotonic() < deadline:
            enqueued = scheduler.tick(slot_time)  # another scheduler, once the row is free
            time.sleep(0.1)
        assert len(enqueued) == 1
    finally:
        thaw.set()
        first.join(20)
    assert late  # the frozen one's late commit failed on its ended session
    assert [job.pk for job in jobs_of("nightly")] == enqueued
