"""An idle worker's "when is my next job due?" (``jobs.sql.next_due_in``) walks the runnable
index lane by lane and priority by priority (migration 0015_i16 dropped the index of its
own): the earliest runnable job still ahead, of the worker's lanes, within its horizon;
a blocked job is left out (it runs when its lock frees). And it reads no table and no
range of delayed jobs, however many of them wait."""

from __future__ import annotations

import re
from datetime import timedelta

import psycopg
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from jobs import enqueueing, sql
from jobs.models import Job
from tests.conftest import database_url

from .helpers import query_plan

pytestmark = pytest.mark.django_db


def delayed(seconds: float, lane: str = "default", priority: int = 0) -> Job:
    return enqueueing.enqueue(
        "test.noop", {}, lane=lane, priority=priority, delay=timedelta(seconds=seconds)
    )


@pytest.fixture
def lanes(settings: pytest.FixtureRequest) -> None:
    settings.HOLDFAST_LANES = {"default": {}, "a": {}, "b": {}, "c": {}}


def test_the_earliest_runnable_job_ahead_of_the_lanes_served(lanes: None) -> None:
    delayed(40, "a", priority=5)
    delayed(20, "a", priority=0)  # a lower priority, due earlier: still the lane's next
    delayed(10, "b")
    blocked = delayed(2, "b")
    Job.objects.filter(pk=blocked.pk).update(blocked_by="res:x")
    enqueueing.enqueue("test.noop", {}, lane="b")  # due now: claimable, not "ahead"

    assert sql.next_due_in(None, 60) == pytest.approx(10, abs=1.5)
    assert sql.next_due_in(["a"], 60) == pytest.approx(20, abs=1.5)
    assert sql.next_due_in(["a", "c"], 60) == pytest.approx(20, abs=1.5)
    assert sql.next_due_in(["a"], 15) is None  # beyond the horizon
    assert sql.next_due_in(["c"], 60) is None  # nothing in the lane
    Job.objects.filter(pk=blocked.pk).update(blocked_by=None)
    assert sql.next_due_in(["b"], 60) == pytest.approx(2, abs=1.5)


def test_an_empty_queue_has_nothing_due() -> None:
    assert sql.next_due_in(None, 5) is None
    assert sql.next_due_in(["default"], 5) is None


@pytest.mark.parametrize("lane_list", [None, ["default", "a"]])
def test_the_look_up_probes_the_runnable_index_only(lanes: None, lane_list: list[str] | None):
    """The plan of the query ``next_due_in`` sends: the runnable index only, no sort, and
    each (lane, priority) probe starts after now (a probe reading a range's due rows
    first would pass the rest of this test and read a backlog on every idle wake-up)."""
    enqueueing.enqueue_many("test.noop", [{}] * 200, delay=timedelta(hours=1), priority=3)
    delayed(30, "a")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")
    with CaptureQueriesContext(connection) as captured:
        assert sql.next_due_in(lane_list, 60) == pytest.approx(30, abs=1.5)
    (query,) = [q["sql"] for q in captured.captured_queries]
    found = query_plan(query)
    assert "job_runnable_idx" in found, found
    if connection.vendor == "sqlite":
        # The one SCAN is the first lane's, in index order under LIMIT 1 (one row read).
        table_scans = [
            line
            for line in found.splitlines()
            if ("SCAN jobs_job" in line and "USING INDEX job_runnable_idx" not in line)
            or "TEMP B-TREE" in line
        ]
        assert not table_scans, found
        assert "job_runnable_idx (lane=? AND priority=? AND run_at>?)" in found, found
    else:
        assert "Seq Scan on jobs_job" not in found and "Sort" not in found, found
        assert re.search(r"Index Cond: .*run_at > statement_timestamp\(\)", found), found


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_an_idle_worker_whose_look_up_fails_sleeps_one_poll_and_looks_again() -> None:
    """The look-up's connection killed under it (a failover, a pooler dropping it): the
    idle worker neither crashes nor sleeps longer than one poll, and once the connection
    is replaced it finds the delayed job's time again."""
    from jobs.worker import WorkerProcess

    worker = WorkerProcess(worker_id="idle-fault", burst=True, poll_seconds=4)
    delayed(2)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    assert worker._idle_wait() == 4.0
    connection.close()  # what the worker's next claim does after an outage
    assert worker._idle_wait() == pytest.approx(2, abs=1.5)
