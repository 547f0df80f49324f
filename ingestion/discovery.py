"""Discovery: reading a source's listings (sitemaps, feeds) into artifacts, in bounded jobs.

A discovery *run* walks a cursor of listing pages: it starts at the source's URL; a
sitemap index adds its child sitemaps, a feed page adds its RFC 5005 ``next`` page. The
run keeps the pages it has read (``visited``) and never reads one twice, so feeds or
sitemap indexes that point back at each other end instead of looping. Each job reads at
most ``max_pages_per_run`` pages. Every page commits in one fenced transaction
(``ctx.atomic()``): the artifacts it lists (upserted on source and URL), the run's cursor
without that page, and, on a job's last page, either the continuation job (unique key
per run and job) or the run's completion. A crash therefore repeats at most
the one page in flight, and repeating it changes nothing.

What happens to discovered items is not decided here: the artifact side registers
callables in :data:`items_discovered` and :data:`run_completed`, which run inside those
same transactions (so a job they enqueue exists iff the page commits).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NoReturn
from urllib.parse import urldefrag, urljoin, urlsplit
from xml.etree.ElementTree import Element, ParseError

import feedparser
from defusedxml import DefusedXmlException
from defusedxml.ElementTree import fromstring
from django.conf import settings
from django.db import transaction
from django.db.models import F, QuerySet

from jobs import engine
from jobs.context import JobContext
from jobs.exceptions import HoldfastError, PermanentError, StateConflict
from jobs.log import get_logger
from jobs.models import Job, State

from . import http
from .models import Artifact, DiscoveryRun, RunState, Source
from .sources import DISCOVER_KIND, SourceNotFound, get_source

log = get_logger("ingestion.discovery")

MAX_RUN_PAGES = 10_000  # a run reading more listing pages than this is stuck in a loop
BATCH = 500  # rows per query when upserting a page's items
LASTMOD_LENGTH = 64
URL_LENGTH = 2000
MALFORMED_LOGGED = 10  # a page's malformed URLs named in its log event; all are counted
SCHEDULED_KEY_PREFIX = "schedule:"  # the unique keys of the jobs jobs.scheduler enqueues

# --- hooks -------------------------------------------------------------------------------

#: ``hook(source, new_artifact_ids, changed_artifact_ids)``, inside the transaction of each
#: page that listed new or changed items.
items_discovered: list[Callable[[Source, list[int], list[int]], None]] = []
#: ``hook(run)``, inside the transaction that completes the run.
run_completed: list[Callable[[DiscoveryRun], None]] = []


# --- parsing -----------------------------------------------------------------------------


class ListingError(HoldfastError, ValueError):
    """A listing page that is not a sitemap or feed Holdfast can read."""


@dataclass(frozen=True)
class Item:
    """One document a listing names."""

    url: str
    lastmod: str = ""
    title: str = ""


@dataclass(frozen=True)
class Listing:
    items: list[Item]
    pages: list[str]  # further listing pages it points to (child sitemaps, next feed page)
    malformed: list[str] = field(default_factory=list)  # URLs that do not parse; skipped


def parse_listing(body: bytes, url: str) -> Listing:
    """Read a sitemap index, a sitemap, an Atom or an RSS feed (by its root element).

    XML is parsed with defusedxml first: entity declarations and external references are
    refused, so a listing cannot expand into gigabytes or read local files. Gzipped
    sitemaps are inflated up to ``HOLDFAST_FETCH_MAX_BYTES``.
    """
    body = _inflated(body, url)
    try:
        root = fromstring(body, forbid_dtd=False, forbid_entities=True, forbid_external=True)
    except DefusedXmlException as exc:
        raise ListingError(f"{url}: refused XML ({type(exc).__name__})") from None
    except ParseError as exc:
        raise ListingError(f"{url}: not well-formed XML ({exc})") from None
    tag = _local(root.tag)
    malformed: list[str] = []
    if tag == "sitemapindex":
        pages = [loc for loc, _ in _sitemap_entries(root, "sitemap", url, malformed)]
        return Listing([], pages, malformed)
    if tag == "urlset":
        entries = _sitemap_entries(root, "url", url, malformed)
        return Listing([Item(loc, lastmod) for loc, lastmod in entries], [], malformed)
    if tag in ("feed", "rss", "RDF"):
        return _feed(body, url)
    raise ListingError(f"{url}: <{tag}> is neither a sitemap nor an RSS/Atom feed")


def _inflated(body: bytes, url: str) -> bytes:
    if not body.startswith(b"\x1f\x8b"):
        return body
    cap = settings.HOLDFAST_FETCH_MAX_BYTES
    try:
        inflated = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(body, cap + 1)
    except zlib.error as exc:
        raise ListingError(f"{url}: broken gzip data ({exc})") from None
    if len(inflated) > cap:
        raise ListingError(f"{url}: inflates to more than {cap} bytes")
    return inflated


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _child_text(element: Element, name: str) -> str:
    for child in element:
        if _local(child.tag) == name:
            return (child.text or "").strip()
    return ""


def _sitemap_entries(
    root: Element, name: str, base: str, malformed: list[str]
) -> Iterator[tuple[str, str]]:
    for element in root:
        if _local(element.tag) != name:
            continue
        loc = _absolute(base, _child_text(element, "loc"), malformed)
        if loc:
            yield loc, _child_text(element, "lastmod")[:LASTMOD_LENGTH]


def _feed(body: bytes, url: str) -> Listing:
    parsed = feedparser.parse(body, response_headers={"content-location": url})
    malformed: list[str] = []
    items = []
    for entry in parsed.entries:
        link = _absolute(url, entry.get("link", ""), malformed)
        if not link:
            continue
        # feedparser maps a missing ``updated`` to ``published`` with a warning: ask first.
        lastmod = entry["updated"] if "updated" in entry else entry.get("published", "")
        items.append(Item(link, (lastmod or "")[:LASTMOD_LENGTH], entry.get("title", "")))
    pages = [
        _absolute(url, link.get("href", ""), malformed)
        for link in parsed.feed.get("links", [])
        if link.get("rel") == "next"
    ]
    return Listing(items, [page for page in pages if page], malformed)


def _absolute(base: str, url: str, malformed: list[str]) -> str:
    """An absolute http(s) URL without fragment, or "" for anything else.

    A URL that does not even parse (``http://[::1/x``: urllib raises ``ValueError``) is
    added to ``malformed`` and skipped: one bad entry must not stop the page, or the run.
    """
    if not url:
        return ""
    try:
        absolute = urldefrag(urljoin(base, url.strip())).url
        parts = urlsplit(absolute)
    except ValueError:
        malformed.append(url.strip()[:URL_LENGTH])
        return ""
    if parts.scheme not in ("http", "https") or not parts.hostname or len(absolute) > URL_LENGTH:
        return ""
    return absolute


# --- starting a run on demand ------------------------------------------------------------


def active_jobs(source_name: str) -> QuerySet[Job]:
    """Discovery jobs of this source that are queued or running."""
    return Job.objects.filter(
        kind=DISCOVER_KIND, state__in=[State.QUEUED, State.RUNNING], args__source=source_name
    ).order_by("pk")


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
        busy = active_jobs(source.name).first()
        if busy is not None:
            return None, _already(source, busy)
        job = engine.enqueue(
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
    """The run's cursor moved under this job: another job is working on the run."""


def discover(ctx: JobContext, source_name: str, run_id: int | None) -> dict[str, Any]:
    """The body of ``ingestion.discover_source``: up to ``max_pages_per_run`` pages."""
    try:
        source = get_source(source_name)
    except SourceNotFound as exc:
        raise PermanentError(str(exc)) from None
    if not source.enabled:
        log.info("discovery_skipped", source=source_name, reason="source disabled")
        return {"skipped": "source disabled"}
    run = _run_for(ctx, source, run_id)
    if isinstance(run, str):
        log.info("discovery_skipped", source=source_name, reason=run)
        return {"skipped": run}
    result: dict[str, Any] = {"run": run.pk, "pages": 0, "new": 0, "changed": 0, "malformed": 0}
    while True:
        cursor = list(run.cursor)
        try:
            with _last_attempt_fails_run(ctx, source, run, cursor[0]):
                run, last = _read_page(ctx, source, run, cursor, result)
        except _Superseded:
            log.warning("discovery_superseded", source=source.name, run_id=run.pk)
            return {**result, "superseded": True}
        if last:
            return result
        if ctx.cancel_requested:
            raise ctx.Cancelled()


def _read_page(
    ctx: JobContext, source: Source, run: DiscoveryRun, cursor: list[str], result: dict[str, Any]
) -> tuple[DiscoveryRun, bool]:
    """Read the cursor's first page and commit what it lists; True when the job is done."""
    listing = _read(ctx, source, run, cursor[0])
    remaining = _next_cursor(cursor, listing.pages, run.visited)
    if run.pages + 1 + len(remaining) > MAX_RUN_PAGES:
        _fail(ctx, source, run, f"the run grew past {MAX_RUN_PAGES} listing pages")
    result["pages"] += 1
    last = not remaining or result["pages"] >= source.max_pages_per_run
    # On a job's last page the result commits with the job; it is filled in below.
    with ctx.atomic(complete=last, result=result):
        run = _commit_page(source, run.pk, cursor, remaining, listing, result)
    return run, last


@contextmanager
def _last_attempt_fails_run(
    ctx: JobContext, source: Source, run: DiscoveryRun, page: str
) -> Iterator[None]:
    """On the job's last attempt, an unexpected error on ``page`` fails the run.

    Expected outcomes are decided where they happen: a transient fetch error leaves the
    run to be resumed, an unreadable listing fails it at once. Anything else (a bug, a row
    the database refuses) would kill the job and leave the run ``running`` with ``page``
    at the head of its cursor, so that every later job would read it, die the same way,
    and no discovery of the source would ever complete again.
    """
    try:
        yield
    except (HoldfastError, _Superseded):
        raise
    except Exception as exc:
        if ctx.attempt >= ctx.max_attempts:
            reason = f"{type(exc).__name__}: {exc}"
            _fail(ctx, source, run, f"listing page {page} failed {ctx.attempt} times: {reason}")
        raise


def _run_for(ctx: JobContext, source: Source, run_id: int | None) -> DiscoveryRun | str:
    """The run this job works on, or why it has nothing to do."""
    if run_id is not None:
        run = DiscoveryRun.objects.filter(pk=run_id, source=source).first()
        if run is None or run.state != RunState.RUNNING:
            return f"run {run_id} is not running"
        return run
    running = source.runs.filter(state=RunState.RUNNING).first()
    other = active_jobs(source.name).exclude(pk=ctx.job_id).first()
    if running is not None and other is not None:
        return f"run {running.pk} is in progress (job {other.pk})"
    redundant = _redundant_slot(ctx, source, other)
    if redundant:
        return redundant
    if running is None:
        with ctx.atomic():
            run = DiscoveryRun.objects.create(source=source, cursor=[source.url], jobs=1)
        log.info("discovery_run_started", source=source.name, run_id=run.pk, job_id=ctx.job_id)
        return run
    # The run's last job died or was cancelled: carry on from its committed cursor.
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


def _read(ctx: JobContext, source: Source, run: DiscoveryRun, page: str) -> Listing:
    """Fetch and parse one listing page; what cannot succeed later fails the run."""
    try:
        response = http.get(source, page)
    except http.FetchError as exc:
        if exc.transient:
            raise  # retried with backoff; the cursor still starts at this page
        _fail(ctx, source, run, str(exc))
    if response.status == 429 or response.status >= 500:
        raise http.FetchError(f"GET {page}: answered {response.status}; will retry")
    if response.status != 200:
        _fail(ctx, source, run, f"listing page {page} answered {response.status}")
    try:
        return parse_listing(response.body, response.url)
    except ListingError as exc:
        _fail(ctx, source, run, str(exc))


def _fail(ctx: JobContext, source: Source, run: DiscoveryRun, error: str) -> NoReturn:
    """Mark the run failed, then send the job to ``dead``: retrying cannot help."""
    with ctx.atomic():
        DiscoveryRun.objects.filter(pk=run.pk, state=RunState.RUNNING).update(
            state=RunState.FAILED, error=error, finished_at=engine.db_now()
        )
    log.warning("discovery_run_failed", source=source.name, run_id=run.pk, error=error)
    raise PermanentError(error)


def _next_cursor(cursor: list[str], found: Iterable[str], visited: Iterable[str]) -> list[str]:
    """The cursor once its first page is read: the rest, then the pages that one named.

    A page already read in this run (``visited``) or already pending is not added again.
    """
    remaining = cursor[1:]
    known = {*visited, *cursor}
    for page in found:
        if page not in known:
            remaining.append(page)
            known.add(page)
    return remaining


def _commit_page(
    source: Source,
    run_id: int,
    cursor: list[str],
    remaining: list[str],
    listing: Listing,
    result: dict[str, Any],
) -> DiscoveryRun:
    """Inside the page's ``ctx.atomic()``: items, cursor, and continuation or completion."""
    run = DiscoveryRun.objects.select_for_update().get(pk=run_id)
    if run.state != RunState.RUNNING or run.cursor != cursor:
        raise _Superseded
    now = engine.db_now()
    new, changed = _upsert(source, run, listing.items, now)
    run.cursor = remaining
    run.visited = [*run.visited, cursor[0]]
    run.pages += 1
    run.items = Artifact.objects.filter(last_seen_run=run).count()
    result["new"] += len(new)
    result["changed"] += len(changed)
    result["malformed"] += len(listing.malformed)
    last = result["pages"] >= source.max_pages_per_run
    if not remaining:
        run.state, run.finished_at = RunState.COMPLETED, now
    elif last:
        run.jobs += 1
    fields = ["cursor", "visited", "pages", "items", "state", "finished_at", "jobs"]
    run.save(update_fields=fields)
    log.info(
        "discovery_page_read",
        source=source.name,
        run_id=run.pk,
        page=cursor[0],
        items=len(listing.items),
        new=len(new),
        changed=len(changed),
        pending=len(remaining),
    )
    if listing.malformed:
        log.warning(
            "discovery_urls_malformed",
            source=source.name,
            run_id=run.pk,
            page=cursor[0],
            count=len(listing.malformed),
            urls=listing.malformed[:MALFORMED_LOGGED],
        )
    if new or changed:
        for hook in items_discovered:
            hook(source, new, changed)
    if not remaining:
        result.update(completed=True, items=run.items)
        for completed in run_completed:
            completed(run)
        log.info("discovery_run_completed", source=source.name, run_id=run.pk, items=run.items)
    elif last:
        _continue(source, run)
    return run


def _continue(source: Source, run: DiscoveryRun) -> None:
    key = f"discover:{source.name}:run{run.pk}:job{run.jobs}"
    job = engine.enqueue(DISCOVER_KIND, {"source": source.name, "run": run.pk}, unique_key=key)
    if job is None:  # a lane that drops when full; the next scheduled discovery resumes it
        log.warning("discovery_continuation_dropped", source=source.name, run_id=run.pk)
        return
    log.info("discovery_continued", source=source.name, run_id=run.pk, next_job_id=job.pk)


def _upsert(
    source: Source, run: DiscoveryRun, items: list[Item], now: datetime
) -> tuple[list[int], list[int]]:
    """Upsert a page's items on (source, url); returns the new and the changed ids.

    Changed means the listing gives a ``lastmod`` different from the one last listed.
    """
    listed = {item.url: item for item in items}  # a URL listed twice: the last one wins
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
    updated: list[Artifact] = []
    for url, artifact in existing.items():
        item = listed[url]
        if item.lastmod and item.lastmod != artifact.lastmod:
            changed.append(artifact.pk)
        artifact.lastmod = item.lastmod or artifact.lastmod
        artifact.title = item.title or artifact.title
        artifact.last_seen_run = run
        artifact.last_seen_at = now
        updated.append(artifact)
    fields = ["lastmod", "title", "last_seen_run", "last_seen_at"]
    Artifact.objects.bulk_update(updated, fields, batch_size=BATCH)
    return sorted(new), sorted(changed)


def _chunks(values: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(values), BATCH):
        yield values[start : start + BATCH]
