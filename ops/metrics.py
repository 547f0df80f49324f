"""Prometheus metrics of the internal API's ``metrics/`` (DESIGN §9), read from the database.

Every figure is computed at scrape time from rows, so any API process (a fresh one too)
reports the same values, and the counters only grow across restarts and job pruning:

* ``holdfast_job_attempts_total{kind,outcome}`` and the ``holdfast_job_duration_seconds{kind}``
  histogram come from ``jobs_outcomecount``, which the settle statement (and reclaim) add
  to in the statement that records each attempt's outcome. Pruning never touches it.
* ``holdfast_jobs{lane,state}`` comes from ``jobs.counts``, as ``queue_status``'s counts
  do: queued (delayed ones included) and running jobs counted from their rows, finished
  ones (succeeded, dead, cancelled) from the counter tables, which every transition into
  or out of a finished state (pruning included) adjusts in its own transaction.

A scrape reads only indexed, bounded sets (active jobs, workers, schedules, counter rows,
issues), never the finished history, so its cost does not grow with the size of
``jobs_job``.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from django.db.models import Count, Min, Q, QuerySet, Sum
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from ingestion.spool import Spool
from jobs import counts as job_counts
from jobs import engine
from jobs import lanes as lane_config
from jobs.models import (
    DURATION_BUCKETS,
    Job,
    Outcome,
    OutcomeCount,
    Schedule,
    State,
    Worker,
)
from jobs.status import worker_liveness

from .models import AuthRefusal

#: Attempts whose duration the histogram records: those the handler itself ended.
TIMED_OUTCOMES = (Outcome.SUCCEEDED, Outcome.FAILED, Outcome.CANCELLED)
#: Every metric this module exports (the dashboard and alert tests check against it).
METRIC_NAMES = (
    "holdfast_jobs",
    "holdfast_queue_oldest_age_seconds",
    "holdfast_workers",
    "holdfast_job_attempts_total",
    "holdfast_job_duration_seconds",
    "holdfast_schedule_lag_seconds",
    "holdfast_spool_files",
    "holdfast_spool_oldest_age_seconds",
    "holdfast_reconciliation_issues",
    "holdfast_api_auth_refusals_total",
)


def worker_counts() -> dict[str, Any]:
    """Registered workers not stopped, by status: ``live`` or ``gone``, by the one rule
    (``jobs.status.worker_liveness``) that queue_status and health/ follow too."""
    liveness = worker_liveness()
    counts = Worker.objects.filter(stopped_at__isnull=True).aggregate(
        live=Count("pk", filter=Q(heartbeat_at__gte=liveness.cutoff)),
        gone=Count("pk", filter=Q(heartbeat_at__lt=liveness.cutoff)),
    )
    return {"live": counts["live"], "gone": counts["gone"], "stale_after_s": liveness.stale_after}


def spool_files() -> tuple[dict[str, int], float]:
    """Submissions waiting in ``incoming/`` and quarantined in ``failed/``, and the age in
    seconds of the oldest one waiting, from its arrival (0: none), as ``Spool.backlog``
    and the grace alert measure it."""
    spool = Spool.from_settings()
    backlog = spool.backlog()
    failed = 0
    try:
        with os.scandir(spool.failed) as entries:
            failed = sum(
                entry.name.endswith(".json") and not entry.name.endswith(".reason.json")
                for entry in entries
            )
    except (FileNotFoundError, NotADirectoryError):
        pass
    found = {"incoming": backlog["pending"] or 0, "failed": failed}
    return found, backlog["oldest_age_s"] or 0.0


def oldest_runnable(now: Any) -> QuerySet[Job, tuple[str, Any]]:
    """(lane, oldest run_at) of due queued jobs (blocked ones included), through an index
    of the active rows (job_state_idx), never the finished history: it reads every queued
    row (delayed ones too), so its cost follows the backlog (docs/operations.md)."""
    return (
        Job.objects.filter(state=State.QUEUED, run_at__lte=now)
        .values_list("lane")
        .annotate(oldest=Min("run_at"))
        .order_by()
    )


class HoldfastCollector(Collector):
    """Reads every figure from the database (and the spool directory) on each scrape."""

    def collect(self) -> Iterator[Metric]:
        now = engine.db_now()
        yield from self._jobs(now)
        yield from self._attempts()
        workers = worker_counts()
        gauge = GaugeMetricFamily(
            "holdfast_workers",
            "Registered worker processes by status (gone: no heartbeat within max(30s, lease))",
            labels=["status"],
        )
        for status in ("live", "gone"):
            gauge.add_metric([status], workers[status])
        yield gauge
        lag = GaugeMetricFamily(
            "holdfast_schedule_lag_seconds",
            "How far each active schedule's next slot is behind (0: on time)",
            labels=["schedule"],
        )
        for name, due in Schedule.objects.filter(declared=True, paused=False).values_list(
            "name", "next_due_at"
        ):
            lag.add_metric([name], max(0.0, (now - due).total_seconds()))
        yield lag
        spool = GaugeMetricFamily(
            "holdfast_spool_files", "Spool submissions by directory", labels=["state"]
        )
        files, oldest_age = spool_files()
        for state, count in files.items():
            spool.add_metric([state], count)
        yield spool
        yield GaugeMetricFamily(
            "holdfast_spool_oldest_age_seconds",
            "Age of the oldest submission waiting in incoming/ (0: none)",
            value=oldest_age,
        )
        yield self._issues()
        yield self._refusals()

    def _jobs(self, now: Any) -> Iterator[Metric]:
        known = set(lane_config.lanes())
        counts = job_counts.by_lane()
        known.update(lane for lane, _ in counts)
        jobs = GaugeMetricFamily(
            "holdfast_jobs",
            "Jobs by lane and state (queued includes delayed jobs), as queue_status counts them",
            labels=["lane", "state"],
        )
        for lane in sorted(known):
            for state in State:
                jobs.add_metric([lane, state.value], counts.get((lane, state.value), 0))
        yield jobs
        oldest = dict(oldest_runnable(now))
        age = GaugeMetricFamily(
            "holdfast_queue_oldest_age_seconds",
            "Age of the oldest runnable queued job per lane (0: none waiting)",
            labels=["lane"],
        )
        for lane in sorted(known):
            since = oldest.get(lane)
            age.add_metric([lane], max(0.0, (now - since).total_seconds()) if since else 0.0)
        yield age

    def _attempts(self) -> Iterator[Metric]:
        rows = (
            OutcomeCount.objects.values_list("kind", "outcome", "bucket")
            .annotate(n=Sum("count"), s=Sum("seconds"))
            .order_by()
        )
        attempts: dict[tuple[str, str], int] = defaultdict(int)
        buckets: dict[str, list[int]] = defaultdict(lambda: [0] * (len(DURATION_BUCKETS) + 1))
        seconds: dict[str, float] = defaultdict(float)
        for kind, outcome, bucket, n, s in rows:
            attempts[(kind, outcome)] += n
            if outcome in TIMED_OUTCOMES:
                buckets[kind][min(bucket, len(DURATION_BUCKETS))] += n
                seconds[kind] += s
        total = CounterMetricFamily(
            "holdfast_job_attempts",
            "Attempts ended, by kind and outcome (succeeded, failed, cancelled, released, "
            "lease_expired)",
            labels=["kind", "outcome"],
        )
        for (kind, outcome), n in sorted(attempts.items()):
            total.add_metric([kind, outcome], n)
        yield total
        histogram = HistogramMetricFamily(
            "holdfast_job_duration_seconds",
            "Attempt durations, claim to settle on the database clock (succeeded, failed and "
            "cancelled attempts)",
            labels=["kind"],
        )
        for kind in sorted(buckets):
            cumulative, running = [], 0
            bounds = [str(float(bound)) for bound in DURATION_BUCKETS] + ["+Inf"]
            for bound, n in zip(bounds, buckets[kind], strict=True):
                running += n
                cumulative.append((bound, running))
            histogram.add_metric([kind], cumulative, sum_value=seconds[kind])
        yield histogram

    def _issues(self) -> Metric:
        from ingestion.models import ReconciliationIssue

        issues = GaugeMetricFamily(
            "holdfast_reconciliation_issues",
            "Reconciliation issues by kind and status",
            labels=["kind", "status"],
        )
        for kind, status, n in (
            ReconciliationIssue.objects.values_list("kind", "status")
            .annotate(n=Count("id"))
            .order_by("kind", "status")
        ):
            issues.add_metric([kind, status], n)
        return issues

    def _refusals(self) -> Metric:
        refusals = CounterMetricFamily(
            "holdfast_api_auth_refusals",
            "API requests refused for their token, by reason (malformed, unknown, wrong "
            "secret, revoked, expired, not a bearer token, no token)",
            labels=["reason"],
        )
        for reason, count in AuthRefusal.objects.values_list("reason", "count").order_by("reason"):
            refusals.add_metric([reason], count)
        return refusals


def registry() -> CollectorRegistry:
    """A registry holding only Holdfast's collector (no process or platform metrics: they
    would describe whichever API process answered, not the system)."""
    found = CollectorRegistry(auto_describe=False)
    found.register(HoldfastCollector())
    return found
