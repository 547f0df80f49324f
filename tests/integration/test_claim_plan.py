"""Claim cost stays flat however many finished jobs the table holds (partial indexes)."""

import itertools
import re

import pytest
from django.db import connection

from jobs import enqueueing
from jobs.models import Job, State
from jobs.sql import PG_RECLAIM, pg_claim

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]


def explain(lanes: list[str] | None, limits: dict[str, int] | None, kinds: bool) -> str:
    params = {"worker": "w", "lanes": lanes, "kinds": ["test.noop"] if kinds else None}
    if limits:
        params.update(limited=list(limits), limits=list(limits.values()))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")
        cursor.execute("EXPLAIN " + pg_claim(lanes is not None, bool(limits), kinds), params)
        return "\n".join(row[0] for row in cursor.fetchall())


SHAPES = [
    (None, None, False),  # any lane: the any-lane index, priority by priority
    (None, None, True),
    (["default"], None, True),  # lane by lane through the lane index
    (None, {"limited": 2}, True),  # every lane with a queued job, less the full ones
    (["default", "limited"], {"limited": 2}, False),
]


@pytest.mark.parametrize("lanes,limits,kinds", SHAPES)
def test_claim_reads_only_runnable_rows_in_claim_order(lanes, limits, kinds):
    """With 20,000 finished jobs and a backlog, claim walks a partial index in order."""
    finished = enqueueing.enqueue_many("test.noop", [{} for _ in range(20_000)])
    Job.objects.filter(pk__in=[job.pk for job in finished]).update(state=State.SUCCEEDED)
    enqueueing.enqueue_many("test.noop", [{} for _ in range(3_000)])
    plan = explain(lanes, limits, kinds)
    assert "job_runnable_idx" in plan, plan
    walk = plan.split("CTE claimed")[0]
    # job_state_idx only to count a limited lane's running rows, never to walk queued ones
    lines = walk.splitlines()
    conds = [after for line, after in itertools.pairwise(lines) if "job_state_idx" in line]
    assert all("Index Cond" in cond and "'running'" in cond for cond in conds), plan
    assert not re.search(r"Seq Scan on jobs_job\b", plan), plan
    # Index order, no sort of job rows: the only sort ranks the (lane, priority) heads.
    sorts = re.findall(r"Sort Key: (.*)", plan.split("CTE claimed")[0])
    assert set(sorts) <= {"heads.p DESC, heads.run_at, heads.id", "n.n"}, plan  # n: lane slots


def plan_of(sql: str, params: dict | None = None, seqscan: bool = True) -> str:
    with connection.cursor() as cursor:
        if seqscan:  # a plan from real statistics (ANALYZE's row counts outlive rollback)
            cursor.execute("ANALYZE jobs_job")
        else:  # "can an index serve it at all": small tables would seq-scan
            cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN " + sql, params or {})
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("RESET enable_seqscan")
        return plan


def test_reclaim_reads_only_running_rows():
    """With 20,000 finished jobs, 3,000 running ones (one expired) and a backlog, reclaim
    reads the running rows through the (state, lane, kind) index, never the table (no
    index of its own on lease_expires_at: heartbeats stay HOT updates)."""
    jobs = enqueueing.enqueue_many("test.noop", [{} for _ in range(26_000)])
    ids = [job.pk for job in jobs]
    Job.objects.filter(pk__in=ids[:20_000]).update(state=State.SUCCEEDED)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE jobs_job SET state = 'running', lease_token = 1, leased_by = 'w',"
            " lease_expires_at = now() + (CASE WHEN id = %s THEN -1 ELSE 60 END)"
            " * interval '1 minute' WHERE id = ANY(%s)",
            [ids[20_000], ids[20_000:23_000]],
        )
    params = {"limit": 100, "job_id": None, "cancel": False, "actor": "reclaimer"}
    plan = plan_of(PG_RECLAIM, params)
    assert "job_state_idx" in plan, plan
    assert not re.search(r"Seq Scan on jobs_job\b", plan), plan


def test_no_redundant_indexes():
    """Issue 16: no single-column index beside a composite one that leads with it, and no
    pattern-ops index of the lock name (only ever compared for equality)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tablename, indexdef FROM pg_indexes WHERE schemaname = current_schema()"
            " AND tablename IN ('jobs_lease', 'jobs_jobevent', 'jobs_joblock')"
        )
        indexes = cursor.fetchall()
    defs = {table: [d for t, d in indexes if t == table] for table, _ in indexes}
    assert [d for d in defs["jobs_lease"] if "(job_id)" in d] == [], defs
    assert [d for d in defs["jobs_jobevent"] if "(job_id)" in d] == [], defs
    assert [d for d in defs["jobs_joblock"] if "pattern_ops" in d] == [], defs


LOOKUPS = [
    # the statement that reads by job (or resource), and the index that must serve it
    ("SELECT * FROM jobs_jobevent WHERE job_id = 1 ORDER BY id", "jobevent_job_idx"),
    ("DELETE FROM jobs_jobevent WHERE job_id = ANY('{1,2}')", "jobevent_job_idx"),
    ("SELECT * FROM jobs_lease WHERE job_id = 1 ORDER BY lease_token", "lease_job_token_unique"),
    (
        "SELECT * FROM jobs_lease WHERE job_id = 1 AND outcome = 'released'",
        "lease_job_token_unique",
    ),
    ("DELETE FROM jobs_lease WHERE job_id = ANY('{1,2}')", "lease_job_token_unique"),
    (
        "SELECT * FROM jobs_lease WHERE job_id = 1 AND lease_token = 2",
        "lease_job_token_unique",
    ),
    (
        "SELECT 1 FROM jobs_joblock WHERE resource IN (SELECT jsonb_array_elements_text("
        '\'["source:a", "source:b"]\'::jsonb))',
        "jobs_joblock_pkey",
    ),
    ("DELETE FROM jobs_joblock WHERE job_id = 1 AND lease_token = 2", "jobs_joblock_job_id"),
]


@pytest.mark.parametrize("sql,index", LOOKUPS)
def test_lookups_keep_an_index(sql, index):
    """Every lookup the dropped indexes could have served (the ORM's by-job reads, the
    cascade of a job's delete, the claim's lock test, the settle's lock release) has an
    index that serves it."""
    plan = plan_of(sql, seqscan=False)
    assert index in plan, plan
    assert "Seq Scan" not in plan, plan


def test_claim_takes_its_candidate_by_primary_key_even_on_a_table_never_analyzed():
    """The claim's update finds the row its walk chose by id. Joined to the candidate CTE
    instead, a table with no statistics (a new install, autovacuum off or not yet round)
    was planned as a scan of every queued row (job_due_idx) per claim, as a generic
    prepared plan for good."""
    enqueueing.enqueue_many("test.noop", [{} for _ in range(3_000)])
    params = {"worker": "w", "kinds": ["test.noop"]}
    with connection.cursor() as cursor:
        cursor.execute("UPDATE pg_class SET reltuples = -1 WHERE oid = 'jobs_job'::regclass")
        cursor.execute("SELECT 1 FROM pg_statistic WHERE starelid = 'jobs_job'::regclass")
        cursor.execute("DELETE FROM pg_statistic WHERE starelid = 'jobs_job'::regclass")
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute("EXPLAIN " + pg_claim(False, False, True), params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    update = plan.split("CTE claimed")[1].split("CTE lease")[0]
    assert "Index Scan using jobs_job_pkey on jobs_job job" in update, plan
    assert "Index Cond: (id = " in update, plan
