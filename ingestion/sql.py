"""The ingestion side's vendor-specific statements, kept together.

upsert_facts
    Write a batch's facts in one statement per vendor (per chunk on SQLite, whose bound
    parameters are limited): ``INSERT … ON CONFLICT (lab_id, entity, key) DO UPDATE …
    WHERE excluded.submitted_at >= facts.submitted_at``. The guard is the whole point: an
    older submission arriving after a newer one changes nothing, so out-of-order arrival
    cannot regress data and re-applying a batch is harmless. PostgreSQL takes the rows as
    arrays (``unnest``), so the statement text is the same whatever the batch size.

The caller passes at most one row per (lab_id, entity, key): PostgreSQL refuses to
update one row twice in a statement, so the batch keeps only the newest fact of each.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection

from .models import Fact

FACTS = Fact._meta.db_table

# SQLite allows 32766 bound parameters per statement (since 3.32); stay well below.
SQLITE_ROWS_PER_STATEMENT = 2000

UPSERT_GUARD = (
    "ON CONFLICT (lab_id, entity, key) DO UPDATE "
    "SET attributes = excluded.attributes, submitted_at = excluded.submitted_at "
    f"WHERE excluded.submitted_at >= {FACTS}.submitted_at"
)

POSTGRES_UPSERT = (
    f"INSERT INTO {FACTS} (lab_id, entity, key, attributes, submitted_at) "
    "SELECT * FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::jsonb[], "
    f"%s::timestamptz[]) {UPSERT_GUARD}"
)


@dataclass(frozen=True)
class FactWrite:
    lab_id: int
    entity: str
    key: str
    attributes: dict[str, Any]
    submitted_at: datetime


def upsert_facts(rows: Sequence[FactWrite]) -> None:
    """Upsert ``rows`` (unique on lab, entity, key) inside the caller's transaction."""
    if not rows:
        return
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                POSTGRES_UPSERT,
                [
                    [row.lab_id for row in rows],
                    [row.entity for row in rows],
                    [row.key for row in rows],
                    [json.dumps(row.attributes) for row in rows],
                    [row.submitted_at for row in rows],
                ],
            )
            return
        adapt = connection.ops.adapt_datetimefield_value
        for start in range(0, len(rows), SQLITE_ROWS_PER_STATEMENT):
            chunk = rows[start : start + SQLITE_ROWS_PER_STATEMENT]
            values = ", ".join(["(%s, %s, %s, %s, %s)"] * len(chunk))
            params: list[Any] = []
            for row in chunk:
                params += [
                    row.lab_id,
                    row.entity,
                    row.key,
                    json.dumps(row.attributes),
                    adapt(row.submitted_at),
                ]
            cursor.execute(
                f"INSERT INTO {FACTS} (lab_id, entity, key, attributes, submitted_at) "
                f"VALUES {values} {UPSERT_GUARD}",
                params,
            )
