"""The ingestion side's job kinds."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from jobs.context import JobContext
from jobs.registry import handler

from .spool import Spool, drain

INGEST_SPOOL = "ingestion.ingest_spool"


@handler(INGEST_SPOOL, max_attempts=5, unique=True)
def ingest_spool(ctx: JobContext, *, spool: str | None = None) -> dict[str, Any]:
    """Drain the spool once, in this process, by the same rules as ``ingest_submissions``.

    Stuck work (the database refusing every batch) raises, so the job retries with backoff
    and ends up dead, visible to operators, with every file still in the spool.
    """
    root = Spool.from_settings(spool)
    stuck_after = float(getattr(settings, "HOLDFAST_SPOOL_STUCK_SECONDS", 60))
    progress = drain(root, stuck_after=stuck_after, should_stop=lambda: ctx.cancel_requested)
    return progress.as_dict(pending=len(root.pending()))
