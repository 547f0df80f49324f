"""Wake-ups: LISTEN/NOTIFY on PostgreSQL, plain polling otherwise.

Enqueue sends ``pg_notify('holdfast_jobs', lane)`` inside its transaction, so a worker
waiting here wakes within milliseconds of the commit. Polling every
``HOLDFAST_POLL_SECONDS`` stays as the fallback (delayed jobs, lost notifications, a
listener connection that broke). Likewise ``cancel_job`` sends
``pg_notify('holdfast_cancel', job_id)``, which a busy worker's lease keeper hears at
once; the heartbeat's own check (at least every 5 s) stays as the fallback.

LISTEN needs a session of its own, which a transaction-mode pooler does not give: the
listeners connect to ``HOLDFAST_LISTEN_DATABASE_URL`` when it is set (a direct connection
to the same database), else to ``DATABASE_URL`` unless prepared statements are off (the
sign of a pooler), in which case workers poll. NOTIFY itself is transactional and works
through a pooler.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import psycopg
from django.conf import settings
from django.db import connection

from .engine import CANCEL_CHANNEL, NOTIFY_CHANNEL
from .log import get_logger

log = get_logger("jobs.notify")

RECONNECT_MIN = 1.0  # seconds before retrying a LISTEN connection that failed
RECONNECT_MAX = 30.0


class PollWaker:
    """Sleeps until the timeout or an explicit ``wake()`` (e.g. on shutdown)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)
        self._event.clear()

    def wake(self) -> None:
        self._event.set()

    def close(self) -> None:
        self.wake()


class Listener:
    """A dedicated autocommit connection LISTENing on one channel, reconnected on demand."""

    def __init__(self, settings_dict: dict[str, Any], channel: str) -> None:
        self._settings = settings_dict
        self._channel = channel
        self._conn: psycopg.Connection | None = None
        self._retry_at = 0.0  # monotonic: no reconnect attempt before this
        self._backoff = RECONNECT_MIN

    def _connect(self) -> psycopg.Connection | None:
        """The LISTEN connection, or None while the database is unreachable.

        Reconnects back off (up to ``RECONNECT_MAX``), so a thread that also has other
        duties (the lease keeper) is not held up by connect timeouts during an outage.
        """
        if self._conn is not None and not self._conn.closed:
            return self._conn
        if time.monotonic() < self._retry_at:
            return None
        params = {
            # The database's libpq options too (TCP keepalives, so an idle LISTEN on a
            # primary that vanished is noticed; sslmode; application_name ...).
            **libpq_options(self._settings),
            "dbname": self._settings["NAME"],
            "user": self._settings.get("USER") or None,
            "password": self._settings.get("PASSWORD") or None,
            "host": self._settings.get("HOST") or None,
            "port": self._settings.get("PORT") or None,
            "connect_timeout": 5,
        }
        try:
            conn = psycopg.connect(
                **{k: v for k, v in params.items() if v is not None}, autocommit=True
            )
            conn.execute(f"LISTEN {self._channel}")
        except psycopg.Error as exc:
            log.warning(
                "listen_unavailable",
                channel=self._channel,
                error=str(exc).strip(),
                retry_in=self._backoff,
            )
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, RECONNECT_MAX)
            return None
        self._conn, self._backoff = conn, RECONNECT_MIN
        return conn

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
        self._conn = None

    def close(self) -> None:
        self._drop()


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


class CancelListener(Listener):
    """The lease keeper's ear for cancel requests (PostgreSQL)."""

    def __init__(self, settings_dict: dict[str, Any]) -> None:
        super().__init__(settings_dict, CANCEL_CHANNEL)

    def poll(self, timeout: float) -> set[int]:
        """Wait up to ``timeout`` seconds; return the job ids whose cancel was requested."""
        conn = self._connect()
        if conn is None:
            time.sleep(timeout)
            return set()
        try:
            return {
                int(note.payload)
                for note in conn.notifies(timeout=timeout)
                if note.payload.isdigit()
            }
        except psycopg.Error as exc:
            log.warning("listen_lost", channel=self._channel, error=str(exc).strip())
            self._drop()
            return set()


class PostgresWaker(PollWaker, Listener):
    """Waits on a dedicated LISTEN connection; falls back to polling while it is down."""

    def __init__(self, settings_dict: dict[str, Any]) -> None:
        PollWaker.__init__(self)
        Listener.__init__(self, settings_dict, NOTIFY_CHANNEL)

    def wait(self, timeout: float) -> None:
        conn = self._connect()
        if conn is None or self._event.is_set():
            super().wait(timeout)
            return
        try:
            for _ in conn.notifies(timeout=timeout, stop_after=1):
                break
        except psycopg.Error as exc:
            log.warning("listen_lost", error=str(exc).strip())
            self._drop()
            super().wait(min(timeout, 1.0))

    def close(self) -> None:
        self._drop()


def listen_settings() -> dict[str, Any] | None:
    """Where the LISTEN connections go, or None when workers must poll (see above)."""
    if connection.vendor != "postgresql":
        return None
    direct = getattr(settings, "HOLDFAST_LISTEN_DATABASE", None)
    if direct:
        return dict(direct)
    if not getattr(settings, "HOLDFAST_PREPARED_STATEMENTS", True):
        return None  # behind a pooler, and no direct connection named
    return dict(connection.settings_dict)


def waker_for_database() -> PollWaker:
    where = listen_settings()
    if where is not None:
        return PostgresWaker(where)
    if connection.vendor == "postgresql":
        log.info(
            "listen_disabled",
            reason="HOLDFAST_PREPARED_STATEMENTS is off and HOLDFAST_LISTEN_DATABASE_URL "
            "is unset: polling",
            poll_seconds=settings.HOLDFAST_POLL_SECONDS,
        )
    return PollWaker()


def cancel_listener_for_database() -> CancelListener | None:
    where = listen_settings()
    return CancelListener(where) if where is not None else None
