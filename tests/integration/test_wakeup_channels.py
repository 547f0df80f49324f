"""Targeted wake-ups (jobs/notify.py): an enqueue reaches only the workers of its lane
(and those serving every lane); a delayed job notifies no one. Observed without timing:
notifications arrive in commit order, so a marker sent after the enqueues shows what
would have come before it. SQLite: the same for this process's own idle workers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection

from jobs import enqueueing, notify
from jobs.notify import PollWaker

pytestmark = pytest.mark.django_db(transaction=True)

LANES = {"default": {}, "other": {}, "Odd lane/ü" + "x" * 80: {}}
MARKER = "hf-marker"


@pytest.fixture
def lanes(settings: Any) -> None:
    settings.HOLDFAST_LANES = LANES


def _listen(channels: list[str]) -> psycopg.Connection:
    s = connection.settings_dict
    conn = psycopg.connect(
        dbname=s["NAME"],
        user=s.get("USER") or None,
        host=s.get("HOST") or None,
        port=s.get("PORT") or None,
        autocommit=True,
    )
    for channel in channels:
        conn.execute(f"LISTEN {notify.quote_channel(channel)}")
    return conn


def _heard_before_marker(conn: psycopg.Connection) -> list[tuple[str, str]]:
    heard = []
    for note in conn.notifies(timeout=10):
        if note.payload == MARKER:
            return heard
        heard.append((note.channel, note.payload))
    raise AssertionError(f"no marker; heard {heard}")


@pytest.fixture
def listeners(lanes: None) -> Iterator[dict[str, psycopg.Connection]]:
    if connection.vendor != "postgresql":
        pytest.skip("LISTEN/NOTIFY: PostgreSQL")
    conns = {
        "other": _listen(notify.worker_channels(["other"])),
        "all": _listen(notify.worker_channels(None)),
    }
    yield conns
    for conn in conns.values():
        conn.close()


def _marker(channels: list[str]) -> None:
    with connection.cursor() as cursor:
        for channel in channels:
            cursor.execute("SELECT pg_notify(%s, %s)", [channel, MARKER])


@pytest.mark.postgres
def test_an_enqueue_reaches_only_its_lanes_workers(listeners: dict[str, Any]) -> None:
    enqueueing.enqueue("test.noop", {}, lane="default")
    enqueueing.enqueue("test.noop", {}, lane="other", delay=60)  # delayed: notifies no one
    enqueueing.enqueue("test.noop", {}, lane="other")
    _marker([notify.lane_channel("other"), notify.NOTIFY_CHANNEL])
    assert _heard_before_marker(listeners["other"]) == [(notify.lane_channel("other"), "other")]
    assert _heard_before_marker(listeners["all"]) == [
        (notify.NOTIFY_CHANNEL, "default"),
        (notify.NOTIFY_CHANNEL, "other"),
    ]


@pytest.mark.postgres
def test_odd_and_long_lane_names_get_valid_channels(lanes: None) -> None:
    odd = next(name for name in LANES if name.startswith("Odd"))
    channel = notify.lane_channel(odd)
    assert len(channel.encode()) <= 63 and channel != notify.lane_channel("other")
    conn = _listen([channel])
    try:
        enqueueing.enqueue("test.noop", {}, lane=odd)
        _marker([channel])
        assert _heard_before_marker(conn) == [(channel, odd)]
    finally:
        conn.close()


def test_in_process_wakers_wake_only_for_their_lanes(lanes: None) -> None:
    other, every = PollWaker(["other"]), PollWaker(None)
    try:
        enqueueing.enqueue("test.noop", {}, lane="default")
        enqueueing.enqueue("test.noop", {}, lane="other", delay=60)
        if connection.vendor == "sqlite":  # in-process wake-ups stand in for NOTIFY
            assert (other._event.is_set(), every._event.is_set()) == (False, True)
            enqueueing.enqueue("test.noop", {}, lane="other")
            assert other._event.is_set()
    finally:
        other.close()
        every.close()
