"""The workers' LISTEN connections are opened like the database's own connection: with
its libpq options (TCP keepalives, so a LISTEN on a primary that vanished without a word
is noticed; sslmode; application_name), not bare."""

from __future__ import annotations

import pytest
from django.db import connection

from jobs.notify import CancelListener, PostgresWaker

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("listener_class", [CancelListener, PostgresWaker])
def test_listen_connections_use_the_databases_libpq_options(listener_class):
    settings_dict = dict(connection.settings_dict)
    assert settings_dict["OPTIONS"]["keepalives_idle"] == 30  # config/settings.py
    settings_dict["OPTIONS"] = {**settings_dict["OPTIONS"], "application_name": "hf-listen"}
    listener = listener_class(settings_dict)
    try:
        conn = listener._connect()
        assert conn is not None
        dsn = dict(part.split("=", 1) for part in conn.info.dsn.split())
        assert (dsn["keepalives"], dsn["keepalives_idle"], dsn["keepalives_count"]) == (
            "1",
            "30",
            "3",
        )
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT query FROM pg_stat_activity WHERE application_name = 'hf-listen'"
            )
            assert [row[0] for row in cursor.fetchall()] == [f"LISTEN {listener._channel}"]
    finally:
        listener.close()
