"""The queue's figures for operators: ``queue_status`` and the API's ``queue/``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db.models import Min, Q

from . import counts, engine, scheduler
from .models import Job, State, Worker
from .serialization import timestamp

STALE_WORKER_FLOOR_SECONDS = 30.0


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
    stale_after = max(STALE_WORKER_FLOOR_SECONDS, float(settings.HOLDFAST_LEASE_SECONDS))
    workers = [
        {
            "id": worker.pk,
            "host": worker.host,
            "pid": worker.pid,
            "lanes": worker.lanes or None,  # None: every lane
            "current_job": worker.current_job,
            "heartbeat_at": timestamp(worker.heartbeat_at),
            "stale": (now - worker.heartbeat_at).total_seconds() > stale_after,
        }
        for worker in Worker.objects.filter(stopped_at__isnull=True).order_by("pk")
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
        **{name: section.figures() for name, section in SECTIONS.items()},
    }


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
