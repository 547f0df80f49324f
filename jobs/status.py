"""The queue's figures for operators: ``queue_status`` and the API's ``queue/``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Min, Q

from . import counts, engine, scheduler
from .models import Job, State, Worker
from .serialization import timestamp

STALE_WORKER_FLOOR_SECONDS = 30.0
LIVE, GONE = "live", "gone"


@dataclass(frozen=True)
class Liveness:
    """Whether a worker is ``live`` or ``gone``: the one rule, for queue_status, the API's
    ``queue/`` and ``health/``, and the metrics.

    A worker is gone when its heartbeat (every 5 s while it runs) is older than
    ``stale_after`` seconds: the lease length, at least 30 s. A gone worker's row stays,
    shown as gone, until ``HOLDFAST_WORKER_RETENTION_SECONDS`` prune it.
    """

    stale_after: float
    cutoff: datetime  # heartbeats before this (database clock) are gone

    def status(self, heartbeat_at: datetime) -> str:
        return LIVE if heartbeat_at >= self.cutoff else GONE


def worker_liveness(now: datetime | None = None) -> Liveness:
    """The live/gone rule as of ``now`` (default: the database clock)."""
    stale_after = max(STALE_WORKER_FLOOR_SECONDS, float(settings.HOLDFAST_LEASE_SECONDS))
    now = engine.db_now() if now is None else now
    return Liveness(stale_after, now - timedelta(seconds=stale_after))


@dataclass(frozen=True)
class Section:
    """Figures another app adds to ``queue_status`` under ``name`` (e.g. the spool's)."""

    name: str
    figures: Callable[[], Any]
    render: Callable[[Any], list[str]] | None = None  # lines for the human output


#: Registered by other apps in ``AppConfig.ready()``; ``jobs`` imports none of them.
SECTIONS: dict[str, Section] = {}


def register_section(
    name: str,
    figures: Callable[[], Any],
    render: Callable[[Any], list[str]] | None = None,
) -> None:
    """Add ``figures()`` to every ``queue_status`` (and the API's ``queue/``) as ``name``;
    ``render`` turns them into lines for the human ``queue_status`` output."""
    SECTIONS[name] = Section(name, figures, render)


def queue_status() -> dict[str, Any]:
    now = engine.db_now()
    totals = {state.value: 0 for state in State}
    lanes: dict[str, dict[str, Any]] = {}
    for (name, state), n in counts.by_lane().items():  # the finished history is not scanned
        totals[state] += n
        lanes.setdefault(name, {s.value: 0 for s in State})[state] = n
    oldest = (
        Job.objects.filter(state=State.QUEUED, run_at__lte=now)
        .values("lane")
        .annotate(oldest=Min("run_at"))
        .order_by()
    )
    for lane in lanes.values():
        lane["oldest_queued_age_s"] = None
    for lane_oldest in oldest:
        age = (now - lane_oldest["oldest"]).total_seconds()
        lanes[lane_oldest["lane"]]["oldest_queued_age_s"] = round(age, 3)
    leases = [
        {
            "job_id": job.pk,
            "kind": job.kind,
            "lane": job.lane,
            "worker_id": job.leased_by,
            "lease_token": job.lease_token,
            "expires_at": timestamp(job.lease_expires_at),
            "expired": job.lease_expires_at is not None and job.lease_expires_at < now,
        }
        for job in Job.objects.filter(state=State.RUNNING).order_by("lease_expires_at")[:200]
    ]
    liveness = worker_liveness(now)
    registered = list(Worker.objects.filter(stopped_at__isnull=True).order_by("pk"))
    live = [worker for worker in registered if liveness.status(worker.heartbeat_at) == LIVE]
    workers = [
        {
            "id": worker.pk,
            "host": worker.host,
            "pid": worker.pid,
            "lanes": worker.lanes or None,  # None: every lane
            "kinds": worker.kinds,  # None: not recorded (an older worker)
            "current_job": worker.current_job,
            "heartbeat_at": timestamp(worker.heartbeat_at),
            "status": liveness.status(worker.heartbeat_at),
            "stale": liveness.status(worker.heartbeat_at) != LIVE,  # older name of gone
        }
        for worker in registered
    ]
    return {
        "now": timestamp(now),
        "totals": totals,
        "dead": totals[State.DEAD],
        "lanes": dict(sorted(lanes.items())),
        "live_leases": leases,
        "workers": workers,
        "schedules_overdue": scheduler.overdue(now),
        "delayed": Job.objects.filter(Q(state=State.QUEUED) & Q(run_at__gt=now)).count(),
        "locks_held": engine.held_locks().count(),
        "unserved_kinds": unserved_kinds(live),
        **{name: section.figures() for name, section in SECTIONS.items()},
    }


def unserved_kinds(live_workers: list[Worker]) -> list[dict[str, Any]]:
    """The kinds (per lane) with queued jobs that no live worker serves: no live worker
    has a handler for the kind and serves the lane (``reason`` says which is missing).
    Such jobs wait, uncharged, until one starts (new code enqueued a kind before workers
    that know it were deployed)."""

    def serves_lane(worker: Worker, lane: str) -> bool:
        return not worker.lanes or lane in worker.lanes

    def knows(worker: Worker, kind: str) -> bool:
        return worker.kinds is None or kind in worker.kinds

    def why_unserved(kind: str, lane: str) -> str | None:
        """None if a live worker serves it, else what an operator must start."""
        if any(serves_lane(w, lane) and knows(w, kind) for w in live_workers):
            return None
        if not live_workers:
            return "no worker is live"
        if not any(knows(w, kind) for w in live_workers):
            return "no live worker has a handler for it"
        if not any(serves_lane(w, lane) for w in live_workers):
            return f"no live worker serves lane {lane}"
        return f"the live workers with its handler do not serve lane {lane}"

    queued = (
        Job.objects.filter(state=State.QUEUED)
        .values("kind", "lane")
        .annotate(n=Count("id"), oldest=Min("created_at"))
        .order_by("kind", "lane")
    )
    return [
        {
            "kind": row["kind"],
            "lane": row["lane"],
            "queued": row["n"],
            "oldest_enqueued_at": timestamp(row["oldest"]),
            "reason": reason,
        }
        for row in queued
        if (reason := why_unserved(row["kind"], row["lane"])) is not None
    ]


def render_sections(status: dict[str, Any]) -> list[str]:
    """The registered sections of ``status`` as lines for the human output."""
    lines: list[str] = []
    for name, section in SECTIONS.items():
        if name not in status:
            continue
        if section.render is not None:
            lines += section.render(status[name])
        else:
            lines.append(f"{name}: {status[name]}")
    return lines
