"""Claim cost stays flat however many finished jobs the table holds (partial indexes)."""

import re

import pytest
from django.db import connection

from jobs import engine
from jobs.models import Job, State
from jobs.sql import PG_CLAIM

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]


def explain(lane_filter: str = "", params: dict | None = None) -> str:
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")
        cursor.execute(
            "EXPLAIN " + PG_CLAIM.format(lane_filter=lane_filter), {"worker": "w", **(params or {})}
        )
        return "\n".join(row[0] for row in cursor.fetchall())


@pytest.mark.parametrize("lanes", [None, ["default"]])
def test_claim_reads_only_runnable_rows_in_claim_order(lanes):
    """With 20,000 finished jobs and a backlog, claim walks a partial index in order."""
    finished = engine.enqueue_many("test.noop", [{} for _ in range(20_000)])
    Job.objects.filter(pk__in=[job.pk for job in finished]).update(state=State.SUCCEEDED)
    engine.enqueue_many("test.noop", [{} for _ in range(3_000)])
    lane_filter = "" if lanes is None else "AND lane = ANY(%(lanes)s)"
    plan = explain(lane_filter, {"lanes": lanes})
    assert "job_claim_idx" in plan or "job_claim_any_lane_idx" in plan, plan
    assert not re.search(r"Seq Scan on jobs_job\b", plan), plan
    assert "Sort" not in plan.split("CTE claimed")[0], plan  # index order, no sort
