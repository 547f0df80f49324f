"""Jobs per lane and state, the one source of ``queue_status`` and ``holdfast_jobs``.

Queued (delayed ones included) and running jobs are counted from their rows through the
``(state, lane, kind)`` index: only the active set is read. Finished jobs (succeeded, dead,
cancelled) are read from two small tables that every transition into or out of a finished
state adjusts in its own transaction, each at the statement that makes it:

* ``jobs_outcomecount``: attempts that end, by the job's state after them: settle
  (``jobs.sql``: succeeded, dead, cancelled) and reclaim of a spent or cancelled job. It
  is also the metrics' attempt counter, so an attempt costs one counter write, not two;
* ``jobs_jobcount``: the rest: cancel of a queued job (into ``cancelled``), requeue of a
  dead job (``jobs.operations``) and pruning (``jobs.retention``, out of one).

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
from .models import ACTIVE, FINISHED_STATES, Job, JobCount, OutcomeCount


def active() -> QuerySet[Job, tuple[str, str, int]]:
    """(lane, state, count) of queued and running jobs, through the (state, lane, kind)
    index."""
    return (
        Job.objects.filter(ACTIVE).values_list("lane", "state").annotate(n=Count("id")).order_by()
    )


def finished() -> dict[tuple[str, str], int]:
    """(lane, state) → count of succeeded, dead and cancelled jobs, from their counts."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for lane, state, n in (*ended_attempts(), *other_transitions()):
        counts[(lane, state)] += n
    return counts


def ended_attempts() -> QuerySet[OutcomeCount, tuple[str, str, int]]:
    """(lane, state, count) of attempts that left their job in a finished state."""
    return (
        OutcomeCount.objects.filter(state__in=FINISHED_STATES)
        .values_list("lane", "state")
        .annotate(n=Sum("count"))
        .order_by()
    )


def other_transitions() -> QuerySet[JobCount, tuple[str, str, int]]:
    """(lane, state, count): the finished jobs' other ins and outs (see the module)."""
    return JobCount.objects.values_list("lane", "state").annotate(n=Sum("count")).order_by()


def by_lane() -> dict[tuple[str, str], int]:
    """(lane, state) → jobs in that state now, for every pair that has any.

    One statement (``UNION ALL`` of the three parts), so one snapshot: read in three, a
    job settling between them was counted both running and succeeded, and one requeued
    between them in no state at all."""
    counts: dict[tuple[str, str], int] = defaultdict(int)
    parts = active().union(ended_attempts(), other_transitions(), all=True)
    for lane, state, n in parts:
        counts[(lane, state)] += n
    return {key: n for key, n in sorted(counts.items()) if n}


def recount() -> dict[tuple[str, str], int]:
    """Rebuild the finished jobs' counts from ``jobs_job`` (one scan of the table) and
    return them. ``jobs_outcomecount`` is the metrics' attempt counter too, so it is kept:
    ``jobs_jobcount`` becomes what the rows hold beyond it. Safe while workers run: on
    PostgreSQL both tables are locked against writers first, so a transition either is in
    the scan or adds to the counts after it (SQLite serializes every writer anyway)."""
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
        counted = finished()  # now only the ended attempts
        corrections = {
            key: found.get(key, 0) - counted.get(key, 0) for key in sorted({*found, *counted})
        }
        JobCount.objects.bulk_create(
            JobCount(lane=lane, state=state, shard=0, count=n)
            for (lane, state), n in corrections.items()
            if n
        )
    return found
