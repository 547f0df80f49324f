"""Slot arithmetic: cron in a timezone across DST, interval grids, catch-up (no database)."""

from datetime import UTC, datetime, timedelta
from itertools import islice, pairwise

import pytest
from django.core.exceptions import ImproperlyConfigured

from jobs.enqueueing import UNIQUE_KEY_LENGTH
from jobs.schedules import (
    LONGEST_SLOT,
    MAX_NAME_LENGTH,
    Declared,
    catch_up,
    next_slot,
    slot_key,
    slots_after,
)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def test_daily_berlin_slot_keeps_local_time_across_both_dst_changes():
    # 03:00 Europe/Berlin is 02:00 UTC in winter (CET) and 01:00 UTC in summer (CEST).
    slots = list(islice(slots_after("0 3 * * *", None, "Europe/Berlin", utc(2026, 3, 27)), 3))
    assert slots == [utc(2026, 3, 27, 2), utc(2026, 3, 28, 2), utc(2026, 3, 29, 1)]
    slots = list(islice(slots_after("0 3 * * *", None, "Europe/Berlin", utc(2026, 10, 24)), 3))
    assert slots == [utc(2026, 10, 24, 1), utc(2026, 10, 25, 2), utc(2026, 10, 26, 2)]


def test_a_slot_in_the_spring_gap_runs_once_and_the_repeated_autumn_hour_runs_once():
    spring = list(islice(slots_after("30 2 * * *", None, "Europe/Berlin", utc(2026, 3, 28)), 3))
    assert sum(slot.date() == datetime(2026, 3, 29).date() for slot in spring) == 1
    autumn = list(islice(slots_after("30 2 * * *", None, "Europe/Berlin", utc(2026, 10, 24)), 3))
    assert sum(slot.date() == datetime(2026, 10, 25).date() for slot in autumn) == 1
    assert all(b - a >= timedelta(hours=22) for a, b in pairwise(autumn))


def test_next_slot_is_strictly_after_the_anchor():
    assert next_slot("0 * * * *", None, "UTC", utc(2026, 1, 1, 5)) == utc(2026, 1, 1, 6)
    assert next_slot("", 300, "UTC", utc(2026, 1, 1, 5)) == utc(2026, 1, 1, 5, 5)


def test_catch_up_collapses_missed_slots_to_the_latest_and_keeps_the_grid():
    due = utc(2026, 11, 27, 3)
    now = utc(2026, 11, 30, 10, 30)  # three days of downtime
    assert catch_up("0 3 * * *", None, "UTC", due, now) == (
        utc(2026, 11, 30, 3),
        utc(2026, 12, 1, 3),
    )
    latest, following = catch_up("", 600, "UTC", due, now)
    assert latest <= now < following and following - latest == timedelta(minutes=10)
    assert (latest - due).total_seconds() % 600 == 0  # same grid as before the downtime


@pytest.mark.parametrize(
    ("cron", "zone", "due", "latest"),
    [
        ("* * * * *", "UTC", utc(2026, 1, 1), utc(2026, 11, 30, 10, 30)),
        ("*/5 * * * *", "Europe/Berlin", utc(2025, 1, 1), utc(2026, 11, 30, 10, 30)),
        ("0 3 * * *", "Europe/Berlin", utc(1700, 1, 1, 2), utc(2026, 11, 30, 2)),
    ],
)
def test_a_cron_schedule_far_behind_catches_up_to_its_latest_slot(cron, zone, due, latest):
    """More than MAX_CATCH_UP_STEPS slots behind (an every-minute schedule after 70 days
    down; a daily one after 300 years: a row whose next_due_at an operator wrote), the
    walk stopped at its cap and returned that slot, months old, as the latest: ``once``
    ran a stale slot, ``skip`` skipped a slot that was due (audit)."""
    now = utc(2026, 11, 30, 10, 30, 30)
    assert catch_up(cron, None, zone, due, now) == (latest, next_slot(cron, None, zone, now))


def test_sub_second_intervals_catch_up_exactly():
    due = utc(2026, 1, 1)
    now = due + timedelta(seconds=0.3)
    latest, following = catch_up("", 0.1, "UTC", due, now)
    assert latest <= now < following  # float floor division would give following == now


@pytest.mark.parametrize(
    "options",
    [
        {"every": float("nan")},
        {"every": 1e300},
        {"cron": "61 * * * *"},
        {"cron": "0 3 * * * *"},  # six fields: cronsim reads seconds first (minute 3 hourly)
        {"cron": "*/10 * * * * *"},
        {"cron": "0 3 * * *", "every": 60},
        {},
        {"every": 0},
        {"cron": "0 3 * * *", "timezone": "Mars/Olympus"},
        {"cron": "0 3 * * *", "catch_up": "sometimes"},
        {"cron": "0 3 * * *", "timezone": None},  # was a TypeError traceback
        {"cron": "0 3 * * *", "timezone": ""},
        {"cron": "0 3 * * *", "timezone": "Europe/" + "x" * 60},  # the row's 64 characters
        {"every": "abc"},
        {"every": "60"},
        {"every": True},
        {"cron": 5},
        {"cron": "0 3 * * *", "lane": ""},
        {"cron": "0 3 * * *", "lane": 7},
        {"cron": "0 3 * * *", "args": {"x": float("nan")}},  # was a database error
        {"cron": "0 3 * * *", "args": {"x": object()}},
        {"cron": "0 3 * * *", "args": {"x": "\x00"}},
        {"cron": "0 3 * * *", "args": ["x"]},
    ],
)
def test_bad_declarations_are_refused_with_the_schedule_named(options):
    with pytest.raises(ImproperlyConfigured, match="nightly"):
        Declared("nightly", "demo.greet", **options)


@pytest.mark.parametrize("name", ["", "n" * (MAX_NAME_LENGTH + 1), 7])
def test_a_name_must_leave_room_for_the_slot_in_its_jobs_unique_key(name):
    with pytest.raises(ImproperlyConfigured, match="a schedule name is 1 to 200 characters"):
        Declared(name, "demo.greet", every=60)


@pytest.mark.parametrize("kind", ["", "k" * 201, None])
def test_a_kind_must_fit_the_row(kind):
    with pytest.raises(ImproperlyConfigured, match="'kind' must be a job kind"):
        Declared("nightly", kind, every=60)


def test_the_longest_name_and_latest_slot_still_make_a_valid_unique_key():
    latest = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
    assert slot_key("n" * MAX_NAME_LENGTH, latest) == f"schedule:{'n' * 200}:{LONGEST_SLOT}"
    assert len(slot_key("n" * MAX_NAME_LENGTH, latest)) <= UNIQUE_KEY_LENGTH
    assert slot_key("nightly", utc(2026, 12, 1, 2)) == "schedule:nightly:2026-12-01T02:00:00+00:00"


def test_an_integer_interval_is_kept_as_seconds():
    assert Declared("sweep", "demo.greet", every=300).every == 300.0
