"""The ingestion side's vendor-specific statements, kept together.

upsert_facts
    Write a batch's facts in one statement per vendor (per chunk on SQLite, whose bound
    parameters are limited): ``INSERT … ON CONFLICT (lab_id, entity, key) DO UPDATE …
    WHERE excluded.submitted_at >= facts.submitted_at``. The guard is the whole point: an
    older submission arriving after a newer one changes nothing, so out-of-order arrival
    cannot regress data and re-applying a batch is harmless.

insert_acks
    Write a batch's ack rows (``ingested_submissions``) in one statement, ``applied_at``
    from the database clock. A plain INSERT: the caller skips hashes already acked, and
    a duplicate key is a database error that rolls the batch back.

On PostgreSQL each statement takes the whole batch as ONE JSON document
(``jsonb_to_recordset``): the statement text is the same whatever the batch size, and the
rows cost one ``json.dumps`` (in C) to send. Passing them as arrays made psycopg quote
every element in Python, about half of the writer's time (docs/benchmarks.md); the ORM's
``bulk_create`` of the ack rows cost another tenth.

The caller passes at most one fact per (lab_id, entity, key): PostgreSQL refuses to
update one row twice in a statement, so the batch keeps only the newest fact of each.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

from .models import Fact, IngestedSubmission

FACTS = Fact._meta.db_table
ACKS = IngestedSubmission._meta.db_table

# SQLite allows 32766 bound parameters per statement (since 3.32); stay well below.
SQLITE_PARAMETERS_PER_STATEMENT = 10_000

UPSERT_GUARD = (
    "ON CONFLICT (lab_id, entity, key) DO UPDATE "
    "SET attributes = excluded.attributes, submitted_at = excluded.submitted_at "
    f"WHERE excluded.submitted_at >= {FACTS}.submitted_at"
)
FACT_COLUMNS = "lab_id, entity, key, attributes, submitted_at"
ACK_COLUMNS = "hash, file_name, lab_id, submitted_at, fact_count, log_excerpt"

POSTGRES_UPSERT = (
    f"INSERT INTO {FACTS} ({FACT_COLUMNS}) SELECT {FACT_COLUMNS} "
    "FROM jsonb_to_recordset(%s::jsonb) AS r(lab_id bigint, entity text, key text, "
    f"attributes jsonb, submitted_at timestamptz) {UPSERT_GUARD}"
)
POSTGRES_ACKS = (
    f"INSERT INTO {ACKS} ({ACK_COLUMNS}, applied_at) SELECT {ACK_COLUMNS}, statement_timestamp() "
    "FROM jsonb_to_recordset(%s::jsonb) AS r(hash text, file_name text, lab_id bigint, "
    "submitted_at timestamptz, fact_count integer, log_excerpt text)"
)
# Django's Now() on SQLite, so applied_at reads back like any other DateTimeField.
SQLITE_NOW = "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')"


@dataclass(frozen=True)
class FactWrite:
    lab_id: int
    entity: str
    key: str
    attributes: dict[str, Any]
    submitted_at: datetime


@dataclass(frozen=True)
class AckWrite:
    hash: str
    file_name: str
    lab_id: int
    submitted_at: datetime
    fact_count: int
    log_excerpt: str


def upsert_facts(rows: Sequence[FactWrite], using: str = DEFAULT_DB_ALIAS) -> None:
    """Upsert ``rows`` (unique on lab, entity, key) inside the caller's transaction on the
    database ``using``."""
    if not rows:
        return
    connection = connections[using]
    if connection.vendor == "postgresql":
        times = _iso_times()
        document = [
            {
                "lab_id": row.lab_id,
                "entity": row.entity,
                "key": row.key,
                "attributes": row.attributes,
                "submitted_at": times(row.submitted_at),
            }
            for row in rows
        ]
        with connection.cursor() as cursor:
            cursor.execute(POSTGRES_UPSERT, [json.dumps(document)])
        return
    times = _sqlite_times(connection)
    _sqlite_insert(
        connection,
        f"INSERT INTO {FACTS} ({FACT_COLUMNS}) VALUES {{values}} {UPSERT_GUARD}",
        "(%s, %s, %s, %s, %s)",
        [
            (row.lab_id, row.entity, row.key, json.dumps(row.attributes), times(row.submitted_at))
            for row in rows
        ],
    )


def insert_acks(rows: Sequence[AckWrite], using: str = DEFAULT_DB_ALIAS) -> None:
    """Insert the ack rows of a batch inside the caller's transaction on ``using``."""
    if not rows:
        return
    connection = connections[using]
    if connection.vendor == "postgresql":
        times = _iso_times()
        document = [
            {
                "hash": row.hash,
                "file_name": row.file_name,
                "lab_id": row.lab_id,
                "submitted_at": times(row.submitted_at),
                "fact_count": row.fact_count,
                "log_excerpt": row.log_excerpt,
            }
            for row in rows
        ]
        with connection.cursor() as cursor:
            cursor.execute(POSTGRES_ACKS, [json.dumps(document)])
        return
    times = _sqlite_times(connection)
    _sqlite_insert(
        connection,
        f"INSERT INTO {ACKS} ({ACK_COLUMNS}, applied_at) VALUES {{values}}",
        f"(%s, %s, %s, %s, %s, %s, {SQLITE_NOW})",
        [
            (
                row.hash,
                row.file_name,
                row.lab_id,
                times(row.submitted_at),
                row.fact_count,
                row.log_excerpt,
            )
            for row in rows
        ],
    )


def _iso_times() -> Callable[[datetime], str]:
    """ISO 8601 text of a time, computed once per distinct time (a batch has few)."""
    cache: dict[datetime, str] = {}

    def iso(moment: datetime) -> str:
        text = cache.get(moment)
        if text is None:
            text = cache[moment] = moment.isoformat()
        return text

    return iso


def _sqlite_times(connection: Any) -> Callable[[datetime], str]:
    """Django's SQLite text of a time, computed once per distinct time."""
    cache: dict[datetime, str] = {}
    adapt = connection.ops.adapt_datetimefield_value

    def text(moment: datetime) -> str:
        value = cache.get(moment)
        if value is None:
            value = cache[moment] = adapt(moment)
        return value

    return text


def _sqlite_insert(
    connection: Any, statement: str, row_template: str, rows: list[tuple[Any, ...]]
) -> None:
    """Run ``statement`` (with ``{values}``) over ``rows`` in chunks that stay under
    SQLite's limit on bound parameters."""
    per_statement = max(1, SQLITE_PARAMETERS_PER_STATEMENT // len(rows[0]))
    with connection.cursor() as cursor:
        for start in range(0, len(rows), per_statement):
            chunk = rows[start : start + per_statement]
            values = ", ".join([row_template] * len(chunk))
            cursor.execute(
                statement.format(values=values), [value for row in chunk for value in row]
            )
