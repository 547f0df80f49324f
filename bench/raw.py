"""The raw-SQL bounds: what the database allows without Holdfast, measured in the same run.

No Django here: plain psycopg (PostgreSQL) and sqlite3 (SQLite) against the same migrated
``jobs_job`` table, so indexes, row width and the server's settings are the same ones
Holdfast runs on.

* The claim/complete bound is a minimal worker loop: claim one job per transaction (on
  PostgreSQL with ``FOR UPDATE SKIP LOCKED``; on SQLite under ``BEGIN IMMEDIATE``), commit,
  then complete it in a second transaction fenced by ``state = 'running' AND lease_token``.
  It keeps ``leased_by`` so the run can be timed per worker from the rows.
* The insert bounds write the same rows ``enqueue_many`` writes: one per transaction, and
  in bulk (``COPY`` on PostgreSQL, ``executemany`` in one transaction on SQLite).
* The minimal-table bound runs the same loop on ``bench_minimal_job``: a table of its own
  with only the columns the loop reads or writes and one partial index on runnable rows,
  as other queues' benchmarks use (no lane/kind/state/expiry/finished indexes, no unused
  columns): what the claim/complete loop costs with nothing else to maintain.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

import psycopg

KIND = "bench.noop"
SEED_COLUMNS = (
    "kind",
    "lane",
    "args",
    "priority",
    "state",
    "attempts",
    "max_attempts",
    "lease_seconds",
    "lease_token",
    "cancel_requested",
    "last_error",
    "locks",
)


def seed_row(i: int) -> tuple[Any, ...]:
    """One queued no-op job, as ``enqueue_many("bench.noop", [{"i": i}])`` would write it."""
    return (KIND, "default", json.dumps({"i": i}), 0, "queued", 0, 1, 60.0, 0, False, "", "[]")


@dataclass(frozen=True)
class Target:
    """A scratch database: ``vendor`` is ``postgres`` (``dsn``) or ``sqlite`` (``path``)."""

    vendor: str
    dsn: str = ""
    path: str = ""

    def connect(self) -> Any:
        if self.vendor == "postgres":
            return psycopg.connect(self.dsn)
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=20)
        # The settings Holdfast's SQLite connections use (config/settings.py).
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn


# --- inserts ---------------------------------------------------------------------------


def insert_bulk(target: Target, n: int, first: int = 0) -> float:
    """Insert n queued jobs in one transaction, the fastest way the driver has; seconds."""
    rows = [seed_row(first + i) for i in range(n)]
    columns = ", ".join(SEED_COLUMNS)
    conn = target.connect()
    try:
        start = time.perf_counter()
        if target.vendor == "postgres":
            with (
                conn.cursor() as cursor,
                cursor.copy(f"COPY jobs_job ({columns}) FROM STDIN") as copy,
            ):
                for row in rows:
                    copy.write_row(row)
            conn.commit()
        else:
            marks = ", ".join("?" * len(SEED_COLUMNS))
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(f"INSERT INTO jobs_job ({columns}) VALUES ({marks})", rows)
            conn.execute("COMMIT")
        return time.perf_counter() - start
    finally:
        conn.close()


def insert_single(target: Target, n: int) -> float:
    """Insert n queued jobs, one INSERT and one commit each; seconds."""
    columns = ", ".join(SEED_COLUMNS)
    conn = target.connect()
    try:
        start = time.perf_counter()
        if target.vendor == "postgres":
            marks = ", ".join(["%s"] * len(SEED_COLUMNS))
            sql = f"INSERT INTO jobs_job ({columns}) VALUES ({marks})"
            with conn.cursor() as cursor:
                for i in range(n):
                    cursor.execute(sql, seed_row(i))
                    conn.commit()
        else:
            marks = ", ".join("?" * len(SEED_COLUMNS))
            sql = f"INSERT INTO jobs_job ({columns}) VALUES ({marks})"
            for i in range(n):
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(sql, seed_row(i))
                conn.execute("COMMIT")
        return time.perf_counter() - start
    finally:
        conn.close()


# --- the minimal table -----------------------------------------------------------------

MINIMAL_TABLE = "bench_minimal_job"

PG_MINIMAL_DDL = f"""
DROP TABLE IF EXISTS {MINIMAL_TABLE};
CREATE TABLE {MINIMAL_TABLE} (
    id bigserial PRIMARY KEY,
    state text NOT NULL DEFAULT 'queued',
    priority smallint NOT NULL DEFAULT 0,
    run_at timestamptz NOT NULL DEFAULT now(),
    args jsonb NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    lease_seconds double precision NOT NULL DEFAULT 60,
    lease_token bigint NOT NULL DEFAULT 0,
    leased_by text,
    lease_expires_at timestamptz,
    started_at timestamptz,
    finished_at timestamptz
);
CREATE INDEX {MINIMAL_TABLE}_runnable ON {MINIMAL_TABLE} (priority DESC, run_at, id)
    WHERE state = 'queued';
"""

SQLITE_MINIMAL_DDL = f"""
DROP TABLE IF EXISTS {MINIMAL_TABLE};
CREATE TABLE {MINIMAL_TABLE} (
    id integer PRIMARY KEY AUTOINCREMENT,
    state text NOT NULL DEFAULT 'queued',
    priority integer NOT NULL DEFAULT 0,
    run_at text NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    args text NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    lease_seconds real NOT NULL DEFAULT 60,
    lease_token integer NOT NULL DEFAULT 0,
    leased_by text,
    lease_expires_at text,
    started_at text,
    finished_at text
);
CREATE INDEX {MINIMAL_TABLE}_runnable ON {MINIMAL_TABLE} (priority DESC, run_at, id)
    WHERE state = 'queued';
"""


def seed_minimal(target: Target, n: int) -> None:
    """(Re)create the minimal table with n queued jobs, analyzed (and checkpointed)."""
    conn = target.connect()
    try:
        if target.vendor == "postgres":
            conn.autocommit = True
            conn.execute(PG_MINIMAL_DDL)
            conn.execute(
                f"INSERT INTO {MINIMAL_TABLE} (args) "
                "SELECT jsonb_build_object('i', g) FROM generate_series(0, %s - 1) AS g",
                (n,),
            )
            conn.execute(f"ANALYZE {MINIMAL_TABLE}")
            conn.execute("CHECKPOINT")
        else:
            conn.executescript(SQLITE_MINIMAL_DDL)
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                f"INSERT INTO {MINIMAL_TABLE} (args) VALUES (?)",
                [(json.dumps({"i": i}),) for i in range(n)],
            )
            conn.execute("COMMIT")
            conn.execute(f"ANALYZE {MINIMAL_TABLE}")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


# --- the claim/complete loop -----------------------------------------------------------

# How the loop finds a runnable row, through the table's own claim index: on Holdfast's
# table the runnable index (lane, priority DESC, run_at, id) of unblocked queued rows, one
# lane (every benchmark job is in "default"), as a worker of that lane claims; on the
# minimal table its one partial index.
RUNNABLE = {
    "runnable": "state = 'queued' AND blocked_by IS NULL AND lane = 'default'",
    "order": "lane, priority DESC, run_at, id",
}
MINIMAL_RUNNABLE = {"runnable": "state = 'queued'", "order": "priority DESC, run_at, id"}

PG_CLAIM = """
UPDATE jobs_job SET
    state = 'running',
    attempts = attempts + 1,
    lease_token = lease_token + 1,
    leased_by = %s,
    lease_expires_at = now() + lease_seconds * interval '1 second',
    started_at = now()
WHERE id = (
    SELECT id FROM jobs_job
    WHERE {runnable} AND run_at <= now()
    ORDER BY {order}
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
RETURNING id, lease_token, args
"""

PG_COMPLETE = """
UPDATE jobs_job SET state = 'succeeded', finished_at = now(), lease_expires_at = NULL
WHERE id = %s AND state = 'running' AND lease_token = %s
"""

SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"

SQLITE_CLAIM = f"""
UPDATE jobs_job SET
    state = 'running',
    attempts = attempts + 1,
    lease_token = lease_token + 1,
    leased_by = ?,
    lease_expires_at = strftime('%Y-%m-%d %H:%M:%f', 'now',
                                printf('%+.3f seconds', lease_seconds)),
    started_at = {SQLITE_NOW}
WHERE id = (
    SELECT id FROM jobs_job
    WHERE {{runnable}} AND run_at <= {SQLITE_NOW}
    ORDER BY {{order}}
    LIMIT 1
)
RETURNING id, lease_token, args
"""

SQLITE_COMPLETE = f"""
UPDATE jobs_job SET state = 'succeeded', finished_at = {SQLITE_NOW}, lease_expires_at = NULL
WHERE id = ? AND state = 'running' AND lease_token = ?
"""


def claim_complete_loop(
    target: Target, worker_id: str, barrier: Any, table: str = "jobs_job"
) -> int:
    """Claim and complete jobs until none is runnable; returns how many it completed.

    ``barrier`` (a multiprocessing.Barrier) makes concurrent loops start together;
    ``table`` is ``jobs_job`` (Holdfast's own) or ``MINIMAL_TABLE``.
    """
    claim_sql, complete_sql = (
        (PG_CLAIM, PG_COMPLETE) if target.vendor == "postgres" else (SQLITE_CLAIM, SQLITE_COMPLETE)
    )
    claim_sql = claim_sql.format(**(RUNNABLE if table == "jobs_job" else MINIMAL_RUNNABLE))
    claim_sql, complete_sql = (q.replace("jobs_job", table) for q in (claim_sql, complete_sql))
    conn = target.connect()
    done = 0
    try:
        barrier.wait()
        if target.vendor == "postgres":
            with conn.cursor() as cursor:
                while True:
                    cursor.execute(claim_sql, (worker_id,))
                    row = cursor.fetchone()
                    conn.commit()
                    if row is None:
                        break
                    job_id, token, _args = row  # the "handler" does nothing
                    cursor.execute(complete_sql, (job_id, token))
                    if cursor.rowcount != 1:
                        raise RuntimeError(f"lost the lease on job {job_id}")
                    conn.commit()
                    done += 1
        else:
            while True:
                conn.execute("BEGIN IMMEDIATE")
                rows = conn.execute(claim_sql, (worker_id,)).fetchall()
                conn.execute("COMMIT")
                if not rows:
                    break
                job_id, token, args = rows[0]
                json.loads(args)  # the driver does not decode JSON on SQLite; Holdfast does
                conn.execute("BEGIN IMMEDIATE")
                cursor = conn.execute(complete_sql, (job_id, token))
                if cursor.rowcount != 1:
                    raise RuntimeError(f"lost the lease on job {job_id}")
                conn.execute("COMMIT")
                done += 1
    finally:
        conn.close()
    return done
