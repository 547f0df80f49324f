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

The hot-path statements run as server-side prepared statements unless
``HOLDFAST_PREPARED_STATEMENTS`` is off (PgBouncer in transaction mode). A prepared
statement the server invalidated or lost (a migration changed the table, a pooler moved
the session) is re-prepared on a fresh connection and the statement run again: a deploy is
never an error of the job. ``fault()`` names the database errors that are about the
session or the server, not about the statement's data; the worker never records those as
a job's failure.

Everything else in the engine is ORM.
"""

from __future__ import annotations

import functools
import json
import re
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from django.conf import settings
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connection,
    connections,
    transaction,
)
from django.db.models import Count
from django.utils.dateparse import parse_datetime

from .log import get_logger
from .models import ATTEMPT_COUNT_SHARDS, DURATION_BUCKETS, Job
from .options import MAX_LEASE_SECONDS

log = get_logger("jobs.sql")


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


# SQLite returns the lease expiry as an expression, which has no declared type: its text
# comes back as it is and ``_as_datetime`` reads it with ``fromisoformat``, instead of
# Django's datetime converter running its regular expression on every claim.
SQLITE_CLAIMED_COLUMNS = CLAIMED_COLUMNS.replace(
    "lease_expires_at", "lease_expires_at || '' AS lease_expires_at"
)


# The claim, as CTEs. The walk reads only rows it could take, whatever waits:
#
# * lanes: the served lanes (the worker's list, or every lane with a runnable row: a loose
#   index scan of ``job_runnable_idx``), less the full ones. A lane at its
#   ``max_running`` (``full_lanes``) is never entered, so its backlog is never walked.
# * priorities: per served lane, a loose index scan (``pairs``) over its distinct
#   priorities, one index probe each. Within one (lane, priority) the index is in
#   ``run_at`` order, so the due rows are one index range that ends at the database
#   clock: delayed jobs are never walked, whatever their priority.
# * blocked jobs: a queued job whose resource lock is held is taken out of the runnable
#   index (``blocked_by``, see ``PG_MARK_BLOCKED``) after the claim that first walks past
#   it, and put back (``PG_PROMOTE``) when that lock is released. The statement returns
#   the (lane, priority) ranges whose first due row was not their first runnable one
#   (``passed``: one more index probe per range), so that only then the marking runs.
# * order: each (lane, priority)'s first runnable row (``heads``, read, not locked), best
#   first by (priority DESC, run_at, id); the first of them no other claimer is locking is
#   taken (``FOR UPDATE SKIP LOCKED``: concurrent claimers never wait on each other or take
#   the same row). Claim order holds across lanes and priorities.
# * lane limits: a running job of a limited lane holds one of the lane's ``max_running``
#   slots, a lock row (``holdfast:lane:<lane>:<n>``) in ``jobs_joblock`` written with the
#   job's resource locks and released with them (settle, reclaim). No lane lock: a claim
#   of an unlimited lane never waits on a limited one.
#
# Then: make the row ours under the next lease token, write the attempt's lease row (which
# is also its "claimed" event: see jobs.events), take its locks (and lane slot) in
# canonical order. Two claimers racing for one
# free resource (or a lane's last slot) both insert its lock row: the primary key makes
# the second one's whole statement fail (nothing of it commits), and it claims again (I8).
LANE_SLOT = "'holdfast:lane:' || {lane} || ':' || {n}"
LANE_SLOT_PREFIX = "holdfast:"  # reserved: a job's own lock names may not start with it
MARK_BATCH = 5000  # blocked rows one marking statement marks at most

# A lease as the claim and heartbeats apply it: at most a day. Enqueue never stores more
# (jobs.options), but a row written around it (SQL by hand, a restore) must not make every
# claim fail, nor commit an expiry no reclaim reaches. PostgreSQL's LEAST ranks NaN above
# every number, so NaN is a day too; SQLite keeps no NaN.
PG_LEASE = f"LEAST(lease_seconds, {MAX_LEASE_SECONDS}) * interval '1 second'"
SQLITE_LEASE = f"printf('%%+.3f seconds', min(lease_seconds, {MAX_LEASE_SECONDS}))"

# The runnable index's condition, and a row the claim may take: due, of a served kind,
# its resource locks all free.
_QUEUED = "state = 'queued' AND blocked_by IS NULL"
_FREE = """(locks = '[]'::jsonb OR NOT EXISTS (
            SELECT 1 FROM jobs_joblock AS held
            WHERE held.resource IN (SELECT jsonb_array_elements_text(jobs_job.locks))))"""
# The runnable index's order: a probe in it is served by that index alone (another one,
# such as job_state_idx, would need a sort; without this, small statistics pick it and
# walk the blocked rows that the runnable index leaves out).
_RUNNABLE_ORDER = "lane, priority DESC, run_at, id"
_DUE = f"{_QUEUED} AND run_at <= statement_timestamp() {{kind_filter}}"

# The limited lanes whose running jobs have reached their ``max_running`` (%(limited)s and
# %(limits)s: parallel arrays): a read of the running rows of those lanes only. The slots
# enforce the limit against racing claimers; this count keeps a full lane out of the walk
# (and counts jobs that run without a slot: claimed before the slots existed).
PG_FULL_LANES = """full_lanes AS (
    SELECT l.lane FROM unnest(%(limited)s::text[], %(limits)s::int[]) AS l(lane, k)
    WHERE (SELECT count(*) FROM jobs_job
           WHERE state = 'running' AND lane = l.lane) >= l.k
)"""
PG_NO_FULL_LANES = "full_lanes AS (SELECT ''::text AS lane WHERE false)"

# Every lane: one loose index scan over the (lane, priority) pairs of the runnable index.
# From each pair the next is the same lane's next lower priority or, when it has none,
# the next lane's highest (``UNION ALL … LIMIT 1`` probes the second only when the first
# finds nothing). Full lanes are walked too (a probe per priority) and left out after.
PG_PAIRS_ANY = f"""queued_pairs(lane, p) AS (
    (SELECT lane, priority FROM jobs_job WHERE {_QUEUED} ORDER BY {_RUNNABLE_ORDER} LIMIT 1)
    UNION ALL
    SELECT following.lane, following.p FROM queued_pairs CROSS JOIN LATERAL (
        (SELECT lane, priority AS p FROM jobs_job
         WHERE {_QUEUED} AND lane = queued_pairs.lane AND priority < queued_pairs.p
         ORDER BY priority DESC LIMIT 1)
        UNION ALL
        (SELECT lane, priority FROM jobs_job
         WHERE {_QUEUED} AND lane > queued_pairs.lane ORDER BY {_RUNNABLE_ORDER} LIMIT 1)
        LIMIT 1) AS following
), pairs(lane, p) AS (
    SELECT lane, p FROM queued_pairs WHERE lane NOT IN (SELECT lane FROM full_lanes)
)"""

# A lane list: each served lane's priorities, highest first, one probe each.
PG_PAIRS_LISTED = f"""served AS (
    SELECT lane FROM unnest(%(lanes)s::text[]) AS s(lane)
    WHERE lane NOT IN (SELECT lane FROM full_lanes)
), pairs(lane, p) AS (
    SELECT served.lane, (SELECT priority FROM jobs_job
                         WHERE {_QUEUED} AND lane = served.lane
                         ORDER BY priority DESC LIMIT 1)
    FROM served
    UNION ALL
    SELECT pairs.lane, (SELECT priority FROM jobs_job
                        WHERE {_QUEUED} AND lane = pairs.lane AND priority < pairs.p
                        ORDER BY priority DESC LIMIT 1)
    FROM pairs WHERE pairs.p IS NOT NULL
)"""

PG_WALK = f"""heads AS (
    -- Each pair's head: its first due row whose locks are all free. The first due row is
    -- read once; only when it has locks is the range probed again for a free one (the
    -- gate on first_due.free is a one-time filter: no probe at all otherwise).
    SELECT pairs.lane, pairs.p,
           CASE WHEN first_due.free THEN first_due.run_at ELSE past.run_at END AS run_at,
           CASE WHEN first_due.free THEN first_due.id ELSE past.id END AS id,
           first_due.id AS first_id
    FROM pairs LEFT JOIN LATERAL (
        SELECT run_at, id, locks = '[]'::jsonb AS free FROM jobs_job
        WHERE lane = pairs.lane AND priority = pairs.p AND {_DUE}
        ORDER BY run_at, id
        LIMIT 1) AS first_due ON true
    LEFT JOIN LATERAL (
        SELECT run_at, id FROM jobs_job
        WHERE NOT first_due.free
          AND lane = pairs.lane AND priority = pairs.p AND {_DUE} AND {_FREE}
        ORDER BY run_at, id
        LIMIT 1) AS past ON true
    WHERE pairs.p IS NOT NULL
), candidate AS (
    SELECT pick.id, pick.lane
    FROM (SELECT lane, p, run_at, id FROM heads WHERE id IS NOT NULL
          ORDER BY p DESC, run_at, id) AS ranked
    CROSS JOIN LATERAL (
        SELECT id, lane FROM jobs_job
        WHERE lane = ranked.lane AND priority = ranked.p AND {_DUE} AND {_FREE}
        ORDER BY run_at, id
        LIMIT 1
        FOR UPDATE SKIP LOCKED) AS pick
    LIMIT 1
)"""

# The candidate's lane slot, when its lane is limited: the lowest one free.
PG_SLOT = f"""slot AS (
    SELECT {LANE_SLOT.format(lane="l.lane", n="n")} AS resource
    FROM candidate
    JOIN unnest(%(limited)s::text[], %(limits)s::int[]) AS l(lane, k) ON l.lane = candidate.lane
    CROSS JOIN LATERAL generate_series(0, l.k - 1) AS n
    WHERE NOT EXISTS (SELECT 1 FROM jobs_joblock
                      WHERE resource = {LANE_SLOT.format(lane="l.lane", n="n")})
    ORDER BY n
    LIMIT 1
)"""
# A job of a limited lane is claimed only with a slot.
PG_SLOT_GUARD = "AND (job.lane <> ALL(%(limited)s::text[]) OR EXISTS (SELECT 1 FROM slot))"

PG_TAKE = f"""claimed AS (
    UPDATE jobs_job AS job SET
        state = 'running',
        attempts = job.attempts + 1,
        lease_token = job.lease_token + 1,
        leased_by = %(worker)s::text,
        lease_expires_at = statement_timestamp() + {PG_LEASE},
        heartbeat_at = statement_timestamp(),
        -- The attempt's start: the clock while the statement runs, after its snapshot, so
        -- no attempt seems to begin before the settle whose freed slot or lock it took had
        -- committed. statement_timestamp() is when the statement arrived; planning the
        -- claim (the first runs of a prepared statement, or every run with them off) can
        -- take milliseconds. The expiry stays measured from statement_timestamp(): a
        -- little early, never late. The attempt's lease row is written when it ends.
        started_at = clock_timestamp(),
        updated_at = statement_timestamp()
    -- By the candidate's id (no partial index's condition is implied by the guard alone:
    -- migration 0011_i16, so a table without statistics still goes by primary key).
    WHERE job.id = (SELECT id FROM candidate) AND job.state = 'queued' {{slot_guard}}
    RETURNING {_columns("job")}
), taken_locks AS (
    INSERT INTO jobs_joblock (resource, job_id, lease_token, acquired_at)
    SELECT lock.resource, claimed.id, claimed.lease_token, statement_timestamp()
    FROM claimed CROSS JOIN LATERAL ({{lock_names}}) AS lock(resource)
    ORDER BY lock.resource COLLATE "C"
)"""

_JOB_LOCKS = "SELECT jsonb_array_elements_text(claimed.locks)"


@functools.lru_cache(maxsize=64)
def pg_claim_ctes(lane_list: bool, limited: bool, kinds: bool) -> str:
    """The claim's CTEs for one shape of worker: from a lane list or every lane, with
    lane limits or none, of some kinds or any."""
    kind_filter = "AND kind = ANY(%(kinds)s::text[])" if kinds else ""
    parts = [
        PG_FULL_LANES if limited else PG_NO_FULL_LANES,
        PG_PAIRS_LISTED if lane_list else PG_PAIRS_ANY,
        PG_WALK,
    ]
    if limited:
        parts.append(PG_SLOT)
        take = PG_TAKE.format(
            slot_guard=PG_SLOT_GUARD,
            lock_names=f"{_JOB_LOCKS} UNION ALL SELECT resource FROM slot",
        )
    else:
        take = PG_TAKE.format(slot_guard="", lock_names=_JOB_LOCKS)
    parts.append(take)
    return ",\n".join(parts).replace("{kind_filter}", kind_filter)


# A claim's walked-past blocked rows leave the runnable index, each marked with one of its
# resource locks that is held, in a statement of its own. Never a lost wake-up: a row is
# marked only with a lock row this statement holds FOR KEY SHARE, so the release that
# deletes that lock row waits for this mark to commit, and the promotion that follows the
# release (a later statement, a later snapshot) sees it. A lock row being deleted is
# skipped (SKIP LOCKED): the row is not marked, and the next claim reads it again. No wait
# of any kind (SKIP LOCKED on job and lock rows), so no deadlock with claims or settles.
# The marking and promotion statements are planned anew each time, over estimates that
# can reach the JIT threshold: compiling costs far more than they run.
NO_JIT = "SET LOCAL jit TO off;\n"

PG_MARK_BLOCKED = f"""
WITH passed AS (
    SELECT r->>0 AS lane, (r->>1)::smallint AS p, (r->>2)::timestamptz AS run_at,
           (r->>3)::bigint AS id
    FROM jsonb_array_elements(%(passed)s::jsonb) AS r
), target AS MATERIALIZED (
    SELECT walked.id, walked.locks FROM passed CROSS JOIN LATERAL (
        SELECT id, locks FROM jobs_job
        WHERE lane = passed.lane AND priority = passed.p AND {_QUEUED}
          AND run_at <= statement_timestamp() {{kind_filter}} AND jsonb_array_length(locks) > 0
          AND (passed.id IS NULL OR (run_at, id) < (passed.run_at, passed.id))
        ORDER BY run_at, id
        LIMIT {MARK_BATCH}
        FOR UPDATE SKIP LOCKED) AS walked
), held AS MATERIALIZED (
    SELECT resource FROM jobs_joblock
    WHERE resource IN (SELECT jsonb_array_elements_text(locks) FROM target)
    FOR KEY SHARE SKIP LOCKED
), marks AS (
    SELECT target.id, min(held.resource) AS resource
    FROM target CROSS JOIN LATERAL jsonb_array_elements_text(target.locks) AS lock(resource)
    JOIN held ON held.resource = lock.resource
    GROUP BY target.id
)
UPDATE jobs_job AS job SET blocked_by = marks.resource
FROM marks WHERE job.id = marks.id AND job.state = 'queued'
RETURNING job.id
"""

# Promotion: for each of %(resources)s whose lock row is gone, its best blocked job goes
# back into the runnable index. One per resource: only one of them can take the lock, and
# the others stay out of every claim's path (a resource's backlog is walked never, not
# once per job). Run after each release, in a later statement than the delete (see
# PG_MARK_BLOCKED); ``sweep_blocked`` runs it over every blocked resource on each reclaim
# pass: the promotion a crashed releaser never ran, and one more job per pass of a
# resource whose promoted job is not being claimed (a full lane, a kind no live worker
# runs, or another of its locks held: that claim marks it again).
_PROMOTE = """promoted AS MATERIALIZED (
    SELECT best.id FROM {resources}
    CROSS JOIN LATERAL (
        SELECT id FROM jobs_job
        WHERE state = 'queued' AND blocked_by = r.resource
        ORDER BY priority DESC, run_at, id
        LIMIT 1
        FOR UPDATE SKIP LOCKED) AS best
    WHERE r.resource IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM jobs_joblock WHERE resource = r.resource)
)
UPDATE jobs_job AS job SET blocked_by = NULL
FROM promoted
WHERE job.id = promoted.id AND job.state = 'queued'
RETURNING job.id
"""
PG_PROMOTE = "WITH " + _PROMOTE.format(resources="unnest(%(resources)s::text[]) AS r(resource)")

# Every resource some queued job is blocked on: a loose index scan of job_blocked_idx.
PG_SWEEP = """
WITH RECURSIVE waits(resource) AS (
    (SELECT blocked_by FROM jobs_job
     WHERE state = 'queued' AND blocked_by IS NOT NULL ORDER BY blocked_by LIMIT 1)
    UNION ALL
    SELECT (SELECT blocked_by FROM jobs_job
            WHERE state = 'queued' AND blocked_by IS NOT NULL AND blocked_by > waits.resource
            ORDER BY blocked_by LIMIT 1)
    FROM waits WHERE waits.resource IS NOT NULL
), """ + _PROMOTE.format(resources="waits AS r")


def _bucket(seconds: str) -> str:
    """SQL: the index in ``DURATION_BUCKETS`` of the bucket holding ``seconds``."""
    cases = " ".join(f"WHEN {seconds} <= {b} THEN {i}" for i, b in enumerate(DURATION_BUCKETS))
    return f"CASE {cases} ELSE {len(DURATION_BUCKETS)} END"


SHARDS = ATTEMPT_COUNT_SHARDS

# An attempt's lease row is written once, complete, by the statement that ends it (a
# settle, a release, a reclaim); while it runs, the job row alone records it (state,
# lease token, attempts, leased_by, started_at, lease_expires_at: jobs.attempts reads it
# from there). A row already there was written at claim by a worker of an earlier release
# (0.1 inserted it then): it is completed instead, as that release's own settle
# or reclaim would have.
WRITE_LEASE = """INSERT INTO jobs_lease (job_id, attempt, lease_token, worker_id, acquired_at,
                            expires_at, released_at, outcome, error_class, error_message,
                            traceback, context, settled_state, cancel_requested)"""
LEASE_CONFLICT = """ON CONFLICT (job_id, lease_token) DO UPDATE SET
        outcome = EXCLUDED.outcome, released_at = EXCLUDED.released_at,
        error_class = EXCLUDED.error_class, error_message = EXCLUDED.error_message,
        traceback = EXCLUDED.traceback, context = EXCLUDED.context,
        settled_state = EXCLUDED.settled_state, cancel_requested = EXCLUDED.cancel_requested"""
# The settle, as CTEs: fenced by state and lease token; the attempt's lease row (written
# once, now that the attempt ends: it is also its "claimed" and "settled" events, see
# jobs.events), the lock release and the attempt's count (jobs_outcomecount: the metrics
# and the finished jobs' counts) are written only if the job row was. ``held`` reads the
# worker and expiry the update clears, for the lease row.
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
    FROM (SELECT leased_by, lease_expires_at FROM jobs_job
          WHERE id = %(job_id)s::bigint) AS held(worker, expires)
    WHERE jobs_job.id = %(job_id)s::bigint AND jobs_job.state = 'running'
      AND jobs_job.lease_token = %(token)s::bigint
    RETURNING jobs_job.id, jobs_job.cancel_requested, jobs_job.started_at, held.worker,
              held.expires
), settled_lease AS (
    {WRITE_LEASE}
    SELECT id, %(attempt)s::integer, %(token)s::bigint, COALESCE(worker, ''),
           COALESCE(started_at, statement_timestamp()), COALESCE(expires, statement_timestamp()),
           statement_timestamp(), %(outcome)s::text, %(error_class)s::text,
           %(error_message)s::text, %(traceback)s::text, %(context)s::jsonb, %(state)s::text,
           cancel_requested
    FROM settled
    {LEASE_CONFLICT}
    RETURNING greatest(0, extract(epoch FROM statement_timestamp() - acquired_at))::float8 AS s
), released_locks AS (
    DELETE FROM jobs_joblock
    WHERE job_id = %(job_id)s::bigint AND lease_token = %(token)s::bigint
      AND EXISTS (SELECT 1 FROM settled)
), counted AS (
    INSERT INTO jobs_outcomecount (kind, lane, outcome, state, bucket, shard, count, seconds)
    SELECT %(kind)s::text, %(lane)s::text, %(outcome)s::text, %(state)s::text,
           {_bucket("took.s")}, mod(pg_backend_pid(), {SHARDS}), 1, took.s
    FROM settled_lease AS took  -- the attempt's duration, from the lease row it just wrote
    ON CONFLICT (kind, lane, outcome, state, bucket, shard) DO UPDATE SET
        count = jobs_outcomecount.count + 1,
        seconds = jobs_outcomecount.seconds + EXCLUDED.seconds
)"""

PG_SETTLE = f"""
WITH {PG_SETTLE_CTES}
SELECT (SELECT count(*) FROM settled)
"""

# The ranges a claim walked past blocked rows in: [[lane, priority, head run_at, head id]]
# (head: that range's first runnable row, null when it has none), or NULL.
PASSED = """(SELECT jsonb_agg(jsonb_build_array(lane, p, run_at, id)) FROM heads
        WHERE first_id IS DISTINCT FROM id)"""

PG_CLAIM_SELECT = f"""
SELECT {_columns("claimed")}, {PASSED}
FROM (SELECT 1) AS one LEFT JOIN claimed ON true
"""

# Settle one job and claim the next in one statement: one round trip and one commit per
# job. The claim reads the snapshot from before the settle, so it never takes back the job
# it just settled (that row is still 'running' there), nor its lane slot.
PG_SETTLE_AND_CLAIM_SELECT = f"""
SELECT (SELECT count(*) FROM settled), {_columns("claimed")}, {PASSED}
FROM (SELECT 1) AS one LEFT JOIN claimed ON true
"""


def pg_claim(lane_list: bool, limited: bool, kinds: bool, settle: bool = False) -> str:
    """The claim statement (with ``settle``: the fused settle-and-claim) of one shape."""
    ctes = pg_claim_ctes(lane_list, limited, kinds)
    if settle:
        return f"WITH RECURSIVE {PG_SETTLE_CTES},\n{ctes}{PG_SETTLE_AND_CLAIM_SELECT}"
    return f"WITH RECURSIVE {ctes}{PG_CLAIM_SELECT}"


BULK_INSERT_CHUNK = 10_000
MAX_LOCK_RACES = 50  # each lost race means another claimer's lock committed: progress

# Enqueue: the options are the same for every job, only the args differ, so one JSON array
# parameter carries them (parsed once). The ids come back as one sorted array: identity
# values are drawn in ORDINALITY order, so ascending ids are the caller's order. Every row
# has the same run_at and created_at (one statement timestamp): returned once, not per row.
# The wake-up (``pg_notify`` on each of ``channels``) is part of the statement, so one job
# is one round trip and, outside a transaction, one commit; NOTIFY is still delivered only
# if the insert commits.
PG_INSERT_JOBS = """
WITH new AS (
    INSERT INTO jobs_job (kind, lane, args, locks, priority, state, run_at, attempts,
                          max_attempts, lease_seconds, lease_token, cancel_requested,
                          last_error, created_at, updated_at)
    SELECT %(kind)s::text, %(lane)s::text, a.args,
           COALESCE(%(locks)s::jsonb -> (a.n::int - 1), '[]'::jsonb),
           %(priority)s::smallint, 'queued',
           COALESCE(%(run_at)s::timestamptz,
                    statement_timestamp() + %(delay)s::float8 * interval '1 second'),
           0, %(max_attempts)s::integer, %(lease_seconds)s::float8, 0, false, '',
           statement_timestamp(), statement_timestamp()
    FROM jsonb_array_elements(%(args)s::jsonb) WITH ORDINALITY AS a(args, n)
    ORDER BY a.n
    RETURNING id
)
SELECT (SELECT array_agg(id ORDER BY id) FROM new),
       COALESCE(%(run_at)s::timestamptz,
                statement_timestamp() + %(delay)s::float8 * interval '1 second'),
       statement_timestamp(),
       (SELECT count(pg_notify(channel, %(payload)s::text))
        FROM unnest(%(channels)s::text[]) AS channel)
"""

# Enqueue of a large batch (``COPY_THRESHOLD`` jobs or more): the server's cost is the
# insert itself, and COPY inserts rows in batches (one WAL record per heap page, not per
# row). COPY returns nothing, so one statement first draws the ids (``nextval`` of the
# identity column's sequence, ascending: the caller's order), reads the database clock
# exactly as ``PG_INSERT_JOBS`` does, and sends the wake-up, which the transaction delivers
# only if the rows commit. With the ids known, the caller builds its jobs while the server
# copies the rows it already sent.
COPY_THRESHOLD = 10_000  # below it the one-statement insert is faster (measured)
COPY_CHUNK = 5000  # rows per write: the server copies one while the next is built
PG_DRAW_JOB_IDS = """
SELECT (SELECT array_agg(id ORDER BY id)
        FROM (SELECT nextval({sequence}::regclass) AS id
              FROM generate_series(1, %(count)s::integer)) AS drawn),
       COALESCE(%(run_at)s::timestamptz,
                statement_timestamp() + %(delay)s::float8 * interval '1 second'),
       statement_timestamp(),
       (SELECT count(pg_notify(channel, %(payload)s::text))
        FROM unnest(%(channels)s::text[]) AS channel)
"""
PG_COPY_JOBS = (
    "COPY jobs_job (id, args, locks, kind, lane, priority, state, run_at, attempts, "
    "max_attempts, lease_seconds, lease_token, cancel_requested, last_error, created_at, "
    "updated_at) FROM STDIN (FORMAT BINARY)"
)

# SQLite: one executemany in the caller's (IMMEDIATE) transaction; the timestamps are read
# once from the database clock before it, the ids after it (the write lock is held, and
# AUTOINCREMENT ids only grow: the new rows are those above the highest id before).
SQLITE_INSERT_JOB = """
INSERT INTO jobs_job (kind, lane, args, locks, priority, state, run_at, attempts, max_attempts,
                      lease_seconds, lease_token, cancel_requested, last_error,
                      created_at, updated_at)
VALUES (%s, %s, %s, %s, %s, 'queued', %s, 0, %s, %s, 0, 0, '', %s, %s)
"""
SQLITE_INSERT_CLOCK = (
    "SELECT strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now'),"
    " strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s),"
    " (SELECT COALESCE(MAX(id), 0) FROM jobs_job)"
)

# SQLite: the same statements split in two, inside one BEGIN IMMEDIATE transaction.
SQLITE_NOW = "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"

# The claim walks the runnable index lane by lane, as on PostgreSQL (without the priority
# and blocked-job steps: an embedded queue's waiting rows are few). The lanes are the
# worker's list, or every lane with a runnable row (a loose index scan). Each lane's best
# runnable row is one probe in (lane, priority DESC, run_at, id) order, and the best of
# those is taken. ``INDEXED BY``: SQLite's planner, without statistics, would otherwise
# take the (state, lane, kind) index and sort every queued row on each claim.
SQLITE_LANES_LISTED = "lanes(lane) AS (SELECT value FROM json_each(%(lanes_json)s))"
SQLITE_LANES_QUEUED = """lanes(lane) AS (
    SELECT (SELECT lane FROM jobs_job INDEXED BY job_runnable_idx
            WHERE state = 'queued' AND blocked_by IS NULL ORDER BY lane LIMIT 1)
    UNION ALL
    SELECT (SELECT lane FROM jobs_job INDEXED BY job_runnable_idx
            WHERE state = 'queued' AND blocked_by IS NULL AND lane > lanes.lane
            ORDER BY lane LIMIT 1)
    FROM lanes WHERE lanes.lane IS NOT NULL
)"""

SQLITE_CLAIM = f"""
WITH RECURSIVE {{lanes}}, heads(id) AS (
    SELECT (SELECT id FROM jobs_job INDEXED BY job_runnable_idx
            WHERE lane = lanes.lane AND state = 'queued' AND blocked_by IS NULL
              AND run_at <= {SQLITE_NOW} {{lane_filter}}
              AND (locks = '[]' OR NOT EXISTS (
                    SELECT 1 FROM jobs_joblock AS held
                    WHERE held.resource IN (SELECT value FROM json_each(jobs_job.locks))))
            ORDER BY priority DESC, run_at, id
            LIMIT 1)
    FROM lanes WHERE lanes.lane IS NOT NULL
)
UPDATE jobs_job SET
    state = 'running',
    attempts = attempts + 1,
    lease_token = lease_token + 1,
    leased_by = %(worker)s,
    lease_expires_at = strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', {SQLITE_LEASE}),
    heartbeat_at = {SQLITE_NOW},
    started_at = {SQLITE_NOW},
    updated_at = {SQLITE_NOW}
WHERE id = (
    SELECT head.id FROM heads JOIN jobs_job AS head ON head.id = heads.id
    ORDER BY head.priority DESC, head.run_at, head.id
    LIMIT 1
)
RETURNING {SQLITE_CLAIMED_COLUMNS}
"""

# An idle worker's "when is my next job due?": the earliest run_at still ahead among
# runnable rows (a blocked row runs when its lock frees, not at a time), in seconds from
# now. The runnable index answers it pair by pair, as the claim walks it: each (lane,
# priority) range's first row after now is one probe, so the look-up grows with the lanes
# and priorities in use, not with the delayed jobs, and needs no index of its own on
# run_at for every enqueue and claim to write (migration 0015_i16_next_due_by_runnable).
PG_NEXT_DUE = f"""
WITH RECURSIVE {PG_NO_FULL_LANES}, {{pairs}}
SELECT extract(epoch FROM min(due.run_at) - statement_timestamp())::float8
FROM pairs CROSS JOIN LATERAL (
    SELECT run_at FROM jobs_job
    WHERE lane = pairs.lane AND priority = pairs.p AND {_QUEUED}
      AND run_at > statement_timestamp()
    ORDER BY run_at
    LIMIT 1) AS due
WHERE pairs.p IS NOT NULL
"""

SQLITE_NEXT_DUE = f"""
WITH RECURSIVE {{lanes}}, pairs(lane, p) AS (
    SELECT lanes.lane, (SELECT priority FROM jobs_job INDEXED BY job_runnable_idx
                        WHERE lane = lanes.lane AND state = 'queued' AND blocked_by IS NULL
                        ORDER BY priority DESC LIMIT 1)
    FROM lanes WHERE lanes.lane IS NOT NULL
    UNION ALL
    SELECT pairs.lane, (SELECT priority FROM jobs_job INDEXED BY job_runnable_idx
                        WHERE lane = pairs.lane AND state = 'queued' AND blocked_by IS NULL
                          AND priority < pairs.p
                        ORDER BY priority DESC LIMIT 1)
    FROM pairs WHERE pairs.p IS NOT NULL
)
SELECT (julianday(min((SELECT run_at FROM jobs_job INDEXED BY job_runnable_idx
                       WHERE lane = pairs.lane AND priority = pairs.p AND state = 'queued'
                         AND blocked_by IS NULL AND run_at > {SQLITE_NOW}
                       ORDER BY run_at LIMIT 1))) - julianday('now')) * 86400.0
FROM pairs WHERE pairs.p IS NOT NULL
"""


def next_due_in(lanes: Sequence[str] | None, horizon: float) -> float | None:
    """Seconds until the next runnable job of ``lanes`` (None: any) falls due, if one does
    within ``horizon`` seconds (``PG_NEXT_DUE``)."""
    params: dict[str, Any] = {}
    if is_postgres():
        query = PG_NEXT_DUE.format(pairs=PG_PAIRS_ANY if lanes is None else PG_PAIRS_LISTED)
        if lanes is not None:
            params["lanes"] = _pg_array(tuple(lanes))
    else:
        query = SQLITE_NEXT_DUE.format(
            lanes=SQLITE_LANES_QUEUED if lanes is None else SQLITE_LANES_LISTED
        )
        if lanes is not None:
            params["lanes_json"] = _lanes_json(tuple(lanes))
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        row = cursor.fetchone()
    seconds = None if row is None else row[0]
    if seconds is None or seconds > horizon:
        return None
    return max(0.0, float(seconds))


SQLITE_TAKE_LOCKS = f"""
INSERT INTO jobs_joblock (resource, job_id, lease_token, acquired_at)
SELECT value, %(job_id)s, %(token)s, {SQLITE_NOW} FROM json_each(%(locks)s) ORDER BY key
"""

SQLITE_RELEASE_LOCKS = """
DELETE FROM jobs_joblock WHERE job_id = %(job_id)s AND lease_token = %(token)s
"""

# The SQLite settle writes the attempt's lease row first, from the job row it still reads
# as running (the same fence), then the job row, in one BEGIN IMMEDIATE transaction.
SQLITE_SETTLE_LEASE = f"""
{WRITE_LEASE}
SELECT id, %(attempt)s, lease_token, COALESCE(leased_by, ''), COALESCE(started_at, {SQLITE_NOW}),
       COALESCE(lease_expires_at, {SQLITE_NOW}), {SQLITE_NOW}, %(outcome)s, %(error_class)s,
       %(error_message)s, %(traceback)s, %(context)s, %(state)s, cancel_requested
FROM jobs_job
WHERE id = %(job_id)s AND state = 'running' AND lease_token = %(token)s
{LEASE_CONFLICT}
RETURNING max(0.0, (julianday('now') - julianday(acquired_at)) * 86400.0)
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
"""

# The attempt's count (metrics, finished jobs): one upsert per settled attempt, in its
# settle's transaction.
SQLITE_COUNT_ATTEMPT = f"""
INSERT INTO jobs_outcomecount (kind, lane, outcome, state, bucket, shard, count, seconds)
SELECT %(kind)s, %(lane)s, %(outcome)s, %(state)s, {_bucket("took.s")}, 0, 1, took.s
FROM (SELECT %(took)s AS s) AS took
WHERE true
ON CONFLICT (kind, lane, outcome, state, bucket, shard) DO UPDATE SET
    count = count + 1, seconds = seconds + excluded.seconds
"""


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
            cursor.execute("LOCK TABLE jobs_jobcount, jobs_outcomecount IN EXCLUSIVE MODE")


@functools.cache
def is_postgres() -> bool:
    """Is the engine's database PostgreSQL? Read once: the default database's settings are
    the process's, and ``connection.vendor`` is a thread-local look-up on every call."""
    return connections[DEFAULT_DB_ALIAS].vendor == "postgresql"


def claim(
    worker_id: str,
    lanes: Sequence[str] | None,
    limits: Mapping[str, int] | None = None,
    kinds: Sequence[str] | None = None,
) -> Claimed | None:
    """Take the best runnable job in ``lanes`` (all lanes when None) of one of ``kinds``
    (any kind when None) under a new lease."""
    return settle_and_claim(None, None, worker_id, lanes, limits, kinds)[1]


def settle_and_claim(
    job: Claimed | None,
    how: Settlement | None,
    worker_id: str | None,
    lanes: Sequence[str] | None,
    limits: Mapping[str, int] | None = None,
    kinds: Sequence[str] | None = None,
) -> tuple[bool, Claimed | None]:
    """Settle ``job`` (if given) and claim the next one (if ``worker_id``), in one commit.

    The claim takes only jobs of ``kinds`` (the kinds this worker has handlers for; None:
    any), so a job of a kind no running worker knows stays queued and uncharged.

    ``limits`` maps the served lanes that have a ``max_running`` to it. On PostgreSQL a
    claim from a limited lane takes one of the lane's slots (``PG_SLOT``) in the claim
    statement itself, so racing claimers cannot exceed it and claims of other lanes never
    wait; SQLite serializes every writer, so the running count read before the claim stays
    true until it commits. Either way the limit holds across all workers and hosts.

    The claim is never a reason to lose the settle: when the fused statement fails for
    anything but the connection (a refused claim, a trigger, a lost lock race), the settle
    is written alone and the error is the next claim's.

    A settle that released resource locks then promotes the best blocked job of each
    (``promote_blocked``), in a statement of its own: it must read a snapshot later than
    the release. If it does not run (a crash, an outage), the next reclaim pass's sweep
    does it.

    Returns whether the settle matched (False: the lease was lost) and the claimed job.
    """
    settled, claimed = _settle_and_claim_racing(job, how, worker_id, lanes, limits, kinds)
    if settled and job is not None and job.locks and is_postgres():
        try:
            promote_blocked(job.locks)
        except DatabaseError as exc:
            if fault(exc) is not None and claimed is None:
                raise  # nothing claimed to lose: the caller retries; the sweep promotes
            log.warning("promote_failed", job_id=job.id, error=" ".join(str(exc).split()))
    return settled, claimed


def _settle_and_claim_racing(
    job: Claimed | None,
    how: Settlement | None,
    worker_id: str | None,
    lanes: Sequence[str] | None,
    limits: Mapping[str, int] | None = None,
    kinds: Sequence[str] | None = None,
) -> tuple[bool, Claimed | None]:
    """``settle_and_claim`` without the promotion."""
    settle = job is not None and how is not None
    claim = worker_id is not None
    if not (settle or claim):
        return False, None
    params: dict[str, Any] = {}
    if job is not None and how is not None:
        params.update(_settle_params(job, how))
    try:
        for _ in range(MAX_LOCK_RACES):
            try:
                return _replanning(
                    lambda: _settle_and_claim_limited(
                        params, settle, worker_id, lanes, limits, kinds
                    )
                )
            except IntegrityError:
                # Another claimer took one of the candidate's resource locks first (I8).
                # The failed statement committed nothing, settle included: run it again;
                # the winner's lock is visible now, so that candidate is skipped.
                if not claim or connection.in_atomic_block:
                    raise
        # Still losing (a storm of claimers on few resources): settle alone, claim next
        # time. The lost races are the next claim's, never a reason to fail the settled job.
        if not settle:
            return False, None
    except DatabaseError as exc:
        if not (settle and claim) or connection.in_atomic_block or fault(exc) is not None:
            raise  # an outage or lost session: the caller retries the whole statement
        log.error("claim_failed", job_id=params["job_id"], error=" ".join(str(exc).split()))
    return _replanning(
        lambda: _settle_and_claim_limited(params, settle, None, lanes, limits, kinds)
    )


def _replanning[T](run: Callable[[], T]) -> T:
    """Run a hot-path step; if the server invalidated or lost its prepared statement
    (a migration altered the table, a pooler changed sessions), run it again on a fresh
    connection, whose statements are prepared anew.

    Only outside the caller's transaction: there the failed statement changed nothing (it
    ran alone), while inside one the whole transaction is lost and the caller decides. If
    even a fresh connection's statement is lost (a pooler that does not keep prepared
    statements), this process stops preparing and says so.
    """
    global _prepare_refused
    for retry in range(3):
        try:
            return run()
        except DatabaseError as exc:
            if retry == 2 or connection.in_atomic_block or fault(exc) != "prepared":
                raise
            if retry == 1 and not _prepare_refused:
                _prepare_refused = True
                log.warning(
                    "prepared_statements_unusable",
                    error=" ".join(str(exc).split()),
                    hint="set HOLDFAST_PREPARED_STATEMENTS=off behind a pooler that does "
                    "not keep prepared statements (PgBouncer < 1.21 in transaction mode)",
                )
            else:
                log.warning("prepared_statement_replanned", error=" ".join(str(exc).split()))
            connection.close()
    raise AssertionError("unreachable")


def _settle_and_claim_limited(
    params: dict[str, Any],
    settle: bool,
    worker_id: str | None,
    lanes: Sequence[str] | None,
    limits: Mapping[str, int] | None,
    kinds: Sequence[str] | None,
) -> tuple[bool, Claimed | None]:
    claim = worker_id is not None
    if claim:
        params["worker"] = worker_id
    if is_postgres():  # lane limits are slots taken by the statement itself: no lane lock
        return _pg_settle_and_claim(params, settle, claim, lanes, limits or {}, kinds)
    if not (claim and limits):
        lane_filter = _lane_filter(lanes, (), params) + _kind_filter(kinds, params)
        return _sqlite_settle_and_claim(params, lane_filter, settle=settle, claim=claim)
    with transaction.atomic():  # BEGIN IMMEDIATE: the running count stays true to commit
        lane_filter = _lane_filter(lanes, _full(limits), params) + _kind_filter(kinds, params)
        return _sqlite_settle_and_claim(params, lane_filter, settle=settle, claim=claim)


# The engine's own statements outside the handler's transaction (heartbeat, reclaim) bound
# their waits and skip the fsync wait: a lost renewal only shortens a lease. ``SET LOCAL``
# inside one multi-statement query applies to that query's implicit transaction alone, so
# nothing leaks into the session (or, behind a pooler, into another client's).
ENGINE_LOCK_TIMEOUT_MS = 1000
HEARTBEAT_STATEMENT_TIMEOUT_MS = 5000
RECLAIM_STATEMENT_TIMEOUT_MS = 60_000
RECLAIM_BATCH = 10_000

PG_HEARTBEAT_SETTINGS = f"""{NO_JIT}SET LOCAL synchronous_commit TO off;
SET LOCAL lock_timeout TO '{ENGINE_LOCK_TIMEOUT_MS}ms';
SET LOCAL statement_timeout TO '{HEARTBEAT_STATEMENT_TIMEOUT_MS}ms';
"""

# A heartbeat writes the job row alone (a HOT update: no index holds what it changes); the
# attempt's lease row is written when the attempt ends.
PG_HEARTBEAT = f"""
UPDATE jobs_job SET
    lease_expires_at = statement_timestamp() + {PG_LEASE},
    heartbeat_at = statement_timestamp()
WHERE id = %(job_id)s AND state = 'running' AND lease_token = %(token)s
RETURNING cancel_requested
"""

SQLITE_HEARTBEAT = f"""
UPDATE jobs_job SET
    lease_expires_at = strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', {SQLITE_LEASE}),
    heartbeat_at = {SQLITE_NOW}
WHERE id = %(job_id)s AND state = 'running' AND lease_token = %(token)s
RETURNING cancel_requested
"""


def heartbeat(job: Claimed) -> bool | None:
    """Renew ``job``'s lease from the database clock, fenced by state and lease token.

    Returns whether a cancel was requested, or None when the lease is lost. On
    PostgreSQL, outside a transaction (the lease keeper; ``ctx.heartbeat()`` outside a
    block) it is one query in its own implicit transaction, so it never holds the job row
    across anything. Inside a caller's transaction it is the bare statement: it never
    changes that transaction's settings.
    """
    params = {"job_id": job.id, "token": job.lease_token}
    if is_postgres():
        row = _last_row(_own_transaction(PG_HEARTBEAT_SETTINGS, PG_HEARTBEAT), params)
    else:
        with connection.cursor() as cursor:  # one statement: its own transaction
            cursor.execute(SQLITE_HEARTBEAT, params)
            row = cursor.fetchone()
    return None if row is None else bool(row[0])


def _own_transaction(settings: str, statement: str) -> str:
    """``statement`` with its ``SET LOCAL`` settings when it runs in a transaction of its
    own (autocommit); bare inside a caller's transaction, whose settings it must not
    change."""
    return statement if connection.in_atomic_block else settings + statement


def _last_row(query: str, params: dict[str, Any]) -> Any:
    """Run a multi-statement query (client-side binding); the last result's first row."""
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        row = None
        while True:
            if cursor.description is not None:
                row = cursor.fetchone()
            if not cursor.nextset():
                return row


# Reclaim, set-based: every expired lease (up to a batch) in one statement. Rows a live
# transaction is writing are skipped, never waited on (SKIP LOCKED); the guard (still
# running, same token, lease expired by the database clock) is re-checked on the locked
# row, so a lease renewed meanwhile is never taken. Only the lock rows of the reclaimed
# lease token are deleted, never those of a live lease. ``run_at`` is left alone: the job
# keeps its place in the queue.
PG_RECLAIM_SETTINGS = f"""{NO_JIT}SET LOCAL lock_timeout TO '{ENGINE_LOCK_TIMEOUT_MS}ms';
SET LOCAL statement_timeout TO '{{timeout_ms}}ms';
"""

PG_RECLAIM = f"""
WITH expired AS (
    SELECT id, lease_token, leased_by, heartbeat_at, lease_expires_at, started_at
    FROM jobs_job
    WHERE state = 'running' AND lease_expires_at < statement_timestamp()
      AND (%(job_id)s::bigint IS NULL OR id = %(job_id)s::bigint)
    ORDER BY lease_expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), reclaimed AS (
    UPDATE jobs_job AS job SET
        state = CASE WHEN %(cancel)s OR job.cancel_requested THEN 'cancelled'
                     WHEN job.attempts >= job.max_attempts THEN 'dead' ELSE 'queued' END,
        last_error = CASE WHEN %(cancel)s THEN 'cancelled by ' || %(actor)s::text
                          || ' after its worker stopped renewing lease ' || job.lease_token
                          WHEN job.cancel_requested
                          THEN 'cancelled on request: worker ' || COALESCE(expired.leased_by, '?')
                          || ' stopped renewing lease ' || job.lease_token
                          || ' before it stopped the job'
                          ELSE 'LeaseExpired: worker ' || COALESCE(expired.leased_by, '?')
                          || ' stopped renewing lease ' || job.lease_token
                          || ': it died, stopped responding or lost the database during attempt '
                          || job.attempts
                          END,
        cancel_requested = job.cancel_requested OR %(cancel)s,
        finished_at = CASE WHEN %(cancel)s OR job.cancel_requested
                                OR job.attempts >= job.max_attempts
                           THEN statement_timestamp() ELSE NULL END,
        leased_by = NULL,
        lease_expires_at = NULL,
        updated_at = statement_timestamp()
    FROM expired
    WHERE job.id = expired.id AND job.state = 'running'
      AND job.lease_token = expired.lease_token AND job.lease_expires_at < statement_timestamp()
    RETURNING job.id, job.lease_token, job.state, job.kind, job.lane, job.attempts,
              expired.leased_by, expired.heartbeat_at, expired.lease_expires_at,
              COALESCE(expired.started_at, statement_timestamp()) AS started_at
), reclaimed_lease AS (
    {WRITE_LEASE}
    SELECT id, attempts, lease_token, COALESCE(leased_by, ''), started_at,
           COALESCE(lease_expires_at, statement_timestamp()), statement_timestamp(),
           'lease_expired', 'LeaseExpired',
           'worker ' || COALESCE(leased_by, '?') || ' stopped renewing lease ' || lease_token
           || ': it died, stopped responding or lost the database during attempt ' || attempts,
           '', '{{}}'::jsonb, NULL, NULL
    FROM reclaimed
    ORDER BY id
    {LEASE_CONFLICT}
), freed AS (
    DELETE FROM jobs_joblock USING reclaimed
    WHERE jobs_joblock.job_id = reclaimed.id AND jobs_joblock.lease_token = reclaimed.lease_token
), took AS (
    SELECT kind, lane, state,
           greatest(0, extract(epoch FROM statement_timestamp() - started_at))::float8 AS s
    FROM reclaimed
), counted AS (
    INSERT INTO jobs_outcomecount (kind, lane, outcome, state, bucket, shard, count, seconds)
    SELECT kind, lane, 'lease_expired', state, bucket, mod(pg_backend_pid(), {SHARDS}),
           count(*), sum(s)
    FROM (SELECT kind, lane, state, s, {_bucket("s")} AS bucket FROM took) AS bucketed
    GROUP BY kind, lane, state, bucket
    ORDER BY kind, lane, state, bucket
    ON CONFLICT (kind, lane, outcome, state, bucket, shard) DO UPDATE SET
        count = jobs_outcomecount.count + EXCLUDED.count,
        seconds = jobs_outcomecount.seconds + EXCLUDED.seconds
), logged AS (
    INSERT INTO jobs_jobevent (job_id, at, event, lease_token, worker_id, data)
    SELECT reclaimed.id, statement_timestamp(), e.event, reclaimed.lease_token,
           COALESCE(reclaimed.leased_by, ''),
           CASE WHEN e.n = 1
                THEN jsonb_build_object('last_heartbeat_at', reclaimed.heartbeat_at)
                ELSE jsonb_build_object('expired_at', reclaimed.lease_expires_at,
                                        'state', reclaimed.state) END
    FROM reclaimed CROSS JOIN (VALUES (1, 'heartbeat_missed'), (2, 'reclaimed')) AS e(n, event)
    ORDER BY reclaimed.id, e.n
)
SELECT id, lease_token, state, kind, lane, attempts, leased_by FROM reclaimed ORDER BY id
"""

SQLITE_EXPIRED = f"""
SELECT id, lease_token, leased_by, heartbeat_at, lease_expires_at, attempts, max_attempts,
       kind, lane, COALESCE(started_at, {SQLITE_NOW}), COALESCE(lease_expires_at, {SQLITE_NOW}),
       cancel_requested
FROM jobs_job
WHERE state = 'running' AND lease_expires_at < {SQLITE_NOW} {{job_filter}}
ORDER BY lease_expires_at
LIMIT %(limit)s
"""

# The rest of a SQLite reclaim, inside the same BEGIN IMMEDIATE: every expired row at once,
# from one JSON parameter ([id, token, state, last_error, lease message, finished, kind,
# lane, worker, started_at, expires_at, attempt] rows); the attempt counters (metrics) get
# one upsert per kind and duration bucket.
SQLITE_RECLAIM_JOBS = f"""
UPDATE jobs_job SET
    state = json_extract(r.value, '$[2]'),
    last_error = json_extract(r.value, '$[3]'),
    cancel_requested = cancel_requested OR %(cancel)s,
    finished_at = CASE WHEN json_extract(r.value, '$[5]') THEN {SQLITE_NOW} ELSE NULL END,
    leased_by = NULL,
    lease_expires_at = NULL,
    updated_at = {SQLITE_NOW}
FROM json_each(%(rows)s) AS r
WHERE jobs_job.id = json_extract(r.value, '$[0]') AND jobs_job.state = 'running'
  AND jobs_job.lease_token = json_extract(r.value, '$[1]')
"""

SQLITE_RECLAIM_LEASES = f"""
{WRITE_LEASE}
SELECT json_extract(value, '$[0]'), json_extract(value, '$[11]'), json_extract(value, '$[1]'),
       json_extract(value, '$[8]'), json_extract(value, '$[9]'), json_extract(value, '$[10]'),
       {SQLITE_NOW}, 'lease_expired', 'LeaseExpired', json_extract(value, '$[4]'), '', '{{}}',
       NULL, NULL
FROM json_each(%(rows)s) WHERE true ORDER BY key
{LEASE_CONFLICT}
"""

SQLITE_RECLAIM_LOCKS = """
DELETE FROM jobs_joblock
WHERE (job_id, lease_token) IN (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]')
                                FROM json_each(%(rows)s))
"""

SQLITE_RECLAIM_COUNTS = f"""
INSERT INTO jobs_outcomecount (kind, lane, outcome, state, bucket, shard, count, seconds)
SELECT kind, lane, 'lease_expired', state, bucket, 0, count(*), sum(s)
FROM (SELECT kind, lane, state, s, {_bucket("s")} AS bucket
      FROM (SELECT json_extract(r.value, '$[6]') AS kind, json_extract(r.value, '$[7]') AS lane,
                   json_extract(r.value, '$[2]') AS state,
                   max(0.0, (julianday('now') - julianday(json_extract(r.value, '$[9]')))
                            * 86400.0) AS s
            FROM json_each(%(rows)s) AS r))
WHERE true
GROUP BY kind, lane, state, bucket
ON CONFLICT (kind, lane, outcome, state, bucket, shard) DO UPDATE SET
    count = count + excluded.count, seconds = seconds + excluded.seconds
"""

SQLITE_RECLAIM_EVENTS = f"""
INSERT INTO jobs_jobevent (job_id, at, event, lease_token, worker_id, data)
SELECT json_extract(value, '$[0]'), {SQLITE_NOW}, json_extract(value, '$[1]'),
       json_extract(value, '$[2]'), json_extract(value, '$[3]'), json_extract(value, '$[4]')
FROM json_each(%(events)s) ORDER BY key
"""


@dataclass(frozen=True)
class Reclaimed:
    """A job whose expired lease a reclaim ended, and what became of it."""

    id: int
    lease_token: int
    state: str  # queued | dead | cancelled
    kind: str
    lane: str
    attempt: int
    worker_id: str | None


def reclaim(
    limit: int = RECLAIM_BATCH,
    job_id: int | None = None,
    cancel: bool = False,
    actor: str = "",
    timeout_ms: int = RECLAIM_STATEMENT_TIMEOUT_MS,
) -> list[Reclaimed]:
    """End expired leases (up to ``limit``, or only ``job_id``'s) in a bounded few
    statements: the job back to ``queued`` (``dead`` when its attempts are spent;
    ``cancelled`` with ``cancel``, or when a cancel had been requested: the operator asked
    for no further attempt), the attempt ``lease_expired``, its locks freed."""
    if is_postgres():
        params = {"limit": limit, "job_id": job_id, "cancel": cancel, "actor": actor}
        settings = PG_RECLAIM_SETTINGS.format(timeout_ms=int(timeout_ms))
        rows = _all_rows(_own_transaction(settings, PG_RECLAIM), params)
        return [Reclaimed(*row) for row in rows]
    return _sqlite_reclaim(limit, job_id, cancel, actor)


def _all_rows(query: str, params: dict[str, Any]) -> list[Any]:
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        rows: list[Any] = []
        while True:
            if cursor.description is not None:
                rows = cursor.fetchall()
            if not cursor.nextset():
                return rows


def _sqlite_reclaim(limit: int, job_id: int | None, cancel: bool, actor: str) -> list[Reclaimed]:
    params: dict[str, Any] = {"limit": limit, "cancel": 1 if cancel else 0}
    job_filter = ""
    if job_id is not None:
        params["job_id"] = job_id
        job_filter = "AND id = %(job_id)s"
    with transaction.atomic(), connection.cursor() as cursor:  # BEGIN IMMEDIATE
        cursor.execute(SQLITE_EXPIRED.format(job_filter=job_filter), params)
        expired = cursor.fetchall()
        if not expired:
            return []
        rows, events, reclaimed = [], [], []
        for row in expired:
            pk, token, worker, beat, expiry, attempts, max_attempts, kind, lane = row[:9]
            start, until = row[9:11]  # the database's text (no converter on an expression)
            requested = bool(row[11])
            account = (
                f"worker {worker or '?'} stopped renewing lease {token}: "
                f"it died, stopped responding or lost the database during attempt {attempts}"
            )
            if cancel:
                state, error = (
                    "cancelled",
                    (f"cancelled by {actor} after its worker stopped renewing lease {token}"),
                )
            elif requested:
                state, error = (
                    "cancelled",
                    (
                        f"cancelled on request: worker {worker or '?'} stopped renewing lease "
                        f"{token} before it stopped the job"
                    ),
                )
            else:
                state = "dead" if attempts >= max_attempts else "queued"
                error = f"LeaseExpired: {account}"
            who = worker or ""
            ended = state != "queued"
            rows.append(
                [pk, token, state, error, account, ended, kind, lane, who, start, until, attempts]
            )
            beat_data = json.dumps({"last_heartbeat_at": beat}, default=str)
            end_data = json.dumps({"expired_at": expiry, "state": state}, default=str)
            events.append([pk, "heartbeat_missed", token, who, beat_data])
            events.append([pk, "reclaimed", token, who, end_data])
            reclaimed.append(Reclaimed(pk, token, state, kind, lane, attempts, worker))
        batch = {"rows": json.dumps(rows), "events": json.dumps(events), **params}
        cursor.execute(SQLITE_RECLAIM_JOBS, batch)
        cursor.execute(SQLITE_RECLAIM_LEASES, batch)
        cursor.execute(SQLITE_RECLAIM_LOCKS, batch)
        cursor.execute(SQLITE_RECLAIM_EVENTS, batch)
        cursor.execute(SQLITE_RECLAIM_COUNTS, batch)  # the attempts' and finished jobs' counts
    return reclaimed


@contextmanager
def ids_through_an_index() -> Iterator[None]:
    """PostgreSQL: plain index scans off for the statement(s) inside, in a transaction of
    their own (or the caller's, the setting put back after): an index-only or bitmap scan
    of a partial index is what is left.

    For listings of ids in id order of a set (dead jobs) that sits far behind newer rows:
    the planner cannot tell the set is old, so it estimates that walking the primary key
    backwards finds a page of it at once, and walks a million newer rows instead.
    """
    if not is_postgres():
        yield
        return
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('enable_indexscan'),"
                " set_config('enable_indexscan', 'off', true)"
            )
            (previous, _) = cursor.fetchone()
        yield
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('enable_indexscan', %s, true)", [previous])


def end_session_if_frozen(seconds: float) -> None:
    """PostgreSQL: the server ends this session if it sits idle inside the current
    transaction longer than ``seconds`` (its process frozen: SIGSTOP, a paused VM, a cut
    network), which rolls the transaction back and frees its row locks. ``LOCAL`` to the
    transaction; nothing on SQLite (see ``jobs.workers.FrozenHolderWatch``)."""
    if is_postgres():
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, true)",
                [f"{int(seconds * 1000)}ms"],
            )


def is_lock_wait(exc: OperationalError) -> bool:
    """Whether ``exc`` is a lock wait that ``lock_waits_bounded`` ended."""
    cause = exc.__cause__
    if isinstance(cause, psycopg.errors.LockNotAvailable):
        return True
    return "database is locked" in str(exc)


@contextmanager
def lock_waits_bounded(seconds: float) -> Iterator[None]:
    """A transaction whose lock waits (row locks; SQLite's database lock) end after
    ``seconds``, raising OperationalError, so an operator action never hangs behind a
    frozen holder. PostgreSQL: ``lock_timeout``, local to the transaction and, inside a
    caller's transaction, put back when the block ends (a failed block's savepoint
    rollback puts it back by itself); SQLite: the busy timeout, restored afterwards."""
    if is_postgres():
        nested = connection.in_atomic_block
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('lock_timeout'), set_config('lock_timeout', %s, true)",
                    [f"{int(seconds * 1000)}ms"],
                )
                (previous, _) = cursor.fetchone()
            yield
            if nested:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT set_config('lock_timeout', %s, true)", [previous])
        return
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA busy_timeout")
        (previous,) = cursor.fetchone()
        cursor.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")
    try:
        with transaction.atomic():
            yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"PRAGMA busy_timeout = {int(previous)}")


_thread_busy_timeout = threading.local()


def sqlite_busy_timeout(milliseconds: int) -> None:
    """This thread's SQLite connection waits at most this long for the write lock (the
    settings' 20 s otherwise), also once it is closed and opened again
    (``configure_session``): a lease keeper closes its connection after "database is
    locked", and the next step of the same pass waited 20 s on a new one, so a frozen
    holder of the lock was looked for every 20 s instead of every reclaim interval."""
    _thread_busy_timeout.ms = int(milliseconds)
    with connection.cursor() as cursor:
        cursor.execute(f"PRAGMA busy_timeout = {int(milliseconds)}")


def _full(limits: Mapping[str, int]) -> list[str]:
    """The limited lanes whose running jobs have reached their ``max_running``."""
    running = (
        Job.objects.filter(state="running", lane__in=list(limits))
        .values_list("lane")
        .annotate(n=Count("id"))
        .order_by()
    )
    return sorted(lane for lane, n in running if n >= limits[lane])


def _pg_settle_and_claim(
    params: dict[str, Any],
    settle: bool,
    claim: bool,
    lanes: Sequence[str] | None,
    limits: Mapping[str, int],
    kinds: Sequence[str] | None,
) -> tuple[bool, Claimed | None]:
    if not claim:
        return _pg_prepared(PG_SETTLE, params)[0] == 1, None
    if lanes is not None:
        params["lanes"] = _pg_array(tuple(lanes))
    if limits:
        limited = sorted(limits)
        params["limited"] = _pg_array(tuple(limited))
        params["limits"] = _pg_array(tuple(str(int(limits[lane])) for lane in limited))
    if kinds is not None:
        params["kinds"] = _pg_array(tuple(kinds))
    query = pg_claim(lanes is not None, bool(limits), kinds is not None, settle=settle)
    row = _pg_prepared(query, params)
    settled = settle and row[0] == 1
    if settle:
        row = row[1:]
    if row[11]:  # blocked rows the walk went past: out of the next claims' path
        _mark_blocked(row[11], params.get("kinds"))
    return settled, (_claimed(row) if row[0] is not None else None)


@functools.lru_cache(maxsize=256)  # a worker's lanes, limits and kinds: the same every claim
def _pg_array(values: tuple[str, ...]) -> str:
    """PostgreSQL: ``values`` as an array literal, for a ``%(name)s::text[]`` (or
    ``::int[]``) parameter. Built once per worker: psycopg dumped the list anew on every
    claim, element by element (the worker's CPU a job went from 185-190 µs to 150-164 µs
    without it, docs/benchmarks.md)."""
    quoted = ('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"' for value in values)
    return "{" + ",".join(quoted) + "}"


def _mark_blocked(passed: Any, kinds: str | None) -> None:
    """Mark the blocked rows the claim walked past (``PG_MARK_BLOCKED``), in statements of
    their own after the claim, a batch at a time until none is left. Bookkeeping only: if
    it fails, the rows stay in the runnable index and a later claim reads (and marks) them.
    """
    ranges = json.dumps(passed if isinstance(passed, list) else json.loads(passed), default=str)
    params: dict[str, Any] = {"passed": ranges, "kinds": kinds}
    kind_filter = "" if kinds is None else "AND kind = ANY(%(kinds)s::text[])"
    query = PG_MARK_BLOCKED.replace("{kind_filter}", kind_filter)
    marked = 0
    try:
        batch = MARK_BATCH
        while batch >= MARK_BATCH:  # a full batch: there may be more
            batch = len(_bookkeeping(query, params))
            marked += batch
    except DatabaseError as exc:
        if fault(exc) == "connection":
            raise
        log.warning("mark_blocked_failed", error=" ".join(str(exc).split()))
    if marked:
        log.debug("jobs_blocked", count=marked)


def promote_blocked(resources: Sequence[str] | None = None) -> list[int]:
    """PostgreSQL: put back into the runnable index the best blocked job of each of
    ``resources`` (None: every resource a job is blocked on) whose lock is free now
    (``PG_PROMOTE``); the ids promoted. Call it after the statement that released those
    locks (it must read a later snapshot). Nothing on SQLite (no job is ever marked)."""
    if not is_postgres() or (resources is not None and not resources):
        return []
    if resources is None:
        query, params = PG_SWEEP, {}
    else:
        query, params = PG_PROMOTE, {"resources": sorted(set(resources))}
    return [pk for (pk,) in _bookkeeping(query, params)]


def _bookkeeping(query: str, params: dict[str, Any]) -> list[Any]:
    """Run a marking or promotion statement; its rows. Outside a transaction, in one of
    its own with JIT off (one round trip); inside the caller's, bare, in a savepoint, so
    that its failure never aborts the caller's transaction."""
    if not connection.in_atomic_block:
        return _all_rows(NO_JIT + query, params)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(query, params)
        return cursor.fetchall()


def _pg_prepared(query: str, params: dict[str, Any]) -> Any:
    """Run a hot-path statement, prepared when allowed; return its one row (or None).

    Django's psycopg cursors bind parameters client-side and never prepare, so each claim
    and settle would be parsed and planned again: more server time than executing it.
    This runs the statement on a server-side-binding cursor of the same connection (so it
    joins Django's current transaction, if any), prepared once per connection unless
    ``HOLDFAST_PREPARED_STATEMENTS`` is off. That is why every placeholder in these
    statements carries an explicit type.
    """
    raw, prepare = _raw_connection()
    text, names = _native(query)
    with connection.wrap_database_errors, psycopg.RawCursor(raw) as cursor:
        cursor.execute(text, [params[name] for name in names], prepare=prepare)
        return cursor.fetchone()


# The session settings of a connection the engine may use (sent once per connection by
# ``configure_session``). JIT compiles a plan whose estimated cost passes
# ``jit_above_cost``: the claim's walk (recursive CTEs, whose row estimates grow tenfold a
# level) estimates past it once jobs_job has statistics, and compiling takes tens of
# milliseconds for a statement that runs in a fraction of one, on every execution. A
# generic plan: the hot path's parameters (ids, tokens, lane and kind lists) never change
# which plan is best, and a custom plan is planned again on every execution (about 1 ms
# for the claim), which the server chooses whenever its estimate of the generic one is
# higher (after ANALYZE with a blocked backlog, for one).
PG_SESSION_SETTINGS = "SET jit TO off; SET plan_cache_mode TO force_generic_plan"


def configure_session(sender: Any, connection: Any, **kwargs: Any) -> None:
    """``connection_created`` receiver: the engine's session settings on a new PostgreSQL
    connection, when the session is the process's own (prepared statements on). Behind a
    transaction-mode pooler a session setting would stay on a server connection other
    clients get next, so nothing is set; docs/operations.md says to set ``jit`` off for
    the role there. On SQLite: this thread's busy timeout (``sqlite_busy_timeout``)."""
    if connection.vendor == "sqlite":
        if (milliseconds := getattr(_thread_busy_timeout, "ms", None)) is not None:
            with connection.cursor() as cursor:
                cursor.execute(f"PRAGMA busy_timeout = {milliseconds}")
        return
    if connection.vendor != "postgresql" or not prepared_statements():
        return
    with connection.cursor() as cursor:
        cursor.execute(PG_SESSION_SETTINGS)


def analyze_if_never_analyzed() -> None:
    """``ANALYZE jobs_job`` when the server has never analyzed it (``reltuples`` -1: a new
    install, autovacuum not yet round, or off). Without statistics the planner takes the
    small partial indexes for the cheapest way to any row, and the claim's update found
    its candidate by walking every queued row (then job_due_idx) instead of by primary key.
    Run once by a starting worker; a failure (a role that may not analyze) is logged."""
    if not is_postgres():
        return
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT reltuples < 0 FROM pg_class WHERE oid = 'jobs_job'::regclass")
            if cursor.fetchone()[0]:
                cursor.execute("ANALYZE jobs_job")
                log.info("jobs_table_analyzed")
    except DatabaseError as exc:
        log.warning("analyze_failed", error=" ".join(str(exc).split()))


def warn_if_jit() -> None:
    """Log ``jit_enabled`` when this session compiles plans: behind a pooler (prepared
    statements off) ``configure_session`` sets nothing, and the claim may then pay tens
    of milliseconds of JIT compilation on every execution."""
    if not is_postgres() or prepared_statements():
        return
    with connection.cursor() as cursor:
        cursor.execute("SHOW jit")
        if cursor.fetchone()[0] == "on":
            log.warning(
                "jit_enabled",
                hint="JIT compiling slows every claim: ALTER ROLE <role> SET jit = off "
                "(docs/operations.md, behind a pooler)",
            )


def _raw_connection() -> tuple[Any, bool]:
    """Django's psycopg connection, set to prepare only ``prepare=True`` statements (or
    none), and whether to prepare."""
    connection.ensure_connection()
    raw = connection.connection
    prepare = prepared_statements()
    if prepare and raw.prepare_threshold is None:
        raw.prepare_threshold = 2**31 - 1  # only prepare=True statements get prepared
    elif not prepare and raw.prepare_threshold is not None:
        raw.prepare_threshold = None  # psycopg prepares nothing on this connection
    return raw, prepare


@functools.lru_cache(maxsize=256)  # one entry per statement and lane filter
def _native(query: str) -> tuple[bytes, tuple[str, ...]]:
    """``query`` with PostgreSQL's own ``$n`` placeholders for its ``%(name)s`` ones, as
    bytes, and the names in ``$n`` order, converted once per statement.

    psycopg converts named placeholders on every execution and caches that only for
    statements up to 4 KiB; the fused settle-and-claim is longer, and re-parsing it cost
    a fifth of a worker's CPU per job. A ``RawCursor`` takes the ``$n`` form as it is, and
    bytes as they are: a str would be encoded again on every execution, and the same bytes
    object keeps its hash for psycopg's prepared-statement cache (about 5 KiB a claim).
    """
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return re.sub(r"%%|%\((\w+)\)s", number, query).encode(), tuple(names)


def prepared_statements() -> bool:
    """Whether the hot path may use server-side prepared statements (see ``_replanning``)."""
    return bool(getattr(settings, "HOLDFAST_PREPARED_STATEMENTS", True)) and not _prepare_refused


_prepare_refused = False  # set once a fresh connection lost its prepared statement too


# --- database faults -------------------------------------------------------------------

# Errors about the session or the server, never about the data of the statement that met
# them: a fresh connection (or the same statement, re-prepared) can succeed.
SERVER_STATES = frozenset(
    {
        "57P01",  # admin_shutdown: the server restarts, or the session was terminated
        "57P02",  # crash_shutdown: another backend crashed
        "57P03",  # cannot_connect_now: starting up, or in recovery
        "57P05",  # idle_session_timeout
        "25006",  # read_only_sql_transaction: a standby, or a demoted primary (failover)
        "53300",  # too_many_connections
    }
)
PREPARED_STATES = frozenset({"26000", "42P05"})  # statement gone / name taken (a pooler)
STALE_PLAN = "cached plan must not change result type"  # 0A000, after ALTER TABLE


def fault(exc: BaseException) -> str | None:
    """``"prepared"`` or ``"connection"`` when ``exc`` is about the database session or
    server rather than the statement's data (which no job is to blame for); else None."""
    cause = exc if isinstance(exc, psycopg.Error) else exc.__cause__
    if not isinstance(cause, psycopg.Error):
        return None  # not PostgreSQL (SQLite's errors are about this host's file)
    state = cause.sqlstate
    if state in PREPARED_STATES or (state == "0A000" and STALE_PLAN in str(cause)):
        return "prepared"
    if state is None:
        # No answer from a server at all: the connection broke, or never came up.
        broken = isinstance(cause, psycopg.OperationalError | psycopg.InterfaceError)
        return "connection" if broken else None
    if state.startswith("08") or state in SERVER_STATES:
        return "connection"
    return None


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot serve us now (down, restarting, refusing
    writes, a lost session or prepared statement) rather than that a statement was wrong:
    what the worker and the scheduler wait out and the API answers with a 503. A standby
    not yet promoted refuses writes with ``InternalError`` (SQLSTATE 25006), which is
    neither of Django's two connection errors."""
    return isinstance(exc, OperationalError | InterfaceError) or fault(exc) is not None


# ``run(query, params)``: one statement of a SQLite transaction (``_sqlite_immediate``).
SqliteRun = Callable[[str, Mapping[str, Any]], Any]


def _sqlite_settle_and_claim(
    params: dict[str, Any], lane_filter: str, *, settle: bool, claim: bool
) -> tuple[bool, Claimed | None]:
    """The SQLite settle and claim, in one ``BEGIN IMMEDIATE`` transaction.

    Outside any transaction (the worker's hot path) the transaction is the sqlite3
    connection's own ``BEGIN IMMEDIATE`` … ``COMMIT`` (``_sqlite_immediate``), not
    ``transaction.atomic()``: the same statements under the same write lock, without
    Django's autocommit switching around them (a sixth of a job's time on SQLite). Inside
    a caller's transaction it is a savepoint of it, as any ``atomic()`` block.
    """
    return _sqlite_immediate(
        lambda run: _sqlite_statements(run, params, lane_filter, settle=settle, claim=claim)
    )


def _sqlite_statements(
    run: SqliteRun,
    params: dict[str, Any],
    lane_filter: str,
    *,
    settle: bool,
    claim: bool,
) -> tuple[bool, Claimed | None]:
    settled, claimed = False, None
    if settle:
        lease_row = run(SQLITE_SETTLE_LEASE, params).fetchone()
        settled = lease_row is not None
        if settled:
            params["took"] = lease_row[0]  # the attempt's duration, for its count
            run(SQLITE_SETTLE_JOB, params)
            if params["has_locks"]:
                run(SQLITE_RELEASE_LOCKS, params)
            run(SQLITE_COUNT_ATTEMPT, params)
    if claim:
        row = run(_sqlite_claim_query("lanes_json" in params, lane_filter), params).fetchone()
        if row is not None:
            claimed = _sqlite_take(run, row)
    return settled, claimed


@functools.lru_cache(maxsize=64)  # one entry per lane filter
def _sqlite_claim_query(lanes_listed: bool, lane_filter: str) -> str:
    """The claim's text for a worker's lanes and kinds: built once, not once per claim."""
    lanes = SQLITE_LANES_LISTED if lanes_listed else SQLITE_LANES_QUEUED
    return SQLITE_CLAIM.format(lanes=lanes, lane_filter=lane_filter)


def _sqlite_immediate[T](body: Callable[[SqliteRun], T]) -> T:
    """``body(run)`` inside a ``BEGIN IMMEDIATE`` transaction of the sqlite3 connection's
    own, for a caller outside any transaction (Django's connection is in autocommit and
    stays so): committed when ``body`` returns, rolled back if it raises. Inside a caller's
    transaction it is a savepoint of it, as any ``atomic()`` block.

    ``run(query, params)`` executes on the sqlite3 cursor itself: the query converted to
    SQLite's ``:name`` placeholders once per statement (``_sqlite_native``), errors still
    Django's (``wrap_database_errors``). Django's cursor wrapper converted every query on
    every execution (a third of a SQLite worker's time per job), and ``atomic()``'s
    autocommit switching cost a sixth. The write lock is taken at ``BEGIN IMMEDIATE``, as
    ``transaction_mode: IMMEDIATE`` takes it for ``atomic()``, with the connection's busy
    timeout. A plain function, and the connection's wrapper looked up once: each attribute
    read through ``django.db.connection`` is a thread-local look-up, and each context
    manager a generator, measurable at this rate.
    """
    db = connections[DEFAULT_DB_ALIAS]
    db.ensure_connection()
    cursor = db.connection.cursor()

    def run(query: str, params: Mapping[str, Any]) -> Any:
        return cursor.execute(_sqlite_native(query), params)

    try:
        with db.wrap_database_errors:
            if not db.autocommit:  # the caller's transaction: a savepoint of it
                with transaction.atomic():
                    return body(run)
            cursor.execute("BEGIN IMMEDIATE")
            try:
                result = body(run)
                cursor.execute("COMMIT")
            except BaseException:
                if db.connection.in_transaction:
                    db.connection.rollback()
                raise
            return result
    finally:
        cursor.close()


@functools.lru_cache(maxsize=256)  # one entry per statement and lane filter
def _sqlite_native(query: str) -> str:
    return re.sub(r"%%|%\((\w+)\)s", lambda m: "%" if m[0] == "%%" else f":{m[1]}", query)


def _sqlite_take(run: SqliteRun, row: Sequence[Any]) -> Claimed:
    """The rest of a SQLite claim: its resource locks (the lease row is the settle's)."""
    if row[9] != "[]":
        run(SQLITE_TAKE_LOCKS, {"job_id": row[0], "token": row[6], "locks": row[9]})
    return _claimed(row)


def insert_jobs(
    common: dict[str, Any],
    args_texts: Sequence[str],
    locks: Sequence[list[list[str]] | None],
    delay: float | None,
    run_at: datetime | None,
    notify: Sequence[str] = (),
) -> Iterator[tuple[list[int], datetime, datetime]]:
    """PostgreSQL: insert queued jobs sharing ``common`` options, one statement per JSON
    array of ``args_texts`` (with its ``locks``, one list per job, or None); the first
    also NOTIFYs each channel in ``notify`` with the lane as payload. Yields, per
    statement, the new ids in args order, their run_at and created_at.

    Prepared like the hot path (``_pg_prepared``): planning this statement anew cost more
    than running it for one job; the args go to the server as one bound parameter. Several
    statements are pipelined (call this inside a transaction): the server inserts the next
    batch while the caller builds the jobs of this one.
    """
    params = [
        {
            "kind": common["kind"],
            "lane": common["lane"],
            "priority": common["priority"],
            "max_attempts": common["max_attempts"],
            "lease_seconds": common["lease_seconds"],
            "run_at": run_at,
            "delay": delay or 0.0,
            "args": text,
            "locks": json.dumps(chunk_locks) if chunk_locks else None,
            "channels": list(notify) if n == 0 else [],
            "payload": common["lane"],
        }
        for n, (text, chunk_locks) in enumerate(zip(args_texts, locks, strict=True))
    ]
    if len(params) == 1:
        rows: Iterator[Any] = iter([_replanning(lambda: _pg_prepared(PG_INSERT_JOBS, params[0]))])
    else:
        rows = _pg_pipelined(PG_INSERT_JOBS, params)
    for ids, job_run_at, created_at, _ in rows:
        yield ids, _as_datetime(job_run_at), _as_datetime(created_at)


def _pg_pipelined(query: str, params_list: list[dict[str, Any]]) -> Iterator[Any]:
    """``_pg_prepared`` for several executions of one statement, sent in one pipeline;
    yields each one's row as it arrives."""
    raw, prepare = _raw_connection()
    text, names = _native(query)
    with connection.wrap_database_errors, raw.pipeline():
        cursors = []
        for params in params_list:
            cursor = psycopg.RawCursor(raw)
            cursor.execute(text, [params[name] for name in names], prepare=prepare)
            cursors.append(cursor)
        for cursor in cursors:
            with cursor:
                yield cursor.fetchone()


@functools.cache
def _job_id_sequence() -> str:
    """The sequence behind ``jobs_job.id`` (an identity column), as a SQL literal; read
    once per process."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT quote_literal(pg_get_serial_sequence('jobs_job', 'id'))")
        return str(cursor.fetchone()[0])


def draw_job_ids(
    count: int, delay: float | None, run_at: datetime | None, notify: Sequence[str], lane: str
) -> tuple[list[int], datetime, datetime]:
    """PostgreSQL, inside a transaction: ``count`` new job ids (ascending), the jobs'
    run_at and created_at from the database clock, and the NOTIFY on each of ``notify``
    (payload: ``lane``) for ``copy_jobs``."""
    raw, prepare = _raw_connection()
    text, names = _native(PG_DRAW_JOB_IDS.format(sequence=_job_id_sequence()))
    params = {
        "count": count,
        "run_at": run_at,
        "delay": delay or 0.0,
        "payload": lane,
        "channels": list(notify),
    }
    with connection.wrap_database_errors, psycopg.RawCursor(raw) as cursor:
        cursor.execute(text, [params[name] for name in names], prepare=prepare, binary=True)
        row: Any = cursor.fetchone()  # one row, always
    ids, job_run_at, created_at, _ = row
    return ids, _as_datetime(job_run_at), _as_datetime(created_at)


_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
_COPY_TRAILER = struct.pack(">h", -1)
_POSTGRES_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_EMPTY_LOCKS = struct.pack(">i", 3) + b"\x01[]"


def _copy_field(value: bytes) -> bytes:
    return struct.pack(">i", len(value)) + value


def _copy_timestamp(value: datetime) -> bytes:
    return _copy_field(struct.pack(">q", (value - _POSTGRES_EPOCH) // timedelta(microseconds=1)))


@contextmanager
def copy_jobs(
    common: Mapping[str, Any], run_at: datetime, created_at: datetime
) -> Iterator[Callable[[Sequence[int], Sequence[str], Sequence[list[str]] | None], None]]:
    """PostgreSQL, inside a transaction: COPY queued jobs sharing ``common`` options into
    jobs_job with the ids and timestamps ``draw_job_ids`` gave. Yields ``write(ids,
    args_texts, locks)``, which sends one batch of rows (``locks``: one list per job, or
    None for none); the rows are the ones ``PG_INSERT_JOBS`` writes, column for column.

    Binary format, each row built from two bytes objects around the job's id and args:
    every other column is the same for all the rows, encoded once. Field lengths are
    those of the encoded bytes (the args text is ASCII today, but need not stay so).
    """
    stamp = _copy_timestamp(created_at)
    constant = b"".join(
        [
            _copy_field(common["kind"].encode()),
            _copy_field(common["lane"].encode()),
            _copy_field(struct.pack(">h", common["priority"])),
            _copy_field(b"queued"),
            _copy_timestamp(run_at),
            _copy_field(struct.pack(">i", 0)),  # attempts
            _copy_field(struct.pack(">i", common["max_attempts"])),
            _copy_field(struct.pack(">d", common["lease_seconds"])),
            _copy_field(struct.pack(">q", 0)),  # lease_token
            _copy_field(b"\x00"),  # cancel_requested
            _copy_field(b""),  # last_error
            stamp,  # created_at
            stamp,  # updated_at
        ]
    )
    head = struct.Struct(">hiqi").pack  # field count; id (length, value); args' length
    raw, _ = _raw_connection()

    def write(ids: Sequence[int], texts: Sequence[str], locks: Sequence[list[str]] | None) -> None:
        if locks is None:
            tail = _EMPTY_LOCKS + constant
            data = b"".join(
                [
                    head(16, 8, pk, len(args) + 1) + b"\x01" + args + tail
                    for pk, args in zip(ids, map(str.encode, texts), strict=True)
                ]
            )
        else:
            data = b"".join(
                [
                    head(16, 8, pk, len(args) + 1)
                    + b"\x01"
                    + args
                    + _copy_field(b"\x01" + json.dumps(names).encode())
                    + constant
                    for pk, args, names in zip(ids, map(str.encode, texts), locks, strict=True)
                ]
            )
        copy.write(data)

    with (
        connection.wrap_database_errors,
        raw.cursor() as cursor,
        cursor.copy(PG_COPY_JOBS) as copy,
    ):
        copy.write(_COPY_HEADER)
        yield write
        copy.write(_COPY_TRAILER)


def sqlite_insert_jobs(
    common: dict[str, Any],
    args_json: Sequence[str],
    locks: list[list[str]] | None,
    delay: float | None,
    run_at: datetime | None,
) -> tuple[list[int], datetime, datetime]:
    """SQLite: ``insert_jobs`` as one executemany; call it inside a transaction."""
    with connection.cursor() as cursor:
        cursor.execute(SQLITE_INSERT_CLOCK, [f"{delay or 0.0:+.3f} seconds"])
        now, delayed, highest = cursor.fetchone()
        when = delayed if run_at is None else str(connection.ops.adapt_datetimefield_value(run_at))
        row = (common["kind"], common["lane"])
        rest = (common["priority"], when, common["max_attempts"], common["lease_seconds"], now, now)
        if locks:
            rows = [
                (*row, text, json.dumps(names), *rest)
                for text, names in zip(args_json, locks, strict=True)
            ]
        else:
            rows = [(*row, text, "[]", *rest) for text in args_json]
        cursor.executemany(SQLITE_INSERT_JOB, rows)
        cursor.execute("SELECT id FROM jobs_job WHERE id > %s ORDER BY id", [highest])
        ids = [found for (found,) in cursor.fetchall()]
    if len(ids) != len(args_json):  # another writer inside our write lock: impossible
        raise DatabaseError(f"inserted {len(args_json)} jobs but found {len(ids)} new ids")
    return ids, run_at or _as_datetime(delayed), _as_datetime(now)


def _lane_filter(
    lanes: Sequence[str] | None, excluded: Sequence[str], params: dict[str, Any]
) -> str:
    """SQLite: the claim's lane condition: only ``lanes`` (None: any; also the claim's list
    of lanes to walk, ``lanes_json``), never ``excluded``."""
    if lanes is not None:
        params["lanes_json"] = _lanes_json(tuple(lanes))
    clauses = []
    for operator, prefix, names in (("IN", "lane", lanes), ("NOT IN", "excluded", excluded)):
        if names is None or (operator == "NOT IN" and not names):
            continue
        keys = [f"{prefix}{i}" for i in range(len(names))]
        params.update(zip(keys, names, strict=True))
        clauses.append(f"AND lane {operator} ({', '.join(f'%({key})s' for key in keys)})")
    return " ".join(clauses)


def _kind_filter(kinds: Sequence[str] | None, params: dict[str, Any]) -> str:
    """SQLite: the claim's kind condition: only kinds this worker can run (None: any kind).

    One parameter whatever the number of kinds, so the claim keeps one text: the kinds
    joined by the unit separator (``\\x1f``). A job's kind between two separators is found
    in that text exactly when it is one of them, since no served kind holds a separator
    (``@handler`` takes printable kinds only) and a stored kind that holds one never
    passes. A ``json_each`` list built its table on every claim (3 µs with 12 kinds).
    """
    if kinds is None:
        return ""
    params["kinds"] = _kinds_text(tuple(kinds))
    return " AND instr(%(kinds)s, char(31) || kind || char(31)) > 0 AND instr(kind, char(31)) = 0"


@functools.lru_cache(maxsize=64)  # a worker's lanes are the same on every claim
def _lanes_json(lanes: tuple[str, ...]) -> str:
    """SQLite: the lanes to walk (``SQLITE_LANES_LISTED``), each once, as one JSON text."""
    return json.dumps(sorted(set(lanes)))


@functools.lru_cache(maxsize=64)  # a worker's kinds are the same on every claim
def _kinds_text(kinds: tuple[str, ...]) -> str:
    if any("\x1f" in kind for kind in kinds):
        raise ValueError(f"a served job kind holds no unit separator (\\x1f): {kinds!r}")
    return "\x1f" + "\x1f".join(kinds) + "\x1f"


def _settle_params(job: Claimed, how: Settlement) -> dict[str, Any]:
    return {
        "job_id": job.id,
        "kind": job.kind,
        "lane": job.lane,
        "token": job.lease_token,
        "attempt": job.attempt,
        "has_locks": bool(job.locks),
        "state": how.state,
        "outcome": how.outcome,
        "uncharge": 1 if how.uncharge else 0,
        "result": None if how.result is None else json.dumps(how.result),
        "last_error": how.last_error,
        "error_class": how.error_class,
        "error_message": how.error_message,
        "traceback": how.traceback,
        "context": json.dumps(how.context, default=str) if how.context else "{}",
        "delay": how.delay,
        "delay_modifier": f"{how.delay:+.3f} seconds",
    }


def _claimed(row: Sequence[Any]) -> Claimed:
    args, locks = row[3], row[9]
    if isinstance(args, str | bytes):
        args = json.loads(args)
    if locks == "[]":  # SQLite's text for no locks, most jobs'
        locks = ()
    elif isinstance(locks, str | bytes):
        locks = json.loads(locks)
    return Claimed(
        id=row[0],
        kind=row[1],
        lane=row[2],
        args=args,
        attempt=row[4],
        max_attempts=row[5],
        lease_token=row[6],
        lease_seconds=row[7] if row[7] <= MAX_LEASE_SECONDS else MAX_LEASE_SECONDS,  # NaN too
        lease_expires_at=_as_datetime(row[8]),
        locks=tuple(locks),
        cancel_requested=bool(row[10]),
    )


def _as_datetime(value: datetime | str) -> datetime:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    try:  # SQLite's 'YYYY-MM-DD HH:MM:SS.fff': no regular expression needed
        parsed: datetime | None = datetime.fromisoformat(value)
    except ValueError:
        parsed = parse_datetime(value)
    if parsed is None:
        raise ValueError(f"not a timestamp: {value!r}")
    return parsed.replace(tzinfo=UTC)
