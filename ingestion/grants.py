"""Least privilege for the spool ingester on PostgreSQL (issue 5).

Two halves, both optional:

* When ``HOLDFAST_INGESTER_DB_ROLE`` names a role, the migration that creates the
  ingestion tables is followed by one that grants that role exactly what applying
  submissions needs, so a new table never ships without its GRANT. Nothing happens on
  SQLite or when the setting is unset.
* When ``HOLDFAST_INGESTER_DATABASE_URL`` is set (the database alias ``ingester``, which
  logs in as that role), every database access of the spool ingester goes through that
  alias (:func:`ingester_database`); unset, the ingester uses ``default``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS
from psycopg import sql

#: The database alias the spool ingester uses when it is configured.
INGESTER_ALIAS = "ingester"

# table -> privileges: labs and facts are upserted, acks and issues only inserted.
PRIVILEGES = {
    "labs": ("SELECT", "INSERT", "UPDATE"),
    "facts": ("SELECT", "INSERT", "UPDATE"),
    "ingested_submissions": ("SELECT", "INSERT"),
    "ingestion_reconciliationissue": ("SELECT", "INSERT"),
}
# The tables whose id comes from a sequence (ingested_submissions is keyed by hash).
WITH_SEQUENCE = ("labs", "facts", "ingestion_reconciliationissue")


def ingester_database() -> str:
    """The alias of every database access the spool ingester makes: ``ingester`` when
    ``DATABASES`` has it (``HOLDFAST_INGESTER_DATABASE_URL``), else ``default``."""
    return INGESTER_ALIAS if INGESTER_ALIAS in settings.DATABASES else DEFAULT_DB_ALIAS


def ingester_role() -> str:
    return str(getattr(settings, "HOLDFAST_INGESTER_DB_ROLE", "") or "").strip()


def grant_ingester(connection: Any, role: str) -> None:
    """Grant ``role`` the ingester's privileges on ``connection``'s database (PostgreSQL)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
        if cursor.fetchone() is None:
            raise RuntimeError(
                f"HOLDFAST_INGESTER_DB_ROLE names the role {role!r}, which does not exist: "
                "create it first (CREATE ROLE ... LOGIN), then migrate again"
            )
        raw = cursor.connection  # psycopg, to compose identifiers safely
        for table, privileges in PRIVILEGES.items():
            cursor.execute(
                sql.SQL("GRANT {} ON TABLE {} TO {}")
                .format(
                    sql.SQL(", ").join(map(sql.SQL, privileges)),
                    sql.Identifier(table),
                    sql.Identifier(role),
                )
                .as_string(raw)
            )
            if table not in WITH_SEQUENCE:
                continue
            cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", [table])
            (sequence,) = cursor.fetchone()
            if sequence:
                cursor.execute(
                    sql.SQL("GRANT USAGE, SELECT ON SEQUENCE {} TO {}")
                    .format(sql.SQL(sequence), sql.Identifier(role))
                    .as_string(raw)
                )


def grant_from_settings(apps: Any, schema_editor: Any) -> None:
    """Migration step: grant the configured role, on PostgreSQL only."""
    role = ingester_role()
    if role and schema_editor.connection.vendor == "postgresql":
        grant_ingester(schema_editor.connection, role)
