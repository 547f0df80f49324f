"""``job_state_idx`` holds every job but the succeeded ones (migration 0014_i16), and every
query that looks jobs up by state still goes through an index, on both databases.

SQLite uses a partial index only for a query that repeats one of its condition's terms
(``state = 'queued'``, or ``state = 'queued' OR state = 'running'``), never for
``state IN (…)``: a query written that way reads the whole table, ten million finished
rows included. So the test runs the real callers (``queue_status``, a metrics scrape,
``list_jobs``, the dead-jobs selection, an enqueue into a ``max_queued`` lane, discovery's
look-up of a running source), captures each query they send that filters jobs by state,
and reads its plan. The engine's hot-path statements are PostgreSQL prepared statements
outside Django's cursor: tests/integration/test_claim_plan.py reads theirs.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from django.core.management import CommandError
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from prometheus_client import generate_latest

from ingestion.discovery import active_jobs, first_active
from jobs import enqueueing, operations
from jobs.models import Job, State
from jobs.status import queue_status
from ops import metrics

from .helpers import claim_one, index_condition, run
from .helpers import query_plan as plan

pytestmark = pytest.mark.django_db

BY_STATE = re.compile(r'"jobs_job"\."state"')
# A SQLite scan is acceptable only of an index that holds no finished history.
PARTIAL = ("job_state_idx", "job_runnable_idx", "job_blocked_idx")


def enqueue_into_a_bounded_lane() -> None:
    with override_settings(HOLDFAST_LANES={"default": {"max_queued": 100}}):
        enqueueing.enqueue("test.echo")


CALLERS: dict[str, Callable[[], object]] = {
    "queue_status (and the API's queue/)": queue_status,
    "a metrics scrape": lambda: generate_latest(metrics.registry()),
    "list_jobs --state cancelled": lambda: run("list_jobs", "--state", "cancelled"),
    "list_jobs --state running --lane default": lambda: run(
        "list_jobs", "--state", "running", "--lane", "default"
    ),
    "dead jobs of a kind and lane (requeue_dead, dead-jobs/)": lambda: list(
        operations.dead_jobs(kind="test.echo", lane="default")
    ),
    "enqueue into a lane with max_queued": enqueue_into_a_bounded_lane,
    "a source's discovery run, queued or running": lambda: list(active_jobs("docs")),
}


def full_scans(found: str) -> list[str]:
    """The plan's lines that read all of jobs_job (or all of an index of its history)."""
    lines = found.splitlines()
    return [
        line
        for line in lines
        if "Seq Scan on jobs_job " in line
        or (
            re.search(r"\bSCAN jobs_job\b", line) is not None
            and not any(index in line for index in PARTIAL)
        )
    ]


@pytest.mark.parametrize("name", CALLERS)
def test_each_lookup_by_state_goes_through_an_index(name: str) -> None:
    for _ in range(3):  # history the index leaves out, and a job in each other state
        enqueueing.enqueue("test.echo")
        Job.objects.filter(pk=claim_one().id).update(state=State.SUCCEEDED)
    for state in (State.RUNNING, State.DEAD, State.CANCELLED):
        job = enqueueing.enqueue("test.echo")
        Job.objects.filter(pk=job.pk).update(state=state)
    with CaptureQueriesContext(connection) as captured:
        CALLERS[name]()
    queries = [q["sql"] for q in captured.captured_queries if BY_STATE.search(q["sql"])]
    assert queries, f"{name} sent no query by state: the test no longer covers it"
    for query in queries:
        found = plan(query)
        assert not full_scans(found), f"{query}\n{found}"


def test_the_state_index_leaves_out_succeeded_jobs_only() -> None:
    definition = index_condition("job_state_idx")
    assert definition is not None
    kept = {state for state in State.values if f"'{state}'" in definition}
    assert kept == set(State.values) - {State.SUCCEEDED}, definition


def test_sqlite_reclaim_reads_the_running_rows_through_the_state_index() -> None:
    if connection.vendor != "sqlite":
        pytest.skip("PostgreSQL's reclaim plan: tests/integration/test_claim_plan.py")
    from jobs.sql import SQLITE_EXPIRED, _sqlite_native

    query = _sqlite_native(SQLITE_EXPIRED.format(job_filter=""))
    connection.ensure_connection()
    rows = connection.connection.execute("EXPLAIN QUERY PLAN " + query, {"limit": 1})
    found = "\n".join(row[3] for row in rows)
    assert "job_state_idx" in found, found


# Callers whose own query goes by state (a listing by kind or lane alone, in every state,
# reads the history by id until it has a page: docs/operations.md).
UNKNOWN_FILTERS: dict[str, Callable[[], object]] = {
    "requeue_dead --kind no.such": lambda: run("requeue_dead", "--kind", "no.such", "--dry-run"),
    "requeue_dead --lane nolane": lambda: run("requeue_dead", "--lane", "nolane", "--dry-run"),
    "list_jobs --state dead --kind no.such.task.path": lambda: run(
        "list_jobs", "--state", "dead", "--kind", "no.such.task.path"
    ),
}


@pytest.mark.parametrize("name", UNKNOWN_FILTERS)
def test_an_unknown_kind_or_lane_is_refused_without_reading_the_history(name: str) -> None:
    """``operations.check_filters`` confirms a name is unknown from the state index and the
    counts: a query of jobs_job by lane or kind alone read every row (ten million
    succeeded ones included) for each mistyped name."""
    for _ in range(3):
        enqueueing.enqueue("test.echo")
        Job.objects.filter(pk=claim_one().id).update(state=State.SUCCEEDED)
    with CaptureQueriesContext(connection) as captured, pytest.raises(CommandError) as refused:
        UNKNOWN_FILTERS[name]()
    assert "unknown" in str(refused.value)
    queries = [q["sql"] for q in captured.captured_queries if 'FROM "jobs_job"' in q["sql"]]
    assert queries, f"{name} read no jobs: the test no longer covers it"
    for query in queries:
        found = plan(query)
        assert not full_scans(found), f"{query}\n{found}"
        whole_pkey = r"Index (Only )?Scan (Backward )?using jobs_job_pkey on jobs_job\s*$"
        assert not re.search(whole_pkey, found, re.M), f"{query}\n{found}"


# Look-ups behind a newer history (scale audit): each must read the rows it returns, not
# walk the primary key past every newer job of other states. (The listing, the primary key
# entries it may read: one per row it returns, and a few.)
BEHIND_HISTORY: dict[str, tuple[Callable[[], object], int]] = {
    "GET dead-jobs/": (lambda: dead_jobs_page(), 1_000),
    "list_jobs --state dead": (lambda: run("list_jobs", "--state", "dead"), 1_000),
    # Every dead job is listed, by id (15,000): not the 60,000 newer ones, batch by batch.
    "requeue_dead --all --dry-run": (lambda: run("requeue_dead", "--all", "--dry-run"), 16_000),
    # Not a listing: the look-up of a source's discovery job, which walked the whole key.
    "discovery's look-up of a source's active job": (lambda: first_active("docs"), 1_000),
}


def dead_jobs_page() -> None:
    from django.test import Client

    from ops import tokens

    token = tokens.create("plan-reader", "read")[1]
    response = Client().get("/internal/v1/dead-jobs/", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 200 and response.json()["count"] == 15_000


@pytest.mark.postgres
@pytest.mark.parametrize("name", BEHIND_HISTORY)
def test_a_lookup_behind_a_newer_history_reads_no_more_than_it_returns(name: str) -> None:
    """15,000 dead jobs, then 60,000 newer succeeded ones. Asked for whole rows in id
    order, PostgreSQL walked the primary key past all 60,000 (its statistics cannot tell
    that the dead ones are old): a listing reads the ids through job_ended_badly_idx first
    (operations.rows_by_id)."""
    with connection.cursor() as cursor:
        for state, count in (("dead", 15_000), ("succeeded", 60_000)):
            cursor.execute(
                "INSERT INTO jobs_job (kind, lane, args, priority, state, run_at, attempts,"
                " max_attempts, lease_seconds, lease_token, cancel_requested, last_error,"
                " created_at, updated_at, finished_at, locks)"
                " SELECT 'test.echo', 'default', '{}', 0, %s, now(), 1, 1, 60, 1, false, '',"
                " now(), now(), now(), '[]' FROM generate_series(1, %s)",
                [state, count],
            )
        cursor.execute("ANALYZE jobs_job")
    lookup, bound = BEHIND_HISTORY[name]
    before = primary_key_reads()
    lookup()
    read = primary_key_reads() - before
    assert read < bound, f"{name} read {read} entries of jobs_job's primary key"


def primary_key_reads() -> int:
    """Entries of jobs_job's primary key read by this transaction so far."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_get_xact_tuples_returned('jobs_job_pkey'::regclass)")
        return int(cursor.fetchone()[0])


def test_unique_key_lookups_go_through_the_unique_index_with_bound_parameters() -> None:
    """The plan of each statement as sent, its parameters bound (not inlined, as
    query_plan's are): SQLite cannot tell that ``state IN (%s, %s)`` implies the partial
    index's ``state IN ('queued', 'running')``, so every unique-key look-up of an
    enqueue_many (and the refresher's "already being fetched?") read the whole table."""
    from ingestion.artifacts import without_active_fetch
    from ingestion.models import Artifact
    from jobs.enqueueing import active_by_key

    sent: list[tuple[str, tuple]] = []

    def record(execute, sql, params, many, context):
        sent.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        active_by_key(["fetch:1", "fetch:2"])
        list(without_active_fetch(Artifact.objects.filter(pk__in=[1, 2])).values_list("pk"))
    assert len(sent) == 2
    for sql, params in sent:
        with connection.cursor() as cursor:
            if connection.vendor == "sqlite":
                cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
                found = "\n".join(row[3] for row in cursor.fetchall())
            else:
                cursor.execute("SET enable_seqscan = off")
                cursor.execute("EXPLAIN " + sql, params)
                found = "\n".join(row[0] for row in cursor.fetchall())
                cursor.execute("RESET enable_seqscan")
        assert "job_unique_key_active" in found, f"{sql}\n{found}"


@pytest.mark.postgres
def test_plain_index_scans_come_back_after_an_ids_read_in_a_callers_transaction() -> None:
    """``sql.ids_through_an_index`` turns plain index scans off for its own statements
    only: inside a caller's transaction (the requeue view's, say) the setting is put back,
    on the way out and when the block fails."""
    from django.db import transaction

    from jobs import sql

    def setting() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('enable_indexscan')")
            return cursor.fetchone()[0]

    with transaction.atomic():
        with sql.ids_through_an_index():
            assert setting() == "off"
        assert setting() == "on"
        with pytest.raises(ZeroDivisionError), sql.ids_through_an_index():
            1 / 0  # noqa: B018
        assert setting() == "on"
