"""The lease keeper's side connection: with ``HOLDFAST_LISTEN_DATABASE_URL`` set, the
keeper thread's Django connection goes there (its heartbeats, reclaims and LISTEN on one
session), opened like the database's own connection: with its libpq options (TCP
keepalives, so a LISTEN on a primary that vanished without a word is noticed; sslmode;
application_name), not bare. Other threads keep their connection to ``DATABASE_URL``."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection

from jobs import notify
from jobs.notify import SideListener

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_the_side_connection_goes_to_the_listen_database_with_its_options(settings: Any) -> None:
    direct = dict(connection.settings_dict)
    assert direct["OPTIONS"]["keepalives_idle"] == 30  # config/settings.py
    direct["OPTIONS"] = {**direct["OPTIONS"], "application_name": "hf-listen"}
    settings.HOLDFAST_LISTEN_DATABASE = direct
    seen: dict[str, Any] = {}
    done, release = threading.Event(), threading.Event()

    def keeper() -> None:
        try:
            notify.use_side_database()
            listener = SideListener(notify.worker_channels(["default"]))
            assert listener.poll(0.0) == []
            from django.db import connection as side

            seen["dsn"] = dict(part.split("=", 1) for part in side.connection.info.dsn.split())
            done.set()
            release.wait(10)
        finally:
            from django.db import connection as side

            side.close()

    thread = threading.Thread(target=keeper)
    thread.start()
    try:
        assert done.wait(10)
        dsn = seen["dsn"]
        assert (dsn["keepalives"], dsn["keepalives_idle"], dsn["application_name"]) == (
            "1",
            "30",
            "hf-listen",
        )
        with connection.cursor() as cursor:  # this thread: still the default connection
            cursor.execute("SELECT current_setting('application_name')")
            assert cursor.fetchone()[0] != "hf-listen"
            cursor.execute(
                "SELECT query FROM pg_stat_activity WHERE application_name = 'hf-listen'"
            )
            (query,) = [row[0] for row in cursor.fetchall()]
        assert query.startswith('LISTEN "holdfast_lane_default"')
    finally:
        release.set()
        thread.join(10)
