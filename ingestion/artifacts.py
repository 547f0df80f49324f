"""Artifacts: fetching a discovered document, refreshing it, and what its fetches reveal.

One fetch is one conditional GET (``If-None-Match`` / ``If-Modified-Since`` from the last
good fetch) through the polite client, and its outcome decides everything else:

=====================  ==============================================================
200 (2xx)              body kept in the blob store by sha256; a new hash enqueues
                       indexing, and one that changed while the listed ``lastmod`` did
                       not opens ``content_changed_unannounced``
304, or the same hash  unchanged: only ``fetched_at`` and ``refresh_after`` move
404, 410               ``gone``, with a ``gone_at_source`` issue (the job succeeds)
5xx, 408, 429,         raised, so the engine retries with backoff; on the last attempt
timeouts, connection   the document is kept (body, index entry), the next try is put
                       off with a backoff and ``fetch_failing`` opens; the job succeeds
other 4xx, too large,  never fetched: ``failed``; with a good body: kept, retried with
robots, redirects      the backoff. A ``permanent_fetch_failure`` issue is committed
                       before ``PermanentError`` sends the job to ``dead``
=====================  ==============================================================

Only a 404/410 takes a document out of search. Every artifact write happens in the
job's fenced ``ctx.atomic()``, so a stale attempt never lands one. A good fetch resolves
the artifact's ``gone_at_source``, ``fetch_failing`` and ``permanent_fetch_failure``
issues by itself. Fetches of one artifact never overlap: the
handler holds the resource lock ``artifact:<id>``, and every way in (discovery, the
refresher, ``force_refresh``) enqueues with the unique key ``fetch:<id>``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

from django.db import transaction
from django.db.models import CharField, Exists, OuterRef, QuerySet, Value
from django.db.models.functions import Cast, Concat, Now

from jobs import PermanentError, enqueue, enqueue_many
from jobs.context import JobContext
from jobs.engine import db_now
from jobs.exceptions import HoldfastError, InvalidJob, LaneFull
from jobs.log import get_logger
from jobs.models import HOLDS_ITS_KEY, Job
from jobs.refresh import refresher
from jobs.serialization import timestamp

from . import blobs, discovery, http
from .models import (
    Artifact,
    ArtifactState,
    DiscoveryRun,
    IssueKind,
    IssueStatus,
    ReconciliationIssue,
    Source,
    SourceKind,
)
from .reconciliation import record, record_unless_open, resolve_cleared
from .search import INDEX_ARTIFACT, unindex

log = get_logger("ingestion.artifacts")

FETCH_KIND = "ingestion.fetch_artifact"
REFRESH_BATCH = 100  # the least one refresher run enqueues when that many are due
REFRESH_MAX_BATCH = 20_000  # the most: 66/s at the default 300 s, far above 5M / 28 days
FAILURE_BACKOFF_BASE = timedelta(hours=1)
FAILURE_BACKOFF_MAX = timedelta(days=1)
REFRESH_RETRY = timedelta(days=1)  # when a refresh the refresher enqueued is due again
INDEX_RETRY = timedelta(hours=1)  # when a body a full index lane left unindexed is fetched again
GONE_STATUSES = frozenset({404, 410})
# The 2xx that carry the whole document; a 204 (nothing) or a 206 nobody asked for (a part)
# must never replace a good body: any other answer fails the fetch, keeping what is kept.
FULL_BODY_STATUSES = frozenset({200, 203})
RETRY_STATUSES = frozenset({408, 429})  # 4xx that say "later", not "never"
# A Retry-After up to this is waited out by the retry (the source's next turn moves); a
# longer one puts the fetch off (``deferred``): no worker sleeps for it.
RETRY_AFTER_WAIT_MAX = 60.0
DEFERRALS_BEFORE_ISSUE = 3  # long pauses asked for in a row before a fetch_failing issue
IDS_PER_QUERY = 1000  # keeps ``pk IN (…)`` under SQLite's bound-parameter limit


class RetryableStatus(HoldfastError):
    """The source answered 5xx (or 408/429): the engine retries the fetch with backoff."""


def fetch_key(artifact_id: int) -> str:
    return f"fetch:{artifact_id}"


def index_key(artifact_id: int, sha256: str) -> str:
    return f"index:{artifact_id}:{sha256}"


# --- the fetch -------------------------------------------------------------------------


def fetch(ctx: JobContext, artifact_id: int) -> dict[str, Any]:
    """The body of ``ingestion.fetch_artifact``: fetch once and record what came back."""
    try:
        artifact = Artifact.objects.select_related("source").get(pk=artifact_id)
    except Artifact.DoesNotExist:
        raise PermanentError(f"no artifact with id {artifact_id}") from None
    if not artifact.source.enabled:
        result = {"artifact_id": artifact_id, "outcome": "skipped"}
        with ctx.atomic(complete=True, result=result):
            log.info("artifact_fetch_skipped", artifact_id=artifact_id, reason="source disabled")
        return result
    try:
        response = http.get(artifact.source, artifact.url, headers=conditional_headers(artifact))
    except http.FetchError as exc:
        if exc.transient:
            return retry_later(ctx, artifact, exc)
        fail(ctx, artifact, f"{type(exc).__name__}: {exc}", error=type(exc).__name__)
    status = response.status
    if status == 304 and artifact.sha256:
        return unchanged(ctx, artifact, response)
    if status in FULL_BODY_STATUSES:
        return stored(ctx, artifact, response)
    if status in GONE_STATUSES:
        return gone(ctx, artifact, response)
    if status >= 500 or status in RETRY_STATUSES:
        pause = http.retry_after(response)
        if pause is not None and pause > RETRY_AFTER_WAIT_MAX:
            return deferred(ctx, artifact, status, pause)
        if pause is not None:
            http.hold_off(artifact.source, pause)  # the retry waits its turn till then
        return retry_later(
            ctx,
            artifact,
            RetryableStatus(f"{artifact.url} answered HTTP {status}"),
            http_status=status,
        )
    fail(ctx, artifact, f"HTTP {status}", http_status=status)


def retry_later(
    ctx: JobContext, artifact: Artifact, error: Exception, http_status: int | None = None
) -> dict[str, Any]:
    """Raise ``error`` so the engine retries; on the last attempt, put the fetch off.

    A transient failure never costs a document: once the job's retries run out (about
    ten minutes of errors), the last good body and its index entry stay, the next try is
    pushed back (:func:`failure_backoff`), and a ``fetch_failing`` issue says so until a
    fetch succeeds again, which resolves it. The job itself succeeds: its outcome is
    recorded, and dead jobs would only pile up for as long as the site is down.
    """
    reason = f"{type(error).__name__}: {error}"
    if ctx.attempt >= ctx.max_attempts:
        return failing(ctx, artifact, reason, http_status)
    with ctx.atomic():
        Artifact.objects.filter(pk=artifact.pk).update(last_error=reason[:10_000])
    log.info("artifact_fetch_retry", artifact_id=artifact.pk, attempt=ctx.attempt, error=reason)
    raise error


def deferred(ctx: JobContext, artifact: Artifact, status: int, pause: float) -> dict[str, Any]:
    """A 429 or 503 asking for a long pause (``Retry-After``): the fetch is put off until
    then, as the site asked, instead of retried within minutes. Nothing is lost (the body
    and its index entry stay); the refresher enqueues it once due. The job succeeds.

    A deferral counts as a failing fetch (``failures``): a site that asks for a pause every
    time (up to a day each) was deferred for ever with nothing to show for it; from the
    :data:`DEFERRALS_BEFORE_ISSUE`-th in a row a ``fetch_failing`` issue says so, resolved
    by the next fetch that succeeds."""
    reason = f"HTTP {status}: the site asked for a pause of {pause:g} s (Retry-After)"
    result = outcome(artifact, "deferred", status, retry_after=pause)
    with ctx.atomic(complete=True, result=result):
        current = locked(artifact.pk)
        failures = current.failures + 1
        retry_at = db_now() + timedelta(seconds=pause)
        Artifact.objects.filter(pk=current.pk).update(
            failures=failures, refresh_after=retry_at, last_error=reason
        )
        result["retry_at"] = timestamp(retry_at)
        if failures >= DEFERRALS_BEFORE_ISSUE:
            record_unless_open(
                IssueKind.FETCH_FAILING,
                current.url,
                current.source.name,
                issue_details(
                    ctx,
                    current,
                    http_status=status,
                    reason=f"{reason}, {failures} times in a row",
                    deferrals=failures,
                    kept_sha256=current.sha256 or None,
                ),
            )
    log.warning("artifact_fetch_deferred", source=artifact.source.name, **result)
    return result


def failure_backoff(failures: int) -> timedelta:
    """How long after its ``failures``-th failing fetch in a row an artifact is tried again:
    an hour, doubling each time, at most :data:`FAILURE_BACKOFF_MAX`."""
    return min(FAILURE_BACKOFF_BASE * 2 ** min(max(failures - 1, 0), 16), FAILURE_BACKOFF_MAX)


def failing(
    ctx: JobContext, artifact: Artifact, reason: str, http_status: int | None
) -> dict[str, Any]:
    """The fetch's retries ran out on transient errors: keep everything, try again later."""
    result = outcome(artifact, "failing", http_status or 0, reason=reason)
    with ctx.atomic(complete=True, result=result):
        current = locked(artifact.pk)
        failures = current.failures + 1
        retry_at = db_now() + failure_backoff(failures)
        Artifact.objects.filter(pk=current.pk).update(
            failures=failures, refresh_after=retry_at, last_error=reason[:10_000]
        )
        record_unless_open(
            IssueKind.FETCH_FAILING,
            current.url,
            current.source.name,
            issue_details(
                ctx,
                current,
                http_status=http_status,
                reason=reason,
                attempts=ctx.attempt,
                kept_sha256=current.sha256 or None,
            ),
        )
        result.update(failures=failures, retry_at=timestamp(retry_at))
    log.warning(
        "artifact_fetch_failing",
        artifact_id=artifact.pk,
        source=artifact.source.name,
        failures=failures,
        reason=reason,
    )
    return result


def conditional_headers(artifact: Artifact) -> dict[str, str]:
    """Validators of the last good fetch; none when there is no body to fall back on."""
    if not artifact.sha256 or not blobs.exists(artifact.sha256):
        return {}
    headers = {}
    if sendable(artifact.etag):
        headers["If-None-Match"] = artifact.etag
    if sendable(artifact.last_modified):
        headers["If-Modified-Since"] = artifact.last_modified
    return headers


def sendable(value: str) -> bool:
    """Whether a stored validator can go back in a request header: printable ASCII only.

    A server may send other bytes (httpx reads them as UTF-8 or Latin-1); sent back, they
    could not be encoded, and every later refresh of the artifact would fail the same way.
    Such a validator is not stored, and one stored before is not sent: a plain GET then.
    """
    return bool(value) and value.isascii() and value.isprintable()


def stored(ctx: JobContext, artifact: Artifact, response: http.Response) -> dict[str, Any]:
    """A body arrived: keep it, and re-index it if its hash is new."""
    try:
        digest = blobs.store(response.body)  # before the transaction; storing twice is harmless
    except OSError as exc:  # a full disk, a store gone read-only: ours, and transient
        log.error("blob_store_failed", artifact_id=artifact.pk, error=f"{exc}")
        return retry_later(ctx, artifact, exc)
    previous = artifact.sha256
    if digest == previous:
        return unchanged(ctx, artifact, response, **validators(response))
    result = outcome(artifact, "stored", response.status, sha256=digest, previous=previous)
    with ctx.atomic(complete=True, result=result):
        current = locked(artifact.pk)
        announced_before = lastmod_of(current.fetched_lastmod)
        mark_fetched(
            ctx,
            artifact,
            current,
            response,
            sha256=digest,
            size=len(response.body),
            **validators(response),
        )
        enqueue_index(current.pk, digest)
        # Unannounced only if the listing showed the same known lastmod at the last fetch,
        # when this fetch began, and now: a lastmod that moved while the fetch was in
        # flight announced a change, even if this body predates it.
        listed = {lastmod_of(artifact.lastmod), lastmod_of(current.lastmod)}
        unannounced = bool(previous and announced_before) and listed == {announced_before}
        if unannounced:
            record_unless_open(
                IssueKind.CONTENT_CHANGED_UNANNOUNCED,
                current.url,
                current.source.name,
                issue_details(
                    ctx,
                    current,
                    http_status=response.status,
                    old_sha256=previous,
                    new_sha256=digest,
                    lastmod=current.lastmod,
                ),
            )
    log.info("artifact_fetched", **result, source=artifact.source.name, unannounced=unannounced)
    return result


def unchanged(
    ctx: JobContext, artifact: Artifact, response: http.Response, **fresh: str
) -> dict[str, Any]:
    """304, or the same bytes again: the body stands; only the refresh clock moves.

    ``fresh`` validators come with a 200 of the same bytes, for the next conditional GET.
    """
    result = outcome(artifact, "unchanged", response.status, sha256=artifact.sha256)
    with ctx.atomic(complete=True, result=result):
        current = locked(artifact.pk)
        mark_fetched(ctx, artifact, current, response, **fresh)
        if current.state != ArtifactState.FETCHED or current.indexed_sha256 != current.sha256:
            enqueue_index(current.pk, current.sha256)  # back from gone, or never indexed
    log.info("artifact_unchanged", **result, source=artifact.source.name)
    return result


def mark_fetched(
    ctx: JobContext, started: Artifact, current: Artifact, response: http.Response, **body: Any
) -> None:
    """Record a good fetch of ``current`` (locked): the clock, the listed lastmod, issues.

    ``fetched_lastmod`` keeps the ``lastmod`` the listing showed when this fetch *began*
    (``started`` was read then): that is the one this body belongs to. If discovery listed
    a newer one while the request was in flight, the body may predate it, so the artifact
    is due again at once rather than in ``refresh_days``.
    """
    now = db_now()
    moved = lastmod_of(current.lastmod) != lastmod_of(started.lastmod)
    Artifact.objects.filter(pk=current.pk).update(
        state=ArtifactState.FETCHED,
        http_status=response.status,
        fetched_lastmod=started.lastmod,
        fetched_at=now,
        refresh_after=now if moved else now + timedelta(days=current.source.refresh_days),
        last_error="",
        failures=0,
        **body,
    )
    if moved:
        log.info(
            "artifact_lastmod_moved_in_flight", artifact_id=current.pk, lastmod=current.lastmod
        )
    condition = f"fetched again with HTTP {response.status} by job {ctx.job_id}"
    for kind in (
        IssueKind.GONE_AT_SOURCE,
        IssueKind.PERMANENT_FETCH_FAILURE,
        IssueKind.FETCH_FAILING,
    ):
        resolve_cleared(kind, current.source.name, [current.url], condition)


def lastmod_of(value: str) -> str:
    """A listed lastmod in its canonical form, "" when unknown (see discovery.lastmod)."""
    return discovery.normalize_lastmod(value)


def validators(response: http.Response) -> dict[str, str]:
    """What a 200 says about its body: type, and the validators of the next conditional GET."""
    etag = response.headers.get("etag", "")
    last_modified = response.headers.get("last-modified", "")
    return {
        "content_type": response.headers.get("content-type", "")[:200],
        # A cut validator would never match; one that cannot be sent back is no validator.
        "etag": etag if sendable(etag) and len(etag) <= 500 else "",
        "last_modified": last_modified
        if sendable(last_modified) and len(last_modified) <= 100
        else "",
    }


def enqueue_index(artifact_id: int, sha256: str) -> None:
    """Have the search side index this body; one job per (artifact, body).

    Inside the fetch's completing transaction. A full index lane (``drop``, or ``reject``:
    ``LaneFull``, caught in a savepoint) must cost neither the fetch (refused, its commit
    rolled back and the body was downloaded again, attempt after attempt) nor the index
    (dropped, the new body went unindexed until the next refresh, weeks later): the
    artifact is due again in :data:`INDEX_RETRY`, and that refresh, finding the body
    unindexed, enqueues its index job again.
    """
    try:
        with transaction.atomic():
            job = enqueue(
                INDEX_ARTIFACT,
                {"artifact_id": artifact_id},
                unique_key=index_key(artifact_id, sha256),
            )
    except LaneFull:
        job = None
    if job is None:
        Artifact.objects.filter(pk=artifact_id).update(refresh_after=db_now() + INDEX_RETRY)
        log.warning("artifact_index_deferred", artifact_id=artifact_id, sha256=sha256)


def gone(ctx: JobContext, artifact: Artifact, response: http.Response) -> dict[str, Any]:
    """404 or 410: the source no longer has it. Not an error of the job, so it succeeds."""
    result = outcome(artifact, "gone", response.status)
    with ctx.atomic(complete=True, result=result):
        Artifact.objects.filter(pk=artifact.pk).update(
            state=ArtifactState.GONE,
            http_status=response.status,
            refresh_after=None,
            last_error=f"HTTP {response.status} at the source",
        )
        unindex(artifact.pk)
        record_unless_open(
            IssueKind.GONE_AT_SOURCE,
            artifact.url,
            artifact.source.name,
            issue_details(ctx, artifact, http_status=response.status, sha256=artifact.sha256),
        )
    log.warning("artifact_gone", **result, source=artifact.source.name)
    return result


def fail(
    ctx: JobContext,
    artifact: Artifact,
    reason: str,
    *,
    http_status: int | None = None,
    **extra: Any,
) -> NoReturn:
    """Retrying cannot help: open an issue, then go ``dead``.

    An artifact never fetched becomes ``failed`` (discovery fetches it again while its
    source lists it). One with a good body keeps it, and its index entry: only a 404/410
    says a document is gone. It stays ``fetched`` and is tried again with the failure
    backoff. The issue commits in its own fenced transaction before ``PermanentError`` is
    raised, so the operator sees why the job died even though the job itself fails.
    """
    with ctx.atomic():
        current = locked(artifact.pk)
        if current.state == ArtifactState.FETCHED and current.sha256:
            failures = current.failures + 1
            Artifact.objects.filter(pk=artifact.pk).update(
                failures=failures,
                refresh_after=db_now() + failure_backoff(failures),
                last_error=reason[:10_000],
            )
        else:
            Artifact.objects.filter(pk=artifact.pk).update(
                state=ArtifactState.FAILED,
                http_status=http_status,
                refresh_after=None,
                last_error=reason[:10_000],
            )
            unindex(artifact.pk)
        record_unless_open(
            IssueKind.PERMANENT_FETCH_FAILURE,
            artifact.url,
            artifact.source.name,
            issue_details(ctx, artifact, http_status=http_status, reason=reason, **extra),
        )
    log.warning(
        "artifact_failed", artifact_id=artifact.pk, source=artifact.source.name, reason=reason
    )
    raise PermanentError(f"{artifact.url}: {reason}")


def locked(artifact_id: int) -> Artifact:
    """The artifact as it is now (discovery may have listed a new ``lastmod``), locked."""
    return (
        Artifact.objects.select_for_update(of=("self",))
        .select_related("source")
        .get(pk=artifact_id)
    )


def outcome(artifact: Artifact, what: str, status: int, **fields: Any) -> dict[str, Any]:
    return {"artifact_id": artifact.pk, "outcome": what, "http_status": status, **fields}


def issue_details(ctx: JobContext, artifact: Artifact, **fields: Any) -> dict[str, Any]:
    return {"artifact_id": artifact.pk, "job_id": ctx.job_id, **fields}


# --- enqueueing fetches: discovery, the refresher, force_refresh ------------------------


def without_active_fetch(artifacts: QuerySet[Artifact]) -> QuerySet[Artifact]:
    """``artifacts`` minus those whose fetch job is already queued or running."""
    active = Job.objects.filter(
        HOLDS_ITS_KEY, unique_key=Concat(Value("fetch:"), Cast(OuterRef("pk"), CharField()))
    )
    return artifacts.exclude(Exists(active))


def enqueue_fetches(artifacts: QuerySet[Artifact], limit: int | None = None) -> list[int]:
    """Enqueue a fetch for each artifact (at most ``limit``) not already being fetched.

    Returns the ids of the artifacts that got a job (none when the lane dropped them).
    """
    ids = list(without_active_fetch(artifacts).values_list("pk", flat=True)[:limit])
    return ids if fetch_jobs(ids) else []


def force_fetches(selected: QuerySet[Artifact]) -> tuple[list[int], bool]:
    """Enqueue a fetch of each of ``selected`` not already being fetched, oldest id first,
    in committed transactions of :data:`IDS_PER_QUERY` (``force_refresh``); the ids that
    got one, and whether the fetch lane filled up (the rest were then not enqueued).

    In batches, so a million artifacts are neither held in memory as jobs at once (83,573
    took 328 MB in one ``enqueue_many``) nor enqueued in one transaction that holds
    SQLite's write lock for minutes.
    """
    enqueued: list[int] = []
    after = 0
    while True:
        with transaction.atomic():
            next_ids = selected.filter(pk__gt=after).order_by("pk").values_list("pk", flat=True)
            ids = list(next_ids[:IDS_PER_QUERY])
            if not ids:
                return enqueued, False
            batch = Artifact.objects.filter(pk__in=ids)
            got = enqueue_fetches(batch)
            if not got and without_active_fetch(batch).exists():  # wanted, none enqueued
                return enqueued, True
        enqueued += got
        after = ids[-1]


def fetch_jobs(ids: list[int]) -> list[Job]:
    """A fetch job for each artifact id, in order, enqueued in one bulk ``enqueue_many``.

    Discovery enqueues inside each page's transaction, which on SQLite holds the only
    write lock: one enqueue per item would hold it for seconds on a page of thousands.
    The unique key ``fetch:<id>`` keeps one fetch per artifact: an artifact already being
    fetched (or enqueued meanwhile by a racing enqueuer) keeps its existing job.

    A full lane gives none, whether its ``on_full`` drops or refuses (``LaneFull``, caught
    in a savepoint): the caller's transaction (a discovery page's, a run's last) goes on,
    and the caller decides when the fetches are tried again.
    """
    args = [{"artifact_id": pk} for pk in ids]
    try:
        with transaction.atomic():
            return enqueue_many(FETCH_KIND, args, unique_keys=[fetch_key(pk) for pk in ids])
    except LaneFull:
        return []


@refresher("artifacts", batch=REFRESH_BATCH)
def refresh_due(limit: int) -> int:
    """Enqueue refreshes for the artifacts past ``refresh_after``: the whole due backlog,
    at least ``limit`` and at most :data:`REFRESH_MAX_BATCH`, oldest first.

    The batch follows the backlog, so five million artifacts on a 28-day TTL (about two
    due a second, 620 per 300 s run) stay current; a fixed batch of 100 would fall behind
    for good past ~800,000. Work goes in transactions of :data:`IDS_PER_QUERY`.
    Those already queued are skipped, so each call takes the next part of the backlog.
    Each one enqueued is also due again only ``REFRESH_RETRY`` from now, in the same
    transaction: a good fetch then sets the real date, and a fetch that dies in a way
    nobody foresaw cannot put the same artifacts at the head of every later batch.
    """
    wanted = min(max(limit, stale().count()), REFRESH_MAX_BATCH)
    enqueued = 0
    while enqueued < wanted:
        with transaction.atomic():
            step = min(IDS_PER_QUERY, wanted - enqueued)
            ids = enqueue_fetches(stale().order_by("refresh_after", "pk"), step)
            retry = db_now() + REFRESH_RETRY
            Artifact.objects.filter(pk__in=ids).update(refresh_after=retry)
        enqueued += len(ids)
        if len(ids) < step:
            break
    return enqueued


def stale() -> QuerySet[Artifact]:
    """Artifacts past their ``refresh_after`` (database clock), of enabled sources: fetched
    ones due for their TTL refresh, and any whose failing fetch's backoff has passed.

    A disabled source's artifacts wait: their fetches would only be skipped, and as the
    oldest due they would fill every batch, so no other source's would be refreshed.
    """
    return Artifact.objects.filter(refresh_after__lte=Now(), source__enabled=True).exclude(
        state=ArtifactState.GONE
    )


# --- discovery hooks -------------------------------------------------------------------


def fetch_discovered(
    source: Source, new_ids: list[int], changed_ids: list[int], retry_ids: list[int]
) -> None:
    """New items, items whose listed ``lastmod`` changed, and failed items still listed
    (``retry_ids``: a permanent failure, or fetches that kept failing) get a fetch.

    Runs inside the discovery page's transaction, so the jobs exist iff the page commits.
    A changed ``lastmod`` also clears ``content_changed_unannounced``: the source now
    announces what it changed.

    A full fetch lane (``drop`` or ``reject``) must cost neither the page nor the fetches:
    the page commits, and the artifacts are due at once (``refresh_after``), so the
    refresher enqueues their fetches when the lane has room. Dropped, they were never
    fetched (a later run lists them as neither new nor changed); refused, the page's
    whole transaction rolled back and it was read again.
    """
    ids = [*new_ids, *changed_ids, *retry_ids]
    if ids and not fetch_jobs(ids):
        for start in range(0, len(ids), IDS_PER_QUERY):
            Artifact.objects.filter(pk__in=ids[start : start + IDS_PER_QUERY]).update(
                refresh_after=Now()
            )
        log.warning("artifact_fetches_deferred", source=source.name, count=len(ids))
    for start in range(0, len(changed_ids), IDS_PER_QUERY):
        urls = Artifact.objects.filter(pk__in=changed_ids[start : start + IDS_PER_QUERY])
        resolve_cleared(
            IssueKind.CONTENT_CHANGED_UNANNOUNCED,
            source.name,
            urls.values("url"),
            "the source lists a new lastmod",
        )


def missing_is_meaningful(run: DiscoveryRun) -> str:
    """Why this completed run may not conclude that unlisted items are missing ("" if it may).

    A run that gave up on a listing page (a 404 child sitemap, one that kept failing, a
    truncated one) did not see everything. A feed is a window: items scroll off it as new
    ones arrive, so only a complete feed (RFC 5005 ``fh:complete``) or one read through
    its archives (``prev-archive``) lists everything the source has.
    """
    if run.failed_pages:
        return f"{run.failed_pages} listing page(s) could not be read"
    if run.source.kind == SourceKind.FEED and not run.exhaustive:
        return "a rolling feed lists a window, not everything"
    return ""


def reconcile_run(run: DiscoveryRun) -> None:
    """After a completed run: what it did not list is missing; what it listed is back.

    Runs inside the run's final transaction. Each missing artifact gets one open
    ``missing_from_source`` issue however many runs miss it; artifacts seen again resolve
    theirs. Nothing is concluded missing from a run that did not see the whole source
    (:func:`missing_is_meaningful`): those items stay as they are, refreshed on their TTL,
    and only a 404/410 then says one is gone. Gone artifacts the source still lists are
    fetched again, which is how a page that comes back clears its ``gone_at_source`` issue.
    """
    source = run.source
    seen = Artifact.objects.filter(source=source, last_seen_run=run)
    resolve_cleared(
        IssueKind.MISSING_FROM_SOURCE,
        source.name,
        seen.values("url"),
        f"listed again by discovery run {run.pk}",
    )
    partial = missing_is_meaningful(run)
    if partial:
        log.info("discovery_run_not_conclusive", run_id=run.pk, source=source.name, why=partial)
    for artifact in [] if partial else not_listed(run):
        record(
            IssueKind.MISSING_FROM_SOURCE,
            artifact.url,
            source.name,
            {
                "artifact_id": artifact.pk,
                "run_id": run.pk,
                "last_seen_run_id": artifact.last_seen_run_id,
                "last_seen_at": timestamp(artifact.last_seen_at),
            },
        )
    refetched = enqueue_fetches(seen.filter(state=ArtifactState.GONE))
    log.info(
        "discovery_run_reconciled", run_id=run.pk, source=source.name, refetch_gone=len(refetched)
    )


def not_listed(run: DiscoveryRun) -> QuerySet[Artifact]:
    """The source's artifacts this run did not list and that have no open issue saying so."""
    open_issue = ReconciliationIssue.objects.filter(
        kind=IssueKind.MISSING_FROM_SOURCE,
        status=IssueStatus.OPEN,
        source=run.source.name,
        subject=OuterRef("url"),
    )
    return (
        Artifact.objects.filter(source=run.source)
        .exclude(last_seen_run=run)
        .exclude(Exists(open_issue))
        .order_by("pk")
    )


def connect(hooks: list[Callable[..., None]], func: Callable[..., None]) -> None:
    if func not in hooks:
        hooks.append(func)


connect(discovery.items_discovered, fetch_discovered)
connect(discovery.run_completed, reconcile_run)


# --- listing ---------------------------------------------------------------------------


def artifacts(source: str | None = None, state: str | None = None) -> QuerySet[Artifact]:
    """Artifacts matching the filters, newest first. An unknown source is bad input."""
    if state is not None and state not in ArtifactState.values:
        raise InvalidJob(f"state must be one of {', '.join(ArtifactState.values)}, not {state!r}")
    found = Artifact.objects.select_related("source").order_by("-pk")
    if source is not None:
        if not Source.objects.filter(name=source).exists():
            raise InvalidJob(f"no source named {source!r}")
        found = found.filter(source__name=source)
    if state:
        found = found.filter(state=state)
    return found


def artifact_dict(artifact: Artifact) -> dict[str, Any]:
    return {
        "id": artifact.pk,
        "source": artifact.source.name,
        "url": artifact.url,
        "state": artifact.state,
        "title": artifact.title or None,
        "lastmod": artifact.lastmod or None,
        "sha256": artifact.sha256 or None,
        "size": artifact.size,
        "content_type": artifact.content_type or None,
        "http_status": artifact.http_status,
        "discovered_at": timestamp(artifact.discovered_at),
        "last_seen_at": timestamp(artifact.last_seen_at),
        "fetched_at": timestamp(artifact.fetched_at),
        "refresh_after": timestamp(artifact.refresh_after),
        "last_error": artifact.last_error or None,
        "failures": artifact.failures,
    }
