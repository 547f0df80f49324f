"""Jobs per lane and state, the one source of ``queue_status`` and ``holdfast_jobs``.

Queued (delayed ones included) and running jobs are counted from their rows through the
``(state, lane, kind)`` index: only the active set is read. Finished jobs (succeeded, dead,
cancelled) are read from ``jobs_jobcount``, which every transition into or out of a
finished state adjusts in its own transaction, each at the statement that makes it:

* into one: settle (``jobs.sql``: succeeded, dead, cancelled), reclaim of a spent job
  (dead) and cancel of a queued job (cancelled), in ``jobs.engine``;
* out of one: requeue of a dead job (``jobs.engine``) and pruning (``jobs.retention``).

So neither reader scans the finished history, and both report exactly what
``SELECT lane, state, count(*) FROM jobs_job GROUP BY 1, 2`` would. Only a change made
around the engine (SQL by hand, an old worker still running during an upgrade) can put
the two apart; ``recount()`` (``manage.py recount_jobs``) rebuilds the counts from the rows.
"""

from __future__ import annotations

from collections import defaultdict

from django.db import transaction
from django.db.models import Count, QuerySet, Sum

from . import sql
from .models import ACTIVE_STATES, FINISHED_STATES, Job, JobCount


def active() -> QuerySet[Job, tuple[str, str, int]]:
    """(lane, state, count) of queued and running jobs, through the (state, lane, kind)
    index."""
    return (
        Job.objects.filter(state__in=ACTIVE_STATES)
        .values_list("lane", "state")
        .annotate(n=Count("id"))
        .order_by()
    )


def finished() -> QuerySet[JobCount, tuple[str, str, int]]:
    """(lane, state, count) of succeeded, dead and cancelled jobs, from their counts."""
    return JobCount.objects.values_list("lane", "state").annotate(n=Sum("count")).order_by()


def by_lane() -> dict[tuple[str, str], int]:
    """(lane, state) → jobs in that state now, for every pair that has any."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for lane, state, n in (*active(), *finished()):
        counts[(lane, state)] += n
    return {key: n for key, n in sorted(counts.items()) if n}


def recount() -> dict[tuple[str, str], int]:
    """Rebuild the finished jobs' counts from ``jobs_job`` (one scan of the table) and
    return them. Safe while workers run: on PostgreSQL the counts table is locked against
    writers first, so a transition either is in the scan or adds to the new counts after it
    (SQLite serializes every writer anyway)."""
    with transaction.atomic():
        sql.lock_job_counts()
        JobCount.objects.all().delete()
        found = {
            (lane, state): n
            for lane, state, n in Job.objects.filter(state__in=FINISHED_STATES)
            .values_list("lane", "state")
            .annotate(n=Count("id"))
            .order_by("lane", "state")
        }
        JobCount.objects.bulk_create(
            JobCount(lane=lane, state=state, shard=0, count=n) for (lane, state), n in found.items()
        )
    return found
