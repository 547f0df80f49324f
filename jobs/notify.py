"""Wake-ups: LISTEN/NOTIFY on PostgreSQL, plain polling otherwise.

Channels (all LISTENed on the worker's one *side* connection, the lease keeper's, whose
thread reads them continuously, busy or idle, so the server's notification queue never
waits on a worker):

- ``lane_channel(lane)``: a job became runnable now in that lane (enqueue, requeue, a slot
  of a limited lane freed). A worker started with ``--lanes`` LISTENs on its lanes'
  channels only, so an enqueue elsewhere never reaches its process.
- ``holdfast_jobs`` (``NOTIFY_CHANNEL``, payload: the lane): the same wake-ups for the
  workers that serve every lane, including lanes their own settings do not declare yet.
- ``holdfast_freed`` (payload: the lane): a job holding resource locks settled or was
  reclaimed; its locks are free, so a job blocked on them (in any lane) may run now.
- ``holdfast_cancel`` (payload: the job id): an operator asked to cancel a running job.

Enqueue sends the lane's notifications inside its transaction (delivered iff it commits),
and only for jobs due now: a delayed job wakes no one at enqueue. An idle worker instead
asks the database when the next job of its lanes falls due (``jobs.sql``-free ORM query on
a partial index) and sleeps no longer than that, at most ``HOLDFAST_POLL_SECONDS``. The
keeper thread wakes the main thread only while it is idle.

LISTEN needs a session of its own, which a transaction-mode pooler does not give: the
side connection goes to ``HOLDFAST_LISTEN_DATABASE_URL`` when it is set (a direct
connection to the same database; the keeper's heartbeats and reclaims then run there
too), else to ``DATABASE_URL``; there it LISTENs unless prepared statements are off (the
sign of a pooler), in which case workers poll. NOTIFY itself is transactional and works
through a pooler.

SQLite has no LISTEN: workers poll (``HOLDFAST_POLL_SECONDS``), and an enqueue or a freed
lock in the same process wakes that process's idle workers at once (``wake_local``).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg
from django.conf import settings
from django.db import connection

from .log import get_logger

log = get_logger("jobs.notify")

NOTIFY_CHANNEL = "holdfast_jobs"  # payload: the lane; heard by workers of every lane
CANCEL_CHANNEL = "holdfast_cancel"  # payload: the job id whose cancellation was requested
FREED_CHANNEL = "holdfast_freed"  # payload: the lane of a job whose resource locks freed
RECONNECT_MIN = 1.0  # seconds before retrying a LISTEN that failed
RECONNECT_MAX = 30.0
_PLAIN_LANE = re.compile(r"[a-z0-9_]{1,40}")


def lane_channel(lane: str) -> str:
    """The channel of one lane: ``holdfast_lane_<lane>`` for short plain names, else a
    hash of the name (channel names are identifiers: at most 63 bytes). The two forms
    cannot collide: a hashed name carries a ``.``, which a plain one never does."""
    if _PLAIN_LANE.fullmatch(lane):
        return f"holdfast_lane_{lane}"
    return "holdfast_lane." + hashlib.sha256(lane.encode()).hexdigest()[:32]


def lane_channels(lane: str) -> list[str]:
    """Where a new runnable job of ``lane`` is announced: the lane's own channel (workers
    of some lanes) and the general one (workers of every lane)."""
    return [lane_channel(lane), NOTIFY_CHANNEL]


def worker_channels(lanes: Sequence[str] | None) -> list[str]:
    """What a worker serving ``lanes`` (None: every lane) LISTENs on."""
    wake = [NOTIFY_CHANNEL] if lanes is None else sorted({lane_channel(lane) for lane in lanes})
    return [*wake, FREED_CHANNEL, CANCEL_CHANNEL]


def quote_channel(channel: str) -> str:
    return '"' + channel.replace('"', '""') + '"'


def notify_lanes(lanes: Iterable[str]) -> None:
    """Wake the idle workers serving ``lanes``. PostgreSQL: NOTIFY, sent at commit of the
    current transaction, or at once in autocommit. SQLite: this process's idle workers,
    after commit."""
    lanes = sorted(set(lanes))
    if not lanes:
        return
    if connection.vendor == "postgresql":
        pairs = [
            part for lane in lanes for channel in lane_channels(lane) for part in (channel, lane)
        ]
        calls = ", ".join("pg_notify(%s, %s)" for _ in range(len(pairs) // 2))
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {calls}", pairs)
        return
    from django.db import transaction

    transaction.on_commit(lambda: wake_local(lanes))


def notify_freed() -> None:
    """Wake every idle worker, whatever its lanes: a resource lock is free (a job blocked
    on it may be in any lane). Sent like ``notify_lanes``."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, '')", [FREED_CHANNEL])
        return
    from django.db import transaction

    transaction.on_commit(lambda: wake_local((), freed=True))


# --- in-process wake-ups (SQLite, and every database within one process) --------------

_local: weakref.WeakSet[PollWaker] = weakref.WeakSet()
_local_lock = threading.Lock()


def wake_local(lanes: Iterable[str], freed: bool = False) -> None:
    lanes = set(lanes)
    with _local_lock:
        wakers = list(_local)
    for waker in wakers:
        if freed or waker.lanes is None or lanes & set(waker.lanes):
            waker.wake()


class PollWaker:
    """The main thread's sleep while idle: until the timeout, or a ``wake()`` (a
    notification the keeper heard, a local enqueue, shutdown)."""

    def __init__(self, lanes: Sequence[str] | None = None) -> None:
        self.lanes = list(lanes) if lanes is not None else None
        self._event = threading.Event()
        with _local_lock:
            _local.add(self)

    def wait(self, timeout: float) -> bool:
        """Sleep; returns whether something woke it."""
        woken = self._event.wait(max(0.0, timeout))
        self._event.clear()
        return woken

    def wake(self) -> None:
        self._event.set()

    def close(self) -> None:
        self.wake()
        with _local_lock:
            _local.discard(self)


class SideListener:
    """LISTEN on the calling thread's own Django connection (the keeper's side
    connection), re-issued whenever that connection was replaced (a reconnect).

    A notification sent before a LISTEN took effect is never delivered, so
    ``subscriptions`` counts the LISTENs issued: the caller catches up on what it may
    have missed (a cancel request, a wake-up) each time it changes.
    """

    def __init__(self, channels: Sequence[str]) -> None:
        self.channels = list(channels)
        self.subscriptions = 0
        self._on: Any = None  # the psycopg connection that LISTENs now
        self._retry_at = 0.0
        self._backoff = RECONNECT_MIN

    def ensure(self) -> Any:
        """The connection that LISTENs, (re)subscribing it if needed; None while the
        database is unreachable (retried with backoff)."""
        raw = connection.connection
        if raw is not None and raw is self._on and not raw.closed:
            return raw
        if time.monotonic() < self._retry_at:
            return None
        try:
            connection.ensure_connection()
            with connection.cursor() as cursor:
                cursor.execute("; ".join(f"LISTEN {quote_channel(c)}" for c in self.channels))
        except Exception as exc:
            log.warning(
                "listen_unavailable", error=" ".join(str(exc).split()), retry_in=self._backoff
            )
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, RECONNECT_MAX)
            with contextlib.suppress(Exception):
                connection.close()
            return None
        self._on, self._backoff = connection.connection, RECONNECT_MIN
        self.subscriptions += 1
        log.info("listening", channels=self.channels)
        return self._on

    def poll(self, timeout: float) -> list[psycopg.Notify] | None:
        """Notifications received within ``timeout`` seconds (those that arrived during
        other statements first): returns as soon as one has arrived, with every other one
        already there, so a wake-up is passed on at once (not at the end of the keeper's
        tick); None while not listening (the caller sleeps instead)."""
        raw = self.ensure()
        if raw is None:
            return None
        try:
            notes = list(raw.notifies(timeout=max(0.0, timeout), stop_after=1))
            if notes:
                notes += raw.notifies(timeout=0)
            return notes
        except psycopg.Error as exc:
            log.warning("listen_lost", error=" ".join(str(exc).split()))
            self._on = None
            with contextlib.suppress(Exception):
                connection.close()
            return None


# OPTIONS of a Django database that are Django's or psycopg's own, not libpq's.
NOT_LIBPQ = frozenset(
    {
        "assume_role",
        "context",
        "cursor_factory",
        "isolation_level",
        "pool",
        "prepare_threshold",
        "server_side_binding",
    }
)


def libpq_options(settings_dict: dict[str, Any]) -> dict[str, Any]:
    """The libpq connection options in a Django database's ``OPTIONS``."""
    options = settings_dict.get("OPTIONS") or {}
    return {key: value for key, value in options.items() if key not in NOT_LIBPQ}


def side_database() -> dict[str, Any] | None:
    """Where the side connection goes when not to ``DATABASE_URL``: the direct database
    named by ``HOLDFAST_LISTEN_DATABASE_URL`` (PostgreSQL), else None."""
    if connection.vendor != "postgresql":
        return None
    direct = getattr(settings, "HOLDFAST_LISTEN_DATABASE", None)
    return dict(direct) if direct else None


def listens() -> bool:
    """Whether the side connection LISTENs (else the workers poll; see above)."""
    if connection.vendor != "postgresql":
        return False
    if side_database() is not None:
        return True
    return bool(getattr(settings, "HOLDFAST_PREPARED_STATEMENTS", True))


def use_side_database() -> None:
    """In the calling thread (the keeper), make Django's default connection the direct
    database of ``HOLDFAST_LISTEN_DATABASE_URL``, if one is set: every statement the
    thread runs (heartbeats, reclaim, LISTEN, the scheduler) goes there, on one session.
    Other threads keep their own connection to ``DATABASE_URL``."""
    direct = side_database()
    if direct is None:
        return
    from django.db import connections
    from django.db.utils import load_backend

    base = dict(connections.settings["default"])
    for key in ("NAME", "USER", "PASSWORD", "HOST", "PORT", "OPTIONS"):
        if key in direct:
            base[key] = direct[key]
    backend = load_backend(base["ENGINE"])
    connections["default"] = backend.DatabaseWrapper(base, "default")


def log_polling(poll_seconds: float) -> None:
    if connection.vendor == "postgresql" and not listens():
        log.info(
            "listen_disabled",
            reason="HOLDFAST_PREPARED_STATEMENTS is off and HOLDFAST_LISTEN_DATABASE_URL "
            "is unset: polling",
            poll_seconds=poll_seconds,
        )
