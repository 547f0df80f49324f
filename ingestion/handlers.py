"""The ingestion side's job kinds."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from jobs.context import JobContext
from jobs.registry import handler

from . import artifacts, discovery, search
from .spool import Spool, drain

INGEST_SPOOL = "ingestion.ingest_spool"


@handler(INGEST_SPOOL, max_attempts=5, unique=True)
def ingest_spool(ctx: JobContext, *, spool: str | None = None) -> dict[str, Any]:
    """Drain the spool once, in this process, by the same rules as ``ingest_submissions``.

    Stuck work (the database refusing every batch) raises, so the job retries with backoff
    and ends up dead, visible to operators, with every file still in the spool. A cancel
    request or a lost lease stops the drain at its next file: once the lease is gone the
    job runs again elsewhere, and two drains of one spool would race for every file.
    """
    root = Spool.from_settings(spool)
    stuck_after = float(getattr(settings, "HOLDFAST_SPOOL_STUCK_SECONDS", 300))
    progress = drain(
        root,
        stuck_after=stuck_after,
        should_stop=lambda: ctx.cancel_requested or ctx.lease_lost,
    )
    return progress.as_dict(pending=len(root.pending()))


@handler(search.INDEX_ARTIFACT, max_attempts=5)
def index_artifact(ctx: JobContext, *, artifact_id: int) -> dict[str, Any]:
    """Index the artifact's current body for full-text search (ingestion/search.py).

    Enqueued by the fetch whenever a body changed; running it twice is harmless.
    """
    return search.index_artifact(ctx, artifact_id)


@handler(
    artifacts.FETCH_KIND,
    max_attempts=8,
    locks=lambda args: [f"artifact:{args['artifact_id']}"],
)
def fetch_artifact(ctx: JobContext, *, artifact_id: int) -> dict[str, Any]:
    """Fetch one artifact (conditional GET) and record the outcome; see ingestion.artifacts."""
    return artifacts.fetch(ctx, artifact_id)


@handler(
    discovery.DISCOVER_KIND,
    max_attempts=8,
    locks=lambda args: [f"source:{args['source']}"],
)
def discover_source(ctx: JobContext, *, source: str, run: int | None = None) -> dict[str, Any]:
    """Read up to ``max_pages_per_run`` listing pages of a source; see ingestion.discovery.

    Without ``run`` it starts a run (or resumes one whose job died); continuations name
    their run. The lock keeps two discoveries of one source from running at once.
    """
    return discovery.discover(ctx, source, run)
