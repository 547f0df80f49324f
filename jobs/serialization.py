"""The JSON shapes of jobs and attempts (DESIGN §8), shared by the commands and the API."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from . import attempts, engine
from .events import job_events
from .models import Job, JobEvent, Lease
from .registry import TASK_KIND


def timestamp(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def task_path(job: Job) -> str | None:
    """A Django task's function path (its jobs are all of kind ``django.task``), else None."""
    if job.kind == TASK_KIND and isinstance(job.args, dict):
        path = job.args.get("task")
        return path if isinstance(path, str) else None
    return None


def job_dict(job: Job) -> dict[str, Any]:
    return {
        "id": job.pk,
        "kind": job.kind,
        "task": task_path(job),
        "lane": job.lane,
        "state": job.state,
        "args": job.args,
        "priority": job.priority,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "lease_token": job.lease_token,
        "leased_by": job.leased_by,
        "lease_expires_at": timestamp(job.lease_expires_at),
        "run_at": timestamp(job.run_at),
        "unique_key": job.unique_key,
        "declared_locks": job.locks,
        "cancel_requested": job.cancel_requested,
        "progress": job.progress,
        "result": job.result,
        "created_at": timestamp(job.created_at),
        "started_at": timestamp(job.started_at),
        "finished_at": timestamp(job.finished_at),
        "last_error": job.last_error or None,
    }


def lease_dict(lease: Lease) -> dict[str, Any]:
    return {
        "attempt": lease.attempt,
        "lease_token": lease.lease_token,
        "worker_id": lease.worker_id,
        "acquired_at": timestamp(lease.acquired_at),
        "expires_at": timestamp(lease.expires_at),
        "released_at": timestamp(lease.released_at),
        "outcome": lease.outcome,
        "error_class": lease.error_class or None,
        "error_message": lease.error_message or None,
        "traceback": lease.traceback or None,
        "context": lease.context,
    }


def event_dict(event: JobEvent) -> dict[str, Any]:
    return {
        "at": timestamp(event.at),
        "event": event.event,
        "lease_token": event.lease_token,
        "worker_id": event.worker_id or None,
        "data": event.data,
    }


def job_detail_dict(job: Job) -> dict[str, Any]:
    """A job with its attempts, the resource locks it holds now (or, queued, the one it
    waits for), and its event log."""
    data = job_dict(job)
    leases = attempts.leases(job)
    data["leases"] = [lease_dict(lease) for lease in leases]
    data["locks"] = list(engine.held_locks(job.pk).values_list("resource", flat=True))
    data["events"] = [event_dict(event) for event in job_events(job, leases)]
    # A queued job a claim found blocked: the held resource lock it waits for.
    data["waiting_for"] = job.blocked_by if job.state == "queued" else None
    return data
