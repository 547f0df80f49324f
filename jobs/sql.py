"""The engine's vendor-specific statements: claim and settle, for PostgreSQL and SQLite.

These are the hot path, so each is as few round trips as the database allows, and each
carries its guard in plain sight. Time always comes from the database clock
(``statement_timestamp()``, like Django's ``Now()``), never from a worker's clock:

* claim takes the best runnable job and writes its attempt (lease) row. PostgreSQL does
  it in one statement (``FOR UPDATE SKIP LOCKED`` in a CTE, so concurrent workers never
  wait on each other or take the same row); SQLite does it inside ``BEGIN IMMEDIATE``,
  which serializes writers, with one ``UPDATE … RETURNING``.
* settle moves a job out of ``running`` only ``WHERE state = 'running' AND lease_token =
  <mine>`` and records the attempt's outcome in the same transaction. Zero rows means the
  lease was lost, and the caller raises ``LeaseLost``.

Everything else in the engine is ORM.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
from django.db import IntegrityError, connection, transaction
from django.db.models import Count
from django.utils.dateparse import parse_datetime

from .models import ATTEMPT_COUNT_SHARDS, DURATION_BUCKETS, Job


@dataclass(frozen=True)
class Claimed:
    """A job this worker holds under a lease: what the worker needs to run and settle it."""

    id: int
    kind: str
    lane: str
    args: dict[str, Any]
    attempt: int
    max_attempts: int
    lease_token: int
    lease_seconds: float
    lease_expires_at: datetime
    locks: tuple[str, ...]
    cancel_requested: bool  # a request that outlived an earlier attempt
    lease_id: int


@dataclass(frozen=True)
class Settlement:
    """How an attempt ends: the job's next state and the attempt's recorded outcome."""

    state: str  # queued | succeeded | dead | cancelled
    outcome: str  # see models.Outcome
    delay: float = 0.0  # with state=queued: seconds until the next attempt
    uncharge: bool = False  # a released claim does not count as an attempt
    result: Any = None
    last_error: str | None = None  # None keeps the job's previous summary
    error_class: str = ""
    error_message: str = ""
    traceback: str = ""
    context: dict[str, Any] | None = None


CLAIMED_COLUMNS = (
    "id, kind, lane, args, attempts, max_attempts, lease_token, lease_seconds, lease_expires_at, "
    "locks, cancel_requested"
)


def _columns(table: str) -> str:
    return ", ".join(f"{table}.{column.strip()}" for column in CLAIMED_COLUMNS.split(","))


# The claim, as CTEs: pick the best runnable row whose resource locks are all free
# (skipping rows other workers are locking), make it ours under the next lease token, write
# the attempt's lease row, take its locks in canonical (sorted) order, and log the event.
# Two claimers racing for one free resource both insert its lock row: the primary key makes
# the second one's whole statement fail (nothing of it commits), and it claims again (I8).
PG_CLAIM_CTES = f"""
candidate AS (
    SELECT id FROM jobs_job
    WHERE state = 'queued' AND run_at <= statement_timestamp() {{lane_filter}}
      AND (locks = '[]'::jsonb OR NOT EXISTS (
            SELECT 1 FROM jobs_joblock AS held
            WHERE held.resource IN (SELECT jsonb_array_elements_text(jobs_job.locks))))
    ORDER BY priority DESC, run_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE jobs_job AS job SET
        state = 'running',
        attempts = job.attempts + 1,
        lease_token = job.lease_token + 1,
        leased_by = %(worker)s::text,
        lease_expires_at = statement_timestamp() + job.lease_seconds * interval '1 second',
        heartbeat_at = statement_timestamp(),
        started_at = statement_timestamp(),
        updated_at = statement_timestamp()
    FROM candidate
    WHERE job.id = candidate.id AND job.state = 'queued'
    RETURNING {_columns("job")}
), lease AS (
    INSERT INTO jobs_lease (job_id, attempt, lease_token, worker_id, acquired_at, expires_at,
                            outcome, error_class, error_message, traceback, context)
    SELECT id, attempts, lease_token, %(worker)s::text, statement_timestamp(), lease_expires_at,
           'running', '', '', '', '{{{{}}}}'::jsonb
    FROM claimed
    RETURNING id
), taken_locks AS (
    INSERT INTO jobs_joblock (resource, job_id, lease_token, acquired_at)
    SELECT lock.resource, claimed.id, claimed.lease_token, statement_timestamp()
    FROM claimed, jsonb_array_elements_text(claimed.locks) WITH ORDINALITY AS lock(resource, n)
    ORDER BY lock.n
), claim_event AS (
    INSERT INTO jobs_jobevent (job_id, at, event, lease_token, worker_id, data)
    SELECT id, statement_timestamp(), 'claimed', lease_token, %(worker)s::text,
           jsonb_build_object('attempt', attempts, 'expires_at', lease_expires_at)
    FROM claimed
)"""


def _bucket(seconds: str) -> str:
    """SQL: the index in ``DURATION_BUCKETS`` of the bucket holding ``seconds``."""
    cases = " ".join(f"WHEN {seconds} <= {b} THEN {i}" for i, b in enumerate(DURATION_BUCKETS))
    return f"CASE {cases} ELSE {len(DURATION_BUCKETS)} END"


SHARDS = ATTEMPT_COUNT_SHARDS
# An attempt's duration, claim to now, on the database clock (the lease row of job_id, token).
PG_ATTEMPT_SECONDS = """
SELECT greatest(0, extract(epoch FROM statement_timestamp() - acquired_at))::float8 AS s
FROM jobs_lease WHERE job_id = %(job_id)s::bigint AND lease_token = %(token)s::bigint"""

# The settle, as CTEs: fenced by state and lease token; the lease row, the lock release,
# the event, the attempt counter (metrics) and, into a finished state, the lane's count of
# jobs in that state (jobs_jobcount) are written only if the job row was.
PG_SETTLE_CTES = f"""
settled AS (
    UPDATE jobs_job SET
        state = %(state)s::text,
        run_at = CASE WHEN %(state)s::text = 'queued'
                      THEN statement_timestamp() + %(delay)s::float8 * interval '1 second'
                      ELSE run_at END,
        attempts = attempts - %(uncharge)s::integer,
        result = %(result)s::jsonb,
        last_error = COALESCE(%(last_error)s::text, last_error),
        finished_at = CASE WHEN %(state)s::text = 'queued' THEN NULL ELSE statement_timestamp() END,
        leased_by = NULL,
        lease_expires_at = NULL,
        updated_at = statement_timestamp()
    WHERE id = %(job_id)s::bigint AND state = 'running' AND lease_token = %(token)s::bigint
    RETURNING id, cancel_requested
), settled_lease AS (
    UPDATE jobs_lease SET
        outcome = %(outcome)s::text, released_at = statement_timestamp(),
        error_class = %(error_class)s::text, error_message = %(error_message)s::text,
        traceback = %(traceback)s::text, context = %(context)s::jsonb
    WHERE id = %(lease_id)s::bigint AND EXISTS (SELECT 1 FROM settled)
    RETURNING worker_id
), released_locks AS (
    DELETE FROM jobs_joblock
    WHERE job_id = %(job_id)s::bigint AND lease_token = %(token)s::bigint
      AND EXISTS (SELECT 1 FROM settled)
), settle_event AS (
    INSERT INTO jobs_jobevent (job_id, at, event, lease_token, worker_id, data)
    SELECT settled.id, statement_timestamp(), 'settled', %(token)s::bigint, settled_lease.worker_id,
           jsonb_build_object('state', %(state)s::text, 'outcome', %(outcome)s::text,
                              'cancel_requested', settled.cancel_requested)
    FROM settled CROSS JOIN settled_lease
), counted AS (
    INSERT INTO jobs_attemptcount (kind, outcome, bucket, shard, count, seconds)
    SELECT %(kind)s::text, %(outcome)s::text, {_bucket("took.s")}, mod(pg_backend_pid(), {SHARDS}),
           1, took.s
    FROM settled CROSS JOIN ({PG_ATTEMPT_SECONDS}) AS took
    ON CONFLICT (kind, outcome, bucket, shard) DO UPDATE SET
        count = jobs_attemptcount.count + 1, seconds = jobs_attemptcount.seconds + EXCLUDED.seconds
), finished_count AS (
    INSERT INTO jobs_jobcount (lane, state, shard, count)
    SELECT %(lane)s::text, %(state)s::text, mod(pg_backend_pid(), {SHARDS}), 1
    FROM settled WHERE %(state)s::text <> 'queued'
    ON CONFLICT (lane, state, shard) DO UPDATE SET count = jobs_jobcount.count + 1
)"""

PG_CLAIM = f"""
WITH {PG_CLAIM_CTES}
SELECT {_columns("claimed")}, lease.id FROM claimed CROSS JOIN lease
"""

PG_SETTLE = f"""
WITH {PG_SETTLE_CTES}
SELECT (SELECT count(*) FROM settled)
"""

# Settle one job and claim the next in one statement: one round trip and one commit per
# job. The claim reads the snapshot from before the settle, so it never takes back the job
# it just settled (that row is still 'running' there).
PG_SETTLE_AND_CLAIM = f"""
WITH {PG_SETTLE_CTES}, {PG_CLAIM_CTES}
SELECT (SELECT count(*) FROM settled), {_columns("claimed")}, lease.id
FROM (SELECT 1) AS one LEFT JOIN claimed ON true LEFT JOIN lease ON true
"""

# Serialize claims from lanes with a max_running, lane by lane in sorted order (so two
# claimers never wait on each other crosswise); released when the transaction ends.
PG_LOCK_LANE = "SELECT pg_advisory_xact_lock(hashtext('holdfast.lane:' || %s::text))"

BULK_INSERT_CHUNK = 10_000
MAX_LOCK_RACES = 50  # each lost race means another claimer's lock committed: progress

# Bulk enqueue: the options are the same for every job, only the args differ, so one
# JSON array parameter carries them; ORDINALITY keeps RETURNING in the caller's order.
PG_INSERT_JOBS = """
INSERT INTO jobs_job (kind, lane, args, locks, priority, state, run_at, attempts, max_attempts,
                      lease_seconds, lease_token, cancel_requested, last_error,
                      created_at, updated_at)
SELECT %(kind)s, %(lane)s, a.args, COALESCE(%(locks)s::jsonb -> (a.n::int - 1), '[]'::jsonb),
       %(priority)s, 'queued',
       COALESCE(%(run_at)s::timestamptz,
                statement_timestamp() + %(delay)s * interval '1 second'),
       0, %(max_attempts)s, %(lease_seconds)s, 0, false, '',
       statement_timestamp(), statement_timestamp()
FROM jsonb_array_elements(%(args)s::jsonb) WITH ORDINALITY AS a(args, n)
ORDER BY a.n
RETURNING id, run_at, created_at
"""

# SQLite: the same statements split in two, inside one BEGIN IMMEDIATE transaction.
SQLITE_NOW = "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"

SQLITE_CLAIM = f"""
UPDATE jobs_job SET
    state = 'running',
    attempts = attempts + 1,
    lease_token = lease_token + 1,
    leased_by = %(worker)s,
    lease_expires_at = strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now',
                                printf('%%+.3f seconds', lease_seconds)),
    heartbeat_at = {SQLITE_NOW},
    started_at = {SQLITE_NOW},
    updated_at = {SQLITE_NOW}
WHERE id = (
    SELECT id FROM jobs_job
    WHERE state = 'queued' AND run_at <= {SQLITE_NOW} {{lane_filter}}
      AND (locks = '[]' OR NOT EXISTS (
            SELECT 1 FROM jobs_joblock AS held
            WHERE held.resource IN (SELECT value FROM json_each(jobs_job.locks))))
    ORDER BY priority DESC, run_at, id
    LIMIT 1
)
RETURNING {CLAIMED_COLUMNS}
"""

SQLITE_INSERT_LEASE = f"""
INSERT INTO jobs_lease (job_id, attempt, lease_token, worker_id, acquired_at, expires_at,
                        outcome, error_class, error_message, traceback, context)
VALUES (%(job_id)s, %(attempt)s, %(token)s, %(worker)s, {SQLITE_NOW}, %(expires)s,
        'running', '', '', '', '{{}}')
RETURNING id
"""

SQLITE_TAKE_LOCKS = f"""
INSERT INTO jobs_joblock (resource, job_id, lease_token, acquired_at)
SELECT value, %(job_id)s, %(token)s, {SQLITE_NOW} FROM json_each(%(locks)s) ORDER BY key
"""

SQLITE_EVENT = f"""
INSERT INTO jobs_jobevent (job_id, at, event, lease_token, worker_id, data)
VALUES (%(job_id)s, {SQLITE_NOW}, %(event)s, %(token)s, %(worker)s, %(data)s)
"""

SQLITE_RELEASE_LOCKS = """
DELETE FROM jobs_joblock WHERE job_id = %(job_id)s AND lease_token = %(token)s
"""

SQLITE_SETTLE_JOB = f"""
UPDATE jobs_job SET
    state = %(state)s,
    run_at = CASE WHEN %(state)s = 'queued'
                  THEN strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %(delay_modifier)s)
                  ELSE run_at END,
    attempts = attempts - %(uncharge)s,
    result = %(result)s,
    last_error = COALESCE(%(last_error)s, last_error),
    finished_at = CASE WHEN %(state)s = 'queued' THEN NULL ELSE {SQLITE_NOW} END,
    leased_by = NULL,
    lease_expires_at = NULL,
    updated_at = {SQLITE_NOW}
WHERE id = %(job_id)s AND state = 'running' AND lease_token = %(token)s
RETURNING cancel_requested
"""

# The attempt counters (metrics): one upsert per ended attempt, in its settle's transaction.
SQLITE_COUNT_ATTEMPT = f"""
INSERT INTO jobs_attemptcount (kind, outcome, bucket, shard, count, seconds)
SELECT %(kind)s, %(outcome)s, {_bucket("took.s")}, 0, 1, took.s
FROM (SELECT max(0.0, (julianday('now') - julianday(acquired_at)) * 86400.0) AS s
      FROM jobs_lease WHERE job_id = %(job_id)s AND lease_token = %(token)s) AS took
WHERE true
ON CONFLICT (kind, outcome, bucket, shard) DO UPDATE SET
    count = count + 1, seconds = seconds + excluded.seconds
"""

PG_COUNT_ATTEMPT = f"""
INSERT INTO jobs_attemptcount (kind, outcome, bucket, shard, count, seconds)
SELECT %(kind)s::text, %(outcome)s::text, {_bucket("took.s")}, mod(pg_backend_pid(), {SHARDS}),
       1, took.s
FROM ({PG_ATTEMPT_SECONDS}) AS took
ON CONFLICT (kind, outcome, bucket, shard) DO UPDATE SET
    count = jobs_attemptcount.count + 1, seconds = jobs_attemptcount.seconds + EXCLUDED.seconds
"""


def count_attempt(kind: str, outcome: str, job_id: int, lease_token: int) -> None:
    """Count an attempt ended outside the settle statement (reclaim), in the caller's
    transaction."""
    statement = PG_COUNT_ATTEMPT if is_postgres() else SQLITE_COUNT_ATTEMPT
    params: dict[str, Any] = {
        "kind": kind,
        "outcome": outcome,
        "job_id": job_id,
        "token": lease_token,
    }
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


# The finished jobs' counts (jobs_jobcount): add ``delta`` jobs of (lane, state), in the
# transaction of the transitions they count.
COUNT_JOBS = """
INSERT INTO jobs_jobcount (lane, state, shard, count)
VALUES (%(lane)s, %(state)s, {shard}, %(delta)s)
ON CONFLICT (lane, state, shard) DO UPDATE SET count = jobs_jobcount.count + excluded.count
"""


def count_jobs(deltas: Mapping[tuple[str, str], int]) -> None:
    """Add ``deltas`` ((lane, state) → jobs in or out of that finished state) to the
    finished jobs' counts, in the caller's transaction."""
    shard = f"mod(pg_backend_pid(), {SHARDS})" if is_postgres() else "0"
    rows: list[dict[str, Any]] = [
        {"lane": lane, "state": state, "delta": delta}
        for (lane, state), delta in sorted(deltas.items())
        if delta
    ]
    if rows:
        with connection.cursor() as cursor:
            cursor.executemany(COUNT_JOBS.format(shard=shard), rows)


def lock_job_counts() -> None:
    """PostgreSQL, in the caller's transaction: hold off every writer of the finished
    jobs' counts until it ends (a recount). SQLite's write transaction already does."""
    if is_postgres():
        with connection.cursor() as cursor:
            cursor.execute("LOCK TABLE jobs_jobcount IN EXCLUSIVE MODE")


SQLITE_SETTLE_LEASE = f"""
UPDATE jobs_lease SET
    outcome = %(outcome)s, released_at = {SQLITE_NOW}, error_class = %(error_class)s,
    error_message = %(error_message)s, traceback = %(traceback)s, context = %(context)s
WHERE id = %(lease_id)s
RETURNING worker_id
"""


def is_postgres() -> bool:
    return connection.vendor == "postgresql"


def claim(
    worker_id: str, lanes: Sequence[str] | None, limits: Mapping[str, int] | None = None
) -> Claimed | None:
    """Take the best runnable job in ``lanes`` (all lanes when None) under a new lease."""
    return settle_and_claim(None, None, worker_id, lanes, limits)[1]


def settle_and_claim(
    job: Claimed | None,
    how: Settlement | None,
    worker_id: str | None,
    lanes: Sequence[str] | None,
    limits: Mapping[str, int] | None = None,
) -> tuple[bool, Claimed | None]:
    """Settle ``job`` (if given) and claim the next one (if ``worker_id``), in one commit.

    ``limits`` maps the served lanes that have a ``max_running`` to it. Claiming from them
    is serialized per lane (a transaction-scoped advisory lock on PostgreSQL; SQLite
    serializes every writer) so that the running count read before the claim stays true
    until the claim commits: the limit holds across all workers and hosts.

    Returns whether the settle matched (False: the lease was lost) and the claimed job.
    """
    settle = job is not None and how is not None
    claim = worker_id is not None
    if not (settle or claim):
        return False, None
    params: dict[str, Any] = {}
    if job is not None and how is not None:
        params.update(_settle_params(job, how))
    for _ in range(MAX_LOCK_RACES):
        try:
            return _settle_and_claim_limited(params, settle, worker_id, lanes, limits)
        except IntegrityError:
            # Another claimer took one of the candidate's resource locks first (I8). The
            # failed statement committed nothing, settle included: run it again; the
            # winner's lock is visible now, so that candidate is skipped.
            if not claim or connection.in_atomic_block:
                raise
    # Still losing (a storm of claimers on few resources): settle alone, claim next time.
    # The lost races are the next claim's, never a reason to fail the settled job.
    if settle:
        return _settle_and_claim_limited(params, settle, None, lanes, limits)
    return False, None


def _settle_and_claim_limited(
    params: dict[str, Any],
    settle: bool,
    worker_id: str | None,
    lanes: Sequence[str] | None,
    limits: Mapping[str, int] | None,
) -> tuple[bool, Claimed | None]:
    if not (worker_id is not None and limits):
        return _settle_and_claim(params, settle, worker_id, lanes, excluded=())
    with transaction.atomic():
        if is_postgres():
            with connection.cursor() as cursor:
                for lane in sorted(limits):
                    cursor.execute(PG_LOCK_LANE, [lane])
        return _settle_and_claim(params, settle, worker_id, lanes, excluded=_full(limits))


def heartbeat_settings() -> None:
    """PostgreSQL, inside the heartbeat's transaction: no fsync wait (a lost heartbeat only
    shortens a lease), and no long wait behind the handler's own fenced block, which holds
    the job row (that block renews the lease itself)."""
    if is_postgres():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit = off")
            cursor.execute("SET LOCAL lock_timeout = '500ms'")


def limit_lock_waits(seconds: float) -> None:
    """Bound how long this connection waits for a row or database lock from now on."""
    with connection.cursor() as cursor:
        if is_postgres():
            cursor.execute(f"SET lock_timeout = '{int(seconds * 1000)}ms'")
        else:
            cursor.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")


def _full(limits: Mapping[str, int]) -> list[str]:
    """The limited lanes whose running jobs have reached their ``max_running``."""
    running = (
        Job.objects.filter(state="running", lane__in=list(limits))
        .values_list("lane")
        .annotate(n=Count("id"))
        .order_by()
    )
    return sorted(lane for lane, n in running if n >= limits[lane])


def _settle_and_claim(
    params: dict[str, Any],
    settle: bool,
    worker_id: str | None,
    lanes: Sequence[str] | None,
    excluded: Sequence[str],
) -> tuple[bool, Claimed | None]:
    lane_filter = ""
    if worker_id is not None:
        params["worker"] = worker_id
        lane_filter = _lane_filter(lanes, excluded, params)
    run = _pg_settle_and_claim if is_postgres() else _sqlite_settle_and_claim
    return run(params, lane_filter, settle=settle, claim=worker_id is not None)


def _pg_settle_and_claim(
    params: dict[str, Any], lane_filter: str, *, settle: bool, claim: bool
) -> tuple[bool, Claimed | None]:
    if settle and claim:
        row = _pg_prepared(PG_SETTLE_AND_CLAIM.format(lane_filter=lane_filter), params)
        return row[0] == 1, (_claimed(row[1:]) if row[1] is not None else None)
    if settle:
        return _pg_prepared(PG_SETTLE, params)[0] == 1, None
    row = _pg_prepared(PG_CLAIM.format(lane_filter=lane_filter), params)
    return False, (_claimed(row) if row else None)


def _pg_prepared(query: str, params: dict[str, Any]) -> Any:
    """Run a hot-path statement as a prepared statement; return its one row (or None).

    Django's psycopg cursors bind parameters client-side and never prepare, so each claim
    and settle would be parsed and planned again: more server time than executing it.
    This runs the statement on a server-side-binding cursor of the same connection (so it
    joins Django's current transaction, if any), prepared once per connection. That is
    why every placeholder in these statements carries an explicit type.
    """
    connection.ensure_connection()
    raw = connection.connection
    if raw.prepare_threshold is None:
        raw.prepare_threshold = 2**31 - 1  # only prepare=True statements get prepared
    with connection.wrap_database_errors, psycopg.Cursor(raw) as cursor:
        cursor.execute(query, params, prepare=True)
        return cursor.fetchone()


def _sqlite_settle_and_claim(
    params: dict[str, Any], lane_filter: str, *, settle: bool, claim: bool
) -> tuple[bool, Claimed | None]:
    settled, claimed = False, None
    with transaction.atomic(), connection.cursor() as cursor:  # BEGIN IMMEDIATE
        if settle:
            cursor.execute(SQLITE_SETTLE_JOB, params)
            job_row = cursor.fetchone()
            settled = job_row is not None
            if settled:
                cursor.execute(SQLITE_SETTLE_LEASE, params)
                (worker,) = cursor.fetchone()
                cursor.execute(SQLITE_RELEASE_LOCKS, params)
                cursor.execute(SQLITE_COUNT_ATTEMPT, params)
                if params["state"] != "queued":  # into a finished state: count it
                    finished = {"lane": params["lane"], "state": params["state"], "delta": 1}
                    cursor.execute(COUNT_JOBS.format(shard="0"), finished)
                data = {"state": params["state"], "outcome": params["outcome"]}
                data["cancel_requested"] = bool(job_row[0])
                event = {"event": "settled", "worker": worker, "data": json.dumps(data)}
                cursor.execute(SQLITE_EVENT, {**params, **event})
        if claim:
            cursor.execute(SQLITE_CLAIM.format(lane_filter=lane_filter), params)
            row = cursor.fetchone()
            if row is not None:
                claimed = _sqlite_take(cursor, row, params["worker"])
    return settled, claimed


def _sqlite_take(cursor: Any, row: Sequence[Any], worker: str) -> Claimed:
    """The rest of a SQLite claim: the lease row, the locks and the event."""
    params = {
        "job_id": row[0],
        "attempt": row[4],
        "token": row[6],
        "worker": worker,
        "expires": row[8],
        "locks": row[9],
    }
    cursor.execute(SQLITE_INSERT_LEASE, params)
    (lease_id,) = cursor.fetchone()
    cursor.execute(SQLITE_TAKE_LOCKS, params)
    data = json.dumps({"attempt": row[4], "expires_at": _as_datetime(row[8]).isoformat()})
    cursor.execute(SQLITE_EVENT, {**params, "event": "claimed", "data": data})
    return _claimed((*row, lease_id))


def insert_jobs(
    common: dict[str, Any],
    args_json: list[str],
    locks: list[list[str]] | None,
    delay: float | None,
    run_at: datetime | None,
) -> list[tuple[int, datetime, datetime]]:
    """PostgreSQL: insert queued jobs sharing ``common`` options; rows in args order."""
    params = {
        "kind": common["kind"],
        "lane": common["lane"],
        "priority": common["priority"],
        "max_attempts": common["max_attempts"],
        "lease_seconds": common["lease_seconds"],
        "run_at": run_at,
        "delay": delay or 0.0,
        "args": f"[{','.join(args_json)}]",  # one JSON document, parsed once
        "locks": json.dumps(locks) if locks else None,
    }
    with connection.cursor() as cursor:
        cursor.execute(PG_INSERT_JOBS, params)
        return cursor.fetchall()


def _lane_filter(
    lanes: Sequence[str] | None, excluded: Sequence[str], params: dict[str, Any]
) -> str:
    """The claim's lane condition: only ``lanes`` (None: any), never ``excluded``."""
    clauses = []
    if is_postgres():
        if lanes is not None:
            params["lanes"] = list(lanes)
            clauses.append("AND lane = ANY(%(lanes)s::text[])")
        if excluded:
            params["excluded"] = list(excluded)
            clauses.append("AND lane <> ALL(%(excluded)s::text[])")
        return " ".join(clauses)
    for operator, prefix, names in (("IN", "lane", lanes), ("NOT IN", "excluded", excluded)):
        if names is None or (operator == "NOT IN" and not names):
            continue
        keys = [f"{prefix}{i}" for i in range(len(names))]
        params.update(zip(keys, names, strict=True))
        clauses.append(f"AND lane {operator} ({', '.join(f'%({key})s' for key in keys)})")
    return " ".join(clauses)


def _settle_params(job: Claimed, how: Settlement) -> dict[str, Any]:
    return {
        "job_id": job.id,
        "kind": job.kind,
        "lane": job.lane,
        "token": job.lease_token,
        "lease_id": job.lease_id,
        "state": how.state,
        "outcome": how.outcome,
        "uncharge": 1 if how.uncharge else 0,
        "result": None if how.result is None else json.dumps(how.result),
        "last_error": how.last_error,
        "error_class": how.error_class,
        "error_message": how.error_message,
        "traceback": how.traceback,
        "context": json.dumps(how.context or {}, default=str),
        "delay": how.delay,
        "delay_modifier": f"{how.delay:+.3f} seconds",
    }


def _claimed(row: Sequence[Any]) -> Claimed:
    args, locks = row[3], row[9]
    if isinstance(args, str | bytes):
        args = json.loads(args)
    if isinstance(locks, str | bytes):
        locks = json.loads(locks)
    return Claimed(
        id=row[0],
        kind=row[1],
        lane=row[2],
        args=args,
        attempt=row[4],
        max_attempts=row[5],
        lease_token=row[6],
        lease_seconds=row[7],
        lease_expires_at=_as_datetime(row[8]),
        locks=tuple(locks),
        cancel_requested=bool(row[10]),
        lease_id=row[11],
    )


def _as_datetime(value: datetime | str) -> datetime:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    parsed = parse_datetime(value)
    if parsed is None:
        raise ValueError(f"not a timestamp: {value!r}")
    return parsed.replace(tzinfo=UTC)
