"""The worker registry: one row per worker process, its heartbeat, and pruning of gone ones.

Liveness (live/gone) is read by ``jobs.status.worker_liveness``; the process itself is
``jobs.worker``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from datetime import timedelta

from django.conf import settings
from django.db.models.functions import Now

from . import sql
from .log import get_logger
from .models import Worker

log = get_logger("jobs.workers")

# --- workers ---------------------------------------------------------------------------


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def register_worker(
    worker_id: str, lanes: Sequence[str] | None, kinds: Sequence[str] | None = None
) -> None:
    """Record a starting worker: where it runs, the lanes and the job kinds it serves."""
    Worker.objects.update_or_create(
        pk=worker_id,
        defaults={
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "lanes": list(lanes) if lanes is not None else [],
            "kinds": sorted(kinds) if kinds is not None else None,
            "started_at": Now(),
            "heartbeat_at": Now(),
            "stopped_at": None,
            "current_job": None,
        },
    )
    log.info("worker_started", worker_id=worker_id, lanes=list(lanes) if lanes else "all")
    sql.warn_if_jit()
    sql.analyze_if_never_analyzed()


def worker_heartbeat(worker_id: str, current_job: int | None) -> None:
    Worker.objects.filter(pk=worker_id).update(heartbeat_at=Now(), current_job=current_job)


def worker_stopped(worker_id: str) -> None:
    Worker.objects.filter(pk=worker_id).update(stopped_at=Now(), current_job=None)
    log.info("worker_stopped", worker_id=worker_id)


def prune_workers(retention_seconds: float | None = None, batch: int = 1000) -> int:
    """Delete the rows of workers whose last heartbeat is older than the retention
    (``HOLDFAST_WORKER_RETENTION_SECONDS``; stopped or gone alike), at most ``batch`` per
    call: a bounded read and, when it found rows, a bounded delete; run by every worker's
    reclaimer thread after its reclaim passes."""
    if retention_seconds is None:
        retention_seconds = float(settings.HOLDFAST_WORKER_RETENTION_SECONDS)
    cutoff = Now() - timedelta(seconds=retention_seconds)
    expired = list(
        Worker.objects.filter(heartbeat_at__lt=cutoff)
        .order_by("heartbeat_at")
        .values_list("pk", flat=True)[:batch]
    )
    if not expired:
        return 0  # the usual pass: one read, no write (and no SQLite write lock)
    deleted, _ = Worker.objects.filter(pk__in=expired, heartbeat_at__lt=cutoff).delete()
    if deleted:
        log.info("workers_pruned", count=deleted, retention_s=retention_seconds)
    return deleted
