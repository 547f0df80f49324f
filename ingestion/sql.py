"""The spool ingester's statements, kept together, each one vendor-specific where it must be.

Every statement takes the batch's data as **bound parameters that are never inlined into
the statement text**: on PostgreSQL they run on a server-side binding cursor
(:func:`execute`; the extended protocol sends ``$1`` and the value apart, unnamed and
unprepared, so they also work behind PgBouncer), not on Django's client-side binding
cursor, which would paste the whole batch into the SQL text and so into the server log of
every failed flush (``log_min_error_statement``). SQLite always binds.

ensure_labs
    Create the batch's labs that do not exist (``ON CONFLICT DO NOTHING``) and return
    ``name -> id``.

acked
    The hashes of the batch already in ``ingested_submissions``.

upsert_facts
    Write a batch's facts in one statement: ``INSERT … ON CONFLICT (lab_id, entity, key)
    DO UPDATE … WHERE excluded.submitted_at >= facts.submitted_at``. The guard is the whole
    point: an older submission arriving after a newer one changes nothing, so out-of-order
    arrival cannot regress data and re-applying a batch is harmless.

insert_acks
    Write a batch's ack rows in one statement, ``applied_at`` from the database clock. A
    plain INSERT: the caller skips hashes already acked, and a duplicate key is a database
    error that rolls the batch back.

open_issue / find_issues
    The reconciliation issue of a quarantined file (``details`` as JSON), and the earlier
    issues of the same bytes (re-quarantining opens a new issue that names the old one).

Rows travel as ONE JSON document per statement (``jsonb_to_recordset`` on PostgreSQL,
``json_each`` on SQLite): the statement text is the same whatever the batch size. The
facts' attributes are JSON text made by the readers (:func:`ingestion.submissions.encode`,
every digit of every number kept) and are pasted into the document as they are.

The caller passes at most one fact per (lab_id, entity, key): PostgreSQL refuses to
update one row twice in a statement, so the batch keeps only the newest fact of each.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections

from .models import Fact, IngestedSubmission, Lab, ReconciliationIssue

FACTS = Fact._meta.db_table
ACKS = IngestedSubmission._meta.db_table
LABS = Lab._meta.db_table
ISSUES = ReconciliationIssue._meta.db_table

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
POSTGRES_LABS = (
    f"INSERT INTO {LABS} (name) SELECT jsonb_array_elements_text(%s::jsonb) "
    "ON CONFLICT (name) DO NOTHING"
)
POSTGRES_LAB_IDS = (
    f"SELECT name, id FROM {LABS} WHERE name IN (SELECT jsonb_array_elements_text(%s::jsonb))"
)
POSTGRES_ACKED = (
    f"SELECT hash FROM {ACKS} WHERE hash IN (SELECT jsonb_array_elements_text(%s::jsonb))"
)
POSTGRES_FIND_ISSUES = (
    f"SELECT id, subject, status, details->>'read_as' FROM {ISSUES} "
    "WHERE kind = %s AND details->>'hash' = %s ORDER BY id"
)
POSTGRES_OPEN_ISSUE = (
    f"INSERT INTO {ISSUES} (kind, source, subject, details, status, resolved_by, comment) "
    "VALUES (%s, '', %s, %s::jsonb, 'open', '', '') RETURNING id"
)

# SQLite: the same statements over json_each (values bound, one parameter each).
SQLITE_NOW = "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')"  # Django's Now() on SQLite
SQLITE_UPSERT = (
    f"INSERT INTO {FACTS} ({FACT_COLUMNS}) "
    "SELECT json_extract(value, '$.lab_id'), json_extract(value, '$.entity'), "
    "json_extract(value, '$.key'), json_extract(value, '$.attributes_text'), "
    "json_extract(value, '$.submitted_at') "
    f"FROM json_each(%s) WHERE true {UPSERT_GUARD}"
)
SQLITE_ACKS = (
    f"INSERT INTO {ACKS} ({ACK_COLUMNS}, applied_at) "
    "SELECT json_extract(value, '$.hash'), json_extract(value, '$.file_name'), "
    "json_extract(value, '$.lab_id'), json_extract(value, '$.submitted_at'), "
    "json_extract(value, '$.fact_count'), json_extract(value, '$.log_excerpt'), "
    f"{SQLITE_NOW} FROM json_each(%s)"
)
SQLITE_LABS = (
    f"INSERT INTO {LABS} (name, created_at) SELECT value, {SQLITE_NOW} FROM json_each(%s) "
    "WHERE true ON CONFLICT (name) DO NOTHING"
)
SQLITE_LAB_IDS = f"SELECT name, id FROM {LABS} WHERE name IN (SELECT value FROM json_each(%s))"
SQLITE_ACKED = f"SELECT hash FROM {ACKS} WHERE hash IN (SELECT value FROM json_each(%s))"
SQLITE_FIND_ISSUES = (
    f"SELECT id, subject, status, json_extract(details, '$.read_as') FROM {ISSUES} "
    "WHERE kind = %s AND json_extract(details, '$.hash') = %s ORDER BY id"
)
SQLITE_OPEN_ISSUE = (
    f"INSERT INTO {ISSUES} (kind, source, subject, details, status, resolved_by, comment, "
    f"created_at) VALUES (%s, '', %s, %s, 'open', '', '', {SQLITE_NOW}) RETURNING id"
)


@dataclass(frozen=True)
class FactWrite:
    lab_id: int
    entity: str
    key: str
    attributes: str  # JSON text
    submitted_at: datetime


@dataclass(frozen=True)
class AckWrite:
    hash: str
    file_name: str
    lab_id: int
    submitted_at: datetime
    fact_count: int
    log_excerpt: str


def execute(using: str, statement: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Run ``statement`` with ``params`` bound, never inlined; return the rows (if any).

    PostgreSQL: a server-side binding psycopg cursor on Django's connection (inside the
    caller's transaction), errors translated to Django's as every other query's.
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(statement, params)
            return list(cursor.fetchall()) if cursor.description else []
    connection.ensure_connection()
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(statement, params, prepare=False)
        return list(cursor.fetchall()) if cursor.description else []


def _postgres(using: str) -> bool:
    return bool(connections[using].vendor == "postgresql")


def ensure_labs(names: Sequence[str], using: str = DEFAULT_DB_ALIAS) -> dict[str, int]:
    if not names:
        return {}
    document = json.dumps(list(names))
    pg = _postgres(using)
    execute(using, POSTGRES_LABS if pg else SQLITE_LABS, [document])
    return {
        name: lab_id
        for name, lab_id in execute(using, POSTGRES_LAB_IDS if pg else SQLITE_LAB_IDS, [document])
    }


def acked(hashes: Sequence[str], using: str = DEFAULT_DB_ALIAS) -> set[str]:
    if not hashes:
        return set()
    statement = POSTGRES_ACKED if _postgres(using) else SQLITE_ACKED
    return {row[0] for row in execute(using, statement, [json.dumps(list(hashes))])}


def upsert_facts(rows: Sequence[FactWrite], using: str = DEFAULT_DB_ALIAS) -> None:
    """Upsert ``rows`` (unique on lab, entity, key) inside the caller's transaction."""
    if not rows:
        return
    pg = _postgres(using)
    times = _iso_times() if pg else _sqlite_times(connections[using])
    dumps = json.JSONEncoder(ensure_ascii=False).encode
    if pg:  # the attributes' text goes into the document as it is: one jsonb value each
        parts = [
            f'{{"lab_id":{row.lab_id},"entity":{dumps(row.entity)},"key":{dumps(row.key)},'
            f'"attributes":{row.attributes},"submitted_at":"{times(row.submitted_at)}"}}'
            for row in rows
        ]
    else:  # as text, stored as it is (SQLite keeps the text: all digits)
        parts = [
            f'{{"lab_id":{row.lab_id},"entity":{dumps(row.entity)},"key":{dumps(row.key)},'
            f'"attributes_text":{dumps(row.attributes)},'
            f'"submitted_at":"{times(row.submitted_at)}"}}'
            for row in rows
        ]
    execute(using, POSTGRES_UPSERT if pg else SQLITE_UPSERT, ["[" + ",".join(parts) + "]"])


def insert_acks(rows: Sequence[AckWrite], using: str = DEFAULT_DB_ALIAS) -> None:
    """Insert the ack rows of a batch inside the caller's transaction on ``using``."""
    if not rows:
        return
    pg = _postgres(using)
    times = _iso_times() if pg else _sqlite_times(connections[using])
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
    execute(using, POSTGRES_ACKS if pg else SQLITE_ACKS, [json.dumps(document)])


def find_issues(
    kind: str, hash: str, using: str = DEFAULT_DB_ALIAS
) -> list[tuple[int, str, str, str | None]]:
    """(id, subject, status, ``details.read_as``) of the issues of ``kind`` about the bytes
    ``hash``, oldest first."""
    statement = POSTGRES_FIND_ISSUES if _postgres(using) else SQLITE_FIND_ISSUES
    return [
        (int(i), str(s), str(t), None if r is None else str(r))
        for i, s, t, r in execute(using, statement, [kind, hash])
    ]


def serialize_issue(key: str, using: str) -> None:
    """Until the caller's transaction ends, be the only one deciding on an issue of
    ``key``: two ingesters of one spool, each finding no issue, opened one each.
    (SQLite's write lock, taken at BEGIN IMMEDIATE, already serializes the deciders.)"""
    if _postgres(using):
        execute(using, "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [key])


def open_issue(kind: str, subject: str, details: dict[str, Any], using: str) -> int:
    """Insert an open issue inside the caller's transaction; its id."""
    statement = POSTGRES_OPEN_ISSUE if _postgres(using) else SQLITE_OPEN_ISSUE
    ((issue_id,),) = execute(using, statement, [kind, subject, json.dumps(details)])
    return int(issue_id)


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
            value = cache[moment] = str(adapt(moment))
        return value

    return text
