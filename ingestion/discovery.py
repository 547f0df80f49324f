"""Discovery: reading a source's listings (sitemaps, feeds) into artifacts, in bounded jobs.

A discovery *run* walks its listing pages: it starts at the source's URL; a sitemap index
(or robots.txt) adds its sitemaps, a feed page its RFC 5005 ``next`` and ``prev-archive``
pages. Pages are rows (:class:`~ingestion.models.DiscoveryPage`), unique per run and URL,
so a page is read once per run however often it is named (loops end), and reading one
writes one row, not the whole cursor: an index of 50,000 sitemaps is linear work. Each
job reads at most ``max_pages_per_run`` pages. Every page commits in one fenced
transaction (``ctx.atomic()``): the artifacts it lists (upserted on source and URL), its
own row, the pages it names, and, on a job's last page, either the continuation job
(unique key per run and job) or the run's completion. A crash therefore repeats at most
the one page in flight, and repeating it changes nothing.

A page that cannot be read never stops the run:

* a defect of the page itself (404/410 or another 4xx, malformed beyond recovery, an
  encoding it does not have, refused XML) marks it ``failed`` at once, with one
  ``listing_failed`` issue on the source;
* a transient failure (timeouts, 5xx, 429) puts the page at the back of the cursor; the
  others are read meanwhile, and once only retried pages are left the job ends with a
  continuation delayed by a backoff. After :data:`PAGE_TRIES` tries it is ``failed`` too;
* a page recovered in part (the URLs before a truncation) is read, and counted failed.

A run that failed any page completes all the same, but it did not see the whole source,
so nothing is concluded missing from it (``artifacts.missing_is_meaningful``). A run
whose every page failed is ``failed``. A later run that reads a page cleanly resolves its
``listing_failed`` issue.

What happens to discovered items is not decided here: the artifact side registers
callables in :data:`items_discovered` and :data:`run_completed`, which run inside those
same transactions (so a job they enqueue exists iff the page commits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F, QuerySet

from jobs import engine, enqueueing
from jobs.context import JobContext
from jobs.exceptions import HoldfastError, PermanentError, StateConflict
from jobs.log import get_logger
from jobs.models import ACTIVE, Job

from . import http
from .listings import Item, Listing, ListingError, normalize_lastmod, parse_listing
from .models import (
    Artifact,
    ArtifactState,
    DiscoveryPage,
    DiscoveryRun,
    IssueKind,
    PageState,
    RunState,
    Source,
)
from .reconciliation import record_unless_open, resolve_cleared
from .sources import DISCOVER_KIND, SourceNotFound, get_source

__all__ = ["Item", "Listing", "ListingError", "normalize_lastmod", "parse_listing"]

log = get_logger("ingestion.discovery")

# A sitemap index lists up to 50,000 sitemaps, and robots.txt may name several indexes:
# a run reading more listing pages than this is a generator of endless distinct URLs.
MAX_RUN_PAGES = 200_000
BATCH = 500  # rows per query when upserting a page's items
MALFORMED_LOGGED = 10  # a page's malformed URLs named in its log event; all are counted
SCHEDULED_KEY_PREFIX = "schedule:"  # the unique keys of the jobs jobs.scheduler enqueues
PAGE_TRIES = 3  # transient failures of one listing page before the run gives up on it
# Reads of one page that ended with no outcome at all (the worker was killed: out of memory,
# a crash in C code, a lease lost for good) before the run gives up on it: without a limit
# every job, and every later run, would die on it, and no page behind it would be read.
PAGE_CRASHES = 2
PAGE_RETRY_DELAY = timedelta(seconds=30)  # doubled per try of the page at the cursor's head
RETRY_STATUSES = frozenset({408, 429})

# --- hooks -------------------------------------------------------------------------------

#: ``hook(source, new_ids, changed_ids, retry_ids)``, inside the transaction of each page
#: that listed new or changed items, or failed items to try again.
items_discovered: list[Callable[[Source, list[int], list[int], list[int]], None]] = []
#: ``hook(run)``, inside the transaction that completes the run.
run_completed: list[Callable[[DiscoveryRun], None]] = []


# --- starting a run on demand ------------------------------------------------------------


def active_jobs(source_name: str) -> QuerySet[Job]:
    """Discovery jobs of this source that are queued or running (unordered: see
    :func:`first_active`)."""
    return Job.objects.filter(ACTIVE, kind=DISCOVER_KIND, args__source=source_name).order_by()


def first_active(source_name: str, other_than: int = 0) -> Job | None:
    """The oldest of :func:`active_jobs` (but the job ``other_than``, if any), or None.

    Picked here, not by ``ORDER BY id LIMIT 1``: on a large table PostgreSQL answers that
    by walking the primary key through the whole history (0.6 s at three million jobs)
    rather than reading the few active rows through ``job_state_idx``.
    """
    found = active_jobs(source_name).exclude(pk=other_than)
    return min(found, key=lambda job: job.pk, default=None)


def start_discovery(source: Source) -> tuple[Job | None, str]:
    """Enqueue a discovery of ``source`` unless one is already queued or running.

    Returns the job (None when nothing was enqueued) and a sentence saying what happened.
    A run left ``running`` by a job that died or was cancelled is resumed, not restarted.

    Two starts of one source queue up on the source's row (SQLite's write lock does the
    same), so the second sees the job the first enqueued and says so. Without that, both
    would find nothing queued, and the loser's enqueue would hand back the winner's job
    (unique key ``discover:<name>``) for it to report as newly enqueued.
    """
    if not source.enabled:
        raise StateConflict(f"source {source.name!r} is disabled")
    with transaction.atomic():
        Source.objects.select_for_update().filter(pk=source.pk).exists()
        busy = first_active(source.name)
        if busy is not None:
            return None, _already(source, busy)
        job = enqueueing.enqueue(
            DISCOVER_KIND, {"source": source.name}, unique_key=f"discover:{source.name}"
        )
        if job is None:
            return None, f"the discovery lane is full; nothing enqueued for {source.name!r}"
        run = source.runs.filter(state=RunState.RUNNING).first()
    if run is not None:
        return job, f"job {job.pk} resumes interrupted discovery run {run.pk} of {source.name!r}"
    return job, f"job {job.pk} discovers {source.name!r}"


def _already(source: Source, busy: Job) -> str:
    return f"discovery of {source.name!r} is already {busy.state} (job {busy.pk}); nothing enqueued"


# --- the bounded run ---------------------------------------------------------------------


class _Superseded(Exception):
    """The run moved under this job: another job is working on it."""


@dataclass(frozen=True)
class _Failure:
    """Why a page could not be read; ``transient`` when a later try may work."""

    error: str
    transient: bool


def discover(ctx: JobContext, source_name: str, run_id: int | None) -> dict[str, Any]:
    """The body of ``ingestion.discover_source``: up to ``max_pages_per_run`` pages."""
    try:
        source = get_source(source_name)
    except SourceNotFound as exc:
        raise PermanentError(str(exc)) from None
    if not source.enabled:
        _stop_runs(ctx, source)
        log.info("discovery_skipped", source=source_name, reason="source disabled")
        return {"skipped": "source disabled"}
    run = _run_for(ctx, source, run_id)
    if isinstance(run, str):
        log.info("discovery_skipped", source=source_name, reason=run)
        return {"skipped": run}
    result: dict[str, Any] = {
        "run": run.pk,
        "pages": 0,
        "new": 0,
        "changed": 0,
        "malformed": 0,
        "failed_pages": 0,
    }
    while True:
        page = _head(run.pk)
        try:
            if page is None:  # nothing pending: a run resumed after its last page failed
                with ctx.atomic(complete=True, result=result):
                    current = _locked_run(run.pk)
                    _finish(source, current, result)
                    current.save()
                return result
            with _last_attempt_fails_run(ctx, source, run, page.url):
                done = _read_page(ctx, source, run.pk, page, result)
        except _Superseded:
            log.warning("discovery_superseded", source=source.name, run_id=run.pk)
            return {**result, "superseded": True}
        if done:
            return result
        if ctx.cancel_requested:
            raise ctx.Cancelled()


def _stop_runs(ctx: JobContext, source: Source) -> None:
    """End the disabled source's run in progress, as failed, saying why.

    Left ``running``, it would show as in progress for as long as the source stays
    disabled, and be resumed from its stale cursor when it is enabled again.
    """
    error = "the source was disabled while the run was in progress"
    with ctx.atomic():
        stopped = list(
            source.runs.select_for_update()
            .filter(state=RunState.RUNNING)
            .values_list("pk", flat=True)
        )
        DiscoveryRun.objects.filter(pk__in=stopped, state=RunState.RUNNING).update(
            state=RunState.FAILED, error=error, finished_at=engine.db_now()
        )
    for run_id in stopped:
        log.warning("discovery_run_failed", source=source.name, run_id=run_id, error=error)


def _pending(run_id: int) -> QuerySet[DiscoveryPage]:
    return DiscoveryPage.objects.filter(run_id=run_id, state=PageState.PENDING).order_by("pk")


def _head(run_id: int, after: int | None = None) -> DiscoveryPage | None:
    """The next page to read: the oldest pending row (a retried page was moved back)."""
    pending = _pending(run_id)
    return (pending if after is None else pending.exclude(pk=after)).first()


def _locked_run(run_id: int) -> DiscoveryRun:
    return DiscoveryRun.objects.select_for_update().select_related("source").get(pk=run_id)


def _read_page(
    ctx: JobContext, source: Source, run_id: int, page: DiscoveryPage, result: dict[str, Any]
) -> bool:
    """Read one page and commit what it lists, or its failure; True when the job is done.

    Whether this page ends the job is worked out before the transaction, so that the
    page, the continuation or completion and the job's completion commit together.
    """
    crashed = _started(ctx, source, page)
    if crashed >= PAGE_CRASHES:
        outcome: Listing | _Failure = _Failure(
            f"reading the page ended {crashed} times with no outcome (its worker died or was"
            " killed each time); the run goes on without it",
            transient=False,
        )
    else:
        outcome = _read(source, page.url)
    result["pages"] += 1
    requeued = isinstance(outcome, _Failure) and outcome.transient and page.tries + 1 < PAGE_TRIES
    new_pages = [] if isinstance(outcome, _Failure) else _unknown_pages(run_id, outcome.pages)
    nxt = _head(run_id, after=page.pk)
    if nxt is not None:
        head_tries: int | None = nxt.tries
    elif new_pages:
        head_tries = 0
    elif requeued:
        head_tries = page.tries + 1
    else:
        head_tries = None  # nothing left: the run ends with this page
    budget_spent = result["pages"] >= source.max_pages_per_run
    done = head_tries is None or head_tries > 0 or budget_spent
    with ctx.atomic(complete=done, result=result):
        run = _locked_run(run_id)
        row = DiscoveryPage.objects.select_for_update().filter(pk=page.pk).first()
        if row is None or row.state != PageState.PENDING or run.state != RunState.RUNNING:
            raise _Superseded
        if isinstance(outcome, _Failure):
            _page_failed(source, run, row, outcome, result, requeued)
        else:
            _page_read(source, run, row, outcome, new_pages, result)
        if head_tries is None:
            _finish(source, run, result)
        elif head_tries > 0:
            # Only pages that already failed are left: give them time before the next try.
            run.jobs += 1
            _continue(source, run, PAGE_RETRY_DELAY * 2 ** (head_tries - 1))
        elif budget_spent:
            run.jobs += 1
            _continue(source, run, None)
        run.save()
    return done


def _started(ctx: JobContext, source: Source, page: DiscoveryPage) -> int:
    """Record, in its own commit, that this job begins reading ``page``; how many earlier
    reads of it ended with no outcome (neither read nor failed: the process died).

    Each outcome of a read is a commit: the page read or failed, or a transient failure
    (``tries`` + 1, ``starts`` carried over). So ``starts - tries`` counts the reads that
    never got that far.
    """
    with ctx.atomic():
        pending = DiscoveryPage.objects.filter(pk=page.pk, state=PageState.PENDING)
        if not pending.update(starts=F("starts") + 1):
            raise _Superseded
    crashed = max(0, page.starts - page.tries)  # (rows from before ``starts``: 0)
    if crashed:
        log.warning(
            "discovery_page_crashed_before",
            source=source.name,
            run_id=page.run_id,
            page=page.url,
            reads_without_outcome=crashed,
        )
    return crashed


@contextmanager
def _last_attempt_fails_run(
    ctx: JobContext, source: Source, run: DiscoveryRun, page: str
) -> Iterator[None]:
    """On the job's last attempt, an unexpected error on ``page`` fails the run.

    Expected outcomes are decided where they happen (see the module's docstring). Anything
    else (a bug, a row the database refuses) would kill the job and leave the run
    ``running`` with ``page`` at the head of its cursor, so that every later job would read
    it, die the same way, and no discovery of the source would ever complete again.
    """
    try:
        yield
    except (HoldfastError, _Superseded):
        raise
    except Exception as exc:
        if ctx.attempt >= ctx.max_attempts:
            reason = f"{type(exc).__name__}: {exc}"
            error = f"listing page {page} failed {ctx.attempt} times: {reason}"
            with ctx.atomic():
                DiscoveryRun.objects.filter(pk=run.pk, state=RunState.RUNNING).update(
                    state=RunState.FAILED, error=error[:10_000], finished_at=engine.db_now()
                )
            log.warning("discovery_run_failed", source=source.name, run_id=run.pk, error=error)
            raise PermanentError(error) from exc
        raise


def _run_for(ctx: JobContext, source: Source, run_id: int | None) -> DiscoveryRun | str:
    """The run this job works on, or why it has nothing to do."""
    if run_id is not None:
        run = DiscoveryRun.objects.filter(pk=run_id, source=source).first()
        if run is None or run.state != RunState.RUNNING:
            return f"run {run_id} is not running"
        return run
    running = source.runs.filter(state=RunState.RUNNING).first()
    other = first_active(source.name, other_than=ctx.job_id)
    if running is not None and other is not None:
        return f"run {running.pk} is in progress (job {other.pk})"
    redundant = _redundant_slot(ctx, source, other)
    if redundant:
        return redundant
    if running is None:
        with ctx.atomic():
            run = DiscoveryRun.objects.create(source=source, jobs=1, known_pages=1)
            DiscoveryPage.objects.create(run=run, url=source.url)
        log.info("discovery_run_started", source=source.name, run_id=run.pk, job_id=ctx.job_id)
        return run
    # The run's last job died or was cancelled: carry on from its committed pages.
    with ctx.atomic():
        DiscoveryRun.objects.filter(pk=running.pk).update(jobs=F("jobs") + 1)
    log.info("discovery_run_resumed", source=source.name, run_id=running.pk, job_id=ctx.job_id)
    return running


def _redundant_slot(ctx: JobContext, source: Source, other: Job | None) -> str:
    """Why this job, if a schedule enqueued it, would only repeat another discovery.

    A manual discovery (``discover:<name>``) and a schedule's slot can both be queued; the
    source lock runs them one after the other, and the second would read the whole source
    again. The scheduled one gives way: to a discovery job queued or running, and to a
    run completed since the slot was enqueued. Returns "" when the job should go ahead.
    """
    job = Job.objects.only("unique_key", "created_at").get(pk=ctx.job_id)
    if not (job.unique_key or "").startswith(SCHEDULED_KEY_PREFIX):
        return ""
    if other is not None:
        return f"discovery job {other.pk} is already {other.state}"
    done = (
        source.runs.filter(state=RunState.COMPLETED, finished_at__gte=job.created_at)
        .order_by("-pk")
        .first()
    )
    return f"run {done.pk} completed after this job was enqueued" if done else ""


def _read(source: Source, page: str) -> Listing | _Failure:
    """Fetch and parse one listing page; what went wrong is returned, not raised."""
    try:
        response = http.get(source, page)
    except http.FetchError as exc:
        return _Failure(str(exc), exc.transient)
    if response.status >= 500 or response.status in RETRY_STATUSES:
        return _Failure(f"GET {page}: answered {response.status}", transient=True)
    if response.status != 200:
        return _Failure(f"GET {page}: answered {response.status}", transient=False)
    try:
        return parse_listing(response.body, response.url, response.headers.get("content-type", ""))
    except ListingError as exc:
        return _Failure(str(exc), transient=False)
    except Exception as exc:  # a parser's bug on this page: logged in full, the page failed
        log.exception("listing_parser_failed", source=source.name, page=page)
        return _Failure(f"{page}: the parser failed ({type(exc).__name__}: {exc})", False)


def _unknown_pages(run_id: int, pages: list[str]) -> list[str]:
    """The pages of ``pages`` this run does not know yet (read, pending or failed), once each."""
    wanted = list(dict.fromkeys(pages))
    known: set[str] = set()
    for chunk in _chunks(wanted):
        known.update(
            DiscoveryPage.objects.filter(run_id=run_id, url__in=chunk).values_list("url", flat=True)
        )
    return [page for page in wanted if page not in known]


def _page_read(
    source: Source,
    run: DiscoveryRun,
    row: DiscoveryPage,
    listing: Listing,
    new_pages: list[str],
    result: dict[str, Any],
) -> None:
    """Inside the page's transaction: its items, its row, the pages it names."""
    now = engine.db_now()
    if run.known_pages + len(new_pages) > MAX_RUN_PAGES:
        new_pages = new_pages[: max(MAX_RUN_PAGES - run.known_pages, 0)]
        listing = Listing(
            listing.items,
            listing.pages,
            listing.malformed,
            listing.defect
            or f"the run reached {MAX_RUN_PAGES} listing pages; the pages past that are not read",
            listing.complete,
            listing.archived,
        )
    DiscoveryPage.objects.bulk_create(
        [DiscoveryPage(run=run, url=url) for url in new_pages], batch_size=BATCH
    )
    run.known_pages += len(new_pages)
    new, changed, retry, first_seen = _upsert(source, run, listing.items, now)
    run.pages += 1
    run.items += first_seen
    run.exhaustive = run.exhaustive or listing.complete or listing.archived
    result["new"] += len(new)
    result["changed"] += len(changed)
    result["malformed"] += len(listing.malformed)
    if listing.defect:
        row.state, row.error = PageState.FAILED, listing.defect[:10_000]
        run.failed_pages += 1
        result["failed_pages"] += 1
        _record_page_issue(source, run, row.url, listing.defect, recovered=len(listing.items))
    else:
        row.state, row.error = PageState.READ, ""
        resolve_cleared(
            IssueKind.LISTING_FAILED, source.name, [row.url], f"read by discovery run {run.pk}"
        )
    row.save(update_fields=["state", "error"])
    log.info(
        "discovery_page_read",
        source=source.name,
        run_id=run.pk,
        page=row.url,
        items=len(listing.items),
        new=len(new),
        changed=len(changed),
        pages_named=len(new_pages),
        defect=listing.defect or None,
    )
    if listing.malformed:
        log.warning(
            "discovery_urls_malformed",
            source=source.name,
            run_id=run.pk,
            page=row.url,
            count=len(listing.malformed),
            urls=listing.malformed[:MALFORMED_LOGGED],
        )
    if new or changed or retry:
        for hook in items_discovered:
            hook(source, new, changed, retry)


def _page_failed(
    source: Source,
    run: DiscoveryRun,
    row: DiscoveryPage,
    failure: _Failure,
    result: dict[str, Any],
    requeued: bool,
) -> None:
    """Inside the page's transaction: try the page again later, or give up on it."""
    if requeued:  # to the back of the cursor: a new row, so that ``id`` order puts it last
        row.delete()
        DiscoveryPage.objects.create(
            run=run,
            url=row.url,
            tries=row.tries + 1,
            starts=row.starts,
            error=failure.error[:10_000],
        )
        log.info(
            "discovery_page_retry",
            source=source.name,
            run_id=run.pk,
            page=row.url,
            tries=row.tries + 1,
            error=failure.error,
        )
        return
    tries = row.tries + (1 if failure.transient else 0)
    DiscoveryPage.objects.filter(pk=row.pk).update(
        state=PageState.FAILED, tries=tries, error=failure.error[:10_000]
    )
    run.failed_pages += 1
    result["failed_pages"] += 1
    error = failure.error if not failure.transient else f"{failure.error} ({tries} tries)"
    _record_page_issue(source, run, row.url, error, transient=failure.transient, tries=tries)
    log.warning(
        "discovery_page_failed", source=source.name, run_id=run.pk, page=row.url, error=error
    )


def _record_page_issue(
    source: Source, run: DiscoveryRun, url: str, error: str, **details: Any
) -> None:
    """One open ``listing_failed`` issue per page of a source, however many runs fail it."""
    record_unless_open(
        IssueKind.LISTING_FAILED, url, source.name, {"run_id": run.pk, "error": error, **details}
    )
    if not run.error:
        run.error = f"listing page {url} failed: {error}"[:10_000]


def _finish(source: Source, run: DiscoveryRun, result: dict[str, Any]) -> None:
    """No page is pending: the run completes, or fails if it could read no page at all."""
    now = engine.db_now()
    run.finished_at = now
    if run.pages == 0:
        run.state = RunState.FAILED
        result.update(completed=False, failed=run.error or "no listing page could be read")
        log.warning("discovery_run_failed", source=source.name, run_id=run.pk, error=run.error)
        return
    run.state = RunState.COMPLETED
    result.update(completed=True, items=run.items, failed_pages=run.failed_pages)
    for completed in run_completed:
        completed(run)
    log.info(
        "discovery_run_completed",
        source=source.name,
        run_id=run.pk,
        items=run.items,
        failed_pages=run.failed_pages,
    )


def _continue(source: Source, run: DiscoveryRun, delay: timedelta | None) -> None:
    key = f"discover:{source.name}:run{run.pk}:job{run.jobs}"
    # A continuation: a full discovery lane neither refuses it (the page's commit would
    # roll back, and the page be fetched again) nor drops it (the run would wait for the
    # next scheduled slot, a day, with no job to carry it on).
    job = enqueueing.enqueue(
        DISCOVER_KIND,
        {"source": source.name, "run": run.pk},
        unique_key=key,
        delay=delay,
        continuation=True,
    )
    log.info(
        "discovery_continued",
        source=source.name,
        run_id=run.pk,
        next_job_id=None if job is None else job.pk,  # (None only from a full lane's drop)
        delay=None if delay is None else delay.total_seconds(),
    )


def _upsert(
    source: Source, run: DiscoveryRun, items: list[Item], now: datetime
) -> tuple[list[int], list[int], list[int], int]:
    """Upsert a page's items on (source, url).

    Returns the new ids, the changed ids (the listing gives a known ``lastmod`` other than
    the one last listed; unknown ones never count), the ids of failed items to fetch
    again (a permanent failure, or fetches that kept failing), and how many items this
    run sees here for the first time (for ``run.items``, without counting the whole run).
    """
    listed: dict[str, Item] = {}
    for item in items:  # a URL listed twice: the last one wins, the last with a lastmod
        if item.lastmod or item.url not in listed:
            listed[item.url] = item
    urls = list(listed)
    existing: dict[str, Artifact] = {}
    for chunk in _chunks(urls):
        existing.update((a.url, a) for a in Artifact.objects.filter(source=source, url__in=chunk))
    fresh = [
        Artifact(
            source=source,
            url=url,
            lastmod=item.lastmod,
            title=item.title,
            last_seen_run=run,
            last_seen_at=now,
        )
        for url, item in listed.items()
        if url not in existing
    ]
    Artifact.objects.bulk_create(fresh, batch_size=BATCH, ignore_conflicts=True)
    new: list[int] = []
    for chunk in _chunks([artifact.url for artifact in fresh]):
        new += Artifact.objects.filter(source=source, url__in=chunk).values_list("pk", flat=True)
    changed: list[int] = []
    retry: list[int] = []
    updated: list[Artifact] = []
    first_seen = len(fresh)
    for url, artifact in existing.items():
        item = listed[url]
        if item.lastmod and item.lastmod != normalize_lastmod(artifact.lastmod):
            changed.append(artifact.pk)
        elif artifact.state == ArtifactState.FAILED or artifact.failures:
            retry.append(artifact.pk)
        if artifact.last_seen_run_id != run.pk:
            first_seen += 1
        # An item without a lastmod says nothing of it: keep the last one listed. Erased,
        # the same date listed again later read as a change (a refetch for nothing), and
        # a URL in two sitemaps, one without dates, was "changed" on every run.
        artifact.lastmod = item.lastmod or artifact.lastmod
        artifact.title = item.title or artifact.title
        artifact.last_seen_run = run
        artifact.last_seen_at = now
        updated.append(artifact)
    fields = ["lastmod", "title", "last_seen_run", "last_seen_at"]
    Artifact.objects.bulk_update(updated, fields, batch_size=BATCH)
    return sorted(new), sorted(changed), sorted(retry), first_seen


def _chunks(values: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(values), BATCH):
        yield values[start : start + BATCH]
