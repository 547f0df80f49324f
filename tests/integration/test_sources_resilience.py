"""A flaky or sloppy site never costs a document (issue 14), against a site on 127.0.0.1:
outages outlasting retries, a lastmod that moves while a fetch is in flight, rolling
feeds, failing child sitemaps, listings that are the site's own fault, the blob store."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from demo.site import FixtureSite, w3c
from ingestion import artifacts, blobs, discovery, http
from ingestion.artifacts import FETCH_KIND
from ingestion.discovery import start_discovery
from ingestion.models import (
    Artifact,
    ArtifactText,
    DiscoveryPage,
    DiscoveryRun,
    IngestedSubmission,
    IssueKind,
    Lab,
    ReconciliationIssue,
    Source,
)
from ingestion.search import search
from jobs import engine, enqueue, refresh
from jobs.models import Job, State

from .helpers import run, run_json

pytestmark = pytest.mark.usefixtures("blob_dir")

ATOM = "http://www.w3.org/2005/Atom"


@pytest.fixture
def site() -> Iterator[FixtureSite]:
    with FixtureSite(per_sitemap=2) as running:
        for n in range(1, 7):
            running.add(f"/docs/{n}.html", f"Document {n}", f"lighthouse number {n}")
        yield running


def make_source(site: FixtureSite, url: str = "/sitemap.xml", kind: str = "sitemap") -> Source:
    return Source.objects.create(
        name="local", kind=kind, url=site.url(url), schedule="0 3 * * *", spacing_seconds=0,
        allow_private=True, max_pages_per_run=50,
    )  # fmt: skip


def discover(run_worker, source: Source) -> DiscoveryRun:
    job, _ = start_discovery(source)
    assert job is not None
    run_worker()
    return DiscoveryRun.objects.filter(source=source).latest("pk")


def skip_waits() -> None:
    """Time travel for the queue: every queued job is due now (backoffs, delays)."""
    Job.objects.filter(state=State.QUEUED).update(run_at=engine.db_now())


def issues(kind: str, subject: str | None = None, status: str | None = None):
    found = ReconciliationIssue.objects.filter(kind=kind).order_by("pk")
    if subject is not None:
        found = found.filter(subject=subject)
    return list(found if status is None else found.filter(status=status))


def urls_found(query: str) -> set[str]:
    return {hit.url for hit in search(query, limit=100)}


# --- transient failures never cost a document ---------------------------------------------


def test_an_outage_outlasting_every_retry_keeps_the_document_and_resolves_itself(site, run_worker):
    """Eight attempts over about ten minutes (time-travelled) of 503: the document stays
    fetched and searchable, its refresh is put off, ``fetch_failing`` opens; the first
    good fetch after the outage resolves it."""
    source = make_source(site)
    discover(run_worker, source)
    doc = Artifact.objects.get(url=site.url("/docs/1.html"))
    assert doc.state == "fetched" and doc.url in urls_found("lighthouse")
    body = doc.sha256

    site.replies["/docs/1.html"] = (503, "text/plain", b"down for maintenance")
    enqueue(FETCH_KIND, {"artifact_id": doc.pk}, unique_key=f"fetch:{doc.pk}")
    for _ in range(20):
        run_worker()
        job = Job.objects.filter(kind=FETCH_KIND, args__artifact_id=doc.pk).latest("pk")
        if job.state != State.QUEUED:
            break
        skip_waits()
    assert (job.state, job.attempts, job.result["outcome"]) == (State.SUCCEEDED, 8, "failing")
    doc.refresh_from_db()
    assert (doc.state, doc.sha256, doc.failures) == ("fetched", body, 1)
    assert timezone.now() + timedelta(minutes=50) < doc.refresh_after
    assert doc.url in urls_found("lighthouse")  # still searchable
    [failing] = issues(IssueKind.FETCH_FAILING, doc.url, "open")
    assert failing.details["kept_sha256"] == body and failing.details["http_status"] == 503
    assert not issues(IssueKind.PERMANENT_FETCH_FAILURE) and not issues(IssueKind.GONE_AT_SOURCE)

    del site.replies["/docs/1.html"]
    Artifact.objects.filter(pk=doc.pk).update(refresh_after=timezone.now() - timedelta(minutes=1))
    refresher = next(item for item in refresh.registered() if item.name == "artifacts")
    assert refresher.func(refresher.batch) == 1  # the backoff passed: the refresher retries
    run_worker()
    doc.refresh_from_db()
    assert (doc.state, doc.failures) == ("fetched", 0)
    [failing] = issues(IssueKind.FETCH_FAILING, doc.url)
    assert failing.status == "resolved" and failing.resolved_by == "holdfast"


def test_the_failure_backoff_doubles_up_to_a_day():
    assert [artifacts.failure_backoff(n).total_seconds() / 3600 for n in (1, 2, 3, 5, 6, 40)] == [
        1, 2, 4, 16, 24, 24,
    ]  # fmt: skip


@pytest.mark.parametrize("reply", ["403", "too large"])
def test_a_permanent_failure_of_a_fetched_document_keeps_it_searchable(
    site, run_worker, settings, reply
):
    """Only a 404/410 says a document is gone: a 403 or an oversized body on a refresh
    kills the job and opens ``permanent_fetch_failure``, but the last good body stays
    fetched and searchable, retried with the failure backoff; a good fetch resolves it."""
    source = make_source(site)
    discover(run_worker, source)
    doc = Artifact.objects.get(url=site.url("/docs/1.html"))
    body = doc.sha256
    if reply == "403":
        site.replies["/docs/1.html"] = (403, "text/plain", b"no")
    else:
        site.replies["/docs/1.html"] = (200, "text/html", b"<p>x</p>" * 100_000)
        settings.HOLDFAST_FETCH_MAX_BYTES = 100_000
    enqueue(FETCH_KIND, {"artifact_id": doc.pk}, unique_key=f"fetch:{doc.pk}")
    run_worker()
    job = Job.objects.filter(kind=FETCH_KIND, args__artifact_id=doc.pk).latest("pk")
    assert job.state == State.DEAD
    doc.refresh_from_db()
    assert (doc.state, doc.sha256, doc.failures) == ("fetched", body, 1)
    assert timezone.now() + timedelta(minutes=50) < doc.refresh_after
    assert doc.url in urls_found("lighthouse")
    [issue] = issues(IssueKind.PERMANENT_FETCH_FAILURE, doc.url, "open")
    del site.replies["/docs/1.html"]
    settings.HOLDFAST_FETCH_MAX_BYTES = 10 * 1024 * 1024
    enqueue(FETCH_KIND, {"artifact_id": doc.pk}, unique_key=f"fetch:{doc.pk}")
    run_worker()
    doc.refresh_from_db()
    assert (doc.state, doc.failures) == ("fetched", 0)
    issue.refresh_from_db()
    assert issue.status == "resolved"


def test_a_failed_artifact_the_source_still_lists_is_fetched_again_by_discovery(site, run_worker):
    source = make_source(site)
    site.replies["/docs/2.html"] = (403, "text/plain", b"no")
    discover(run_worker, source)
    doc = Artifact.objects.get(url=site.url("/docs/2.html"))
    assert doc.state == "failed"
    del site.replies["/docs/2.html"]
    discover(run_worker, source)  # still listed, unchanged lastmod: fetched again all the same
    doc.refresh_from_db()
    assert doc.state == "fetched"
    [issue] = issues(IssueKind.PERMANENT_FETCH_FAILURE, doc.url)
    assert issue.status == "resolved"


def test_a_lastmod_listed_while_a_fetch_is_in_flight_belongs_to_the_next_body(
    site, run_worker, monkeypatch
):
    """Discovery lists a new lastmod while the fetch of the old body is on the wire: the
    old body is recorded with the old lastmod and the artifact is due again at once, so
    the new body is announced, not a false ``content_changed_unannounced``."""
    source = make_source(site)
    discover(run_worker, source)
    doc = Artifact.objects.get(url=site.url("/docs/3.html"))
    old_lastmod = doc.lastmod
    real_get = http.get

    def get_while_discovery_lists_a_change(source, url, **kwargs):
        response = real_get(source, url, **kwargs)  # the old body, already received
        if url == doc.url:
            site.change("/docs/3.html", "rewritten lighthouse")
            new = discovery.normalize_lastmod(w3c(site.documents["/docs/3.html"].lastmod))
            Artifact.objects.filter(pk=doc.pk).update(lastmod=new)  # as a discovery page does
        return response

    monkeypatch.setattr(http, "get", get_while_discovery_lists_a_change)
    Artifact.objects.filter(pk=doc.pk).update(etag="", last_modified="")  # a full GET
    enqueue(FETCH_KIND, {"artifact_id": doc.pk}, unique_key=f"fetch:{doc.pk}")
    run_worker()
    monkeypatch.setattr(http, "get", real_get)
    doc.refresh_from_db()
    assert doc.fetched_lastmod == old_lastmod != doc.lastmod
    assert doc.refresh_after <= timezone.now()  # due again now, not in 28 days
    refresher = next(item for item in refresh.registered() if item.name == "artifacts")
    assert refresher.func(refresher.batch) == 1
    run_worker()
    doc.refresh_from_db()
    assert doc.fetched_lastmod == doc.lastmod
    assert doc.url in urls_found("rewritten")
    assert not issues(IssueKind.CONTENT_CHANGED_UNANNOUNCED)


def test_a_changed_body_under_an_unchanged_known_lastmod_is_still_flagged(site, run_worker):
    source = make_source(site)
    discover(run_worker, source)
    doc = Artifact.objects.get(url=site.url("/docs/4.html"))
    lastmod = site.documents["/docs/4.html"].lastmod
    site.change("/docs/4.html", "silently changed", lastmod=lastmod)
    assert run_json("force_refresh", "--artifact", str(doc.pk))["enqueued"] == 1
    run_worker()
    assert len(issues(IssueKind.CONTENT_CHANGED_UNANNOUNCED, doc.url)) == 1


# --- reconciliation without false alarms -----------------------------------------------------


def window_feed(site: FixtureSite, numbers: list[int], complete: bool = False) -> bytes:
    entries = "".join(
        f"<entry><title>Document {n}</title><link href='{site.url(f'/docs/{n}.html')}'/>"
        f"<id>{n}</id><updated>{w3c(site.documents[f'/docs/{n}.html'].lastmod)}</updated></entry>"
        for n in numbers
    )
    history = "xmlns:fh='http://purl.org/syndication/history/1.0'" if complete else ""
    flag = "<fh:complete/>" if complete else ""
    return f"<feed xmlns='{ATOM}' {history}><title>w</title>{flag}{entries}</feed>".encode()


def test_items_scrolling_off_a_rolling_feed_are_not_missing(site, run_worker):
    """A feed is a window: what scrolls off stays, refreshed on its TTL (a 404/410 then
    says it is gone). Only a complete feed (RFC 5005 fh:complete) lists everything, so
    only there is an unlisted item missing."""
    source = make_source(site, "/window.xml", kind="feed")
    site.replies["/window.xml"] = (200, "application/atom+xml", window_feed(site, [1, 2, 3]))
    discover(run_worker, source)
    site.replies["/window.xml"] = (200, "application/atom+xml", window_feed(site, [2, 3, 4]))
    second = discover(run_worker, source)
    assert (second.state, second.exhaustive) == ("completed", False)
    assert not issues(IssueKind.MISSING_FROM_SOURCE)
    first = Artifact.objects.get(url=site.url("/docs/1.html"))
    assert first.state == "fetched" and first.url in urls_found("lighthouse")

    site.replies["/window.xml"] = (
        200, "application/atom+xml", window_feed(site, [2, 3, 4], complete=True)
    )  # fmt: skip
    third = discover(run_worker, source)
    assert third.exhaustive is True
    assert [issue.subject for issue in issues(IssueKind.MISSING_FROM_SOURCE)] == [first.url]


def test_a_404_child_sitemap_is_an_issue_and_the_other_children_are_read(site, run_worker):
    source = make_source(site)
    first = discover(run_worker, source)
    assert first.failed_pages == 0 and Artifact.objects.count() == 6
    site.redirects["/sitemaps/2.xml"] = "/status/404"
    second = discover(run_worker, source)
    assert (second.state, second.pages, second.failed_pages) == ("completed", 3, 1)
    listed = set(Artifact.objects.filter(last_seen_run=second).values_list("url", flat=True))
    assert listed == {site.url(f"/docs/{n}.html") for n in (1, 2, 5, 6)}  # children 1 and 3
    [issue] = issues(IssueKind.LISTING_FAILED)
    assert issue.subject == site.url("/sitemaps/2.xml") and "404" in issue.details["error"]
    # The run did not see everything: the items of the failed child are not "missing".
    assert not issues(IssueKind.MISSING_FROM_SOURCE)
    job = Job.objects.filter(kind="ingestion.discover_source").latest("pk")
    assert (job.state, job.attempts) == (State.SUCCEEDED, 1)
    # The child comes back: its issue resolves itself.
    del site.redirects["/sitemaps/2.xml"]
    third = discover(run_worker, source)
    assert (third.failed_pages, issues(IssueKind.LISTING_FAILED)[0].status) == (0, "resolved")


def test_a_child_failing_transiently_on_every_attempt_still_lets_the_run_end(site, run_worker):
    source = make_source(site)
    site.redirects["/sitemaps/1.xml"] = "/status/503"
    start_discovery(source)
    for _ in range(discovery.PAGE_TRIES + 3):
        run_worker()
        run_ = DiscoveryRun.objects.get(source=source)
        if run_.state != "running":
            break
        skip_waits()
    assert (run_.state, run_.pages, run_.failed_pages) == ("completed", 3, 1)
    assert site.requests_to("/sitemaps/1.xml").__len__() == discovery.PAGE_TRIES
    listed = set(Artifact.objects.filter(last_seen_run=run_).values_list("url", flat=True))
    assert listed == {site.url(f"/docs/{n}.html") for n in (3, 4, 5, 6)}
    [issue] = issues(IssueKind.LISTING_FAILED)
    assert issue.details["transient"] is True and issue.details["tries"] == discovery.PAGE_TRIES
    jobs = Job.objects.filter(kind="ingestion.discover_source")
    assert set(jobs.values_list("state", flat=True)) == {State.SUCCEEDED}  # none dead


def test_a_listing_that_is_the_sites_fault_is_recorded_once_not_retried(site, run_worker):
    source = make_source(site)
    bad = '<?xml version="1.0" encoding="x-made-up"?><urlset><url><loc>caf\xe9</loc>'
    site.replies["/sitemaps/3.xml"] = (200, "application/xml", bad.encode("iso-8859-1"))
    for _ in range(2):
        finished = discover(run_worker, source)
        assert (finished.state, finished.failed_pages) == ("completed", 1)
    assert len(site.requests_to("/sitemaps/3.xml")) == 2  # once per run, never retried
    [issue] = issues(IssueKind.LISTING_FAILED)
    assert "unknown encoding" in issue.details["error"] and issue.details["transient"] is False


def test_a_url_too_long_to_index_is_skipped_and_the_page_is_read(site, run_worker):
    """2,000 characters of CJK are 6,000 bytes: past what a PostgreSQL index takes. The
    entry is skipped as malformed; the page, and the run, go on."""
    long_url = site.url("/docs/" + "".join(chr(0x4E00 + (n * 7919) % 20000) for n in range(1960)))
    assert len(long_url) <= 2000 < len(long_url.encode())
    body = (
        '<?xml version="1.0" encoding="UTF-8"?><urlset>'
        f"<url><loc>{long_url}</loc></url><url><loc>{site.url('/docs/1.html')}</loc></url>"
        "</urlset>"
    ).encode()
    site.replies["/long.xml"] = (200, "application/xml", body)
    index = (
        '<?xml version="1.0"?><sitemapindex>'
        f"<sitemap><loc>{long_url}.xml</loc></sitemap>"
        f"<sitemap><loc>{site.url('/long.xml')}</loc></sitemap></sitemapindex>"
    ).encode()
    site.replies["/long-index.xml"] = (200, "application/xml", index)
    finished = discover(run_worker, make_source(site, "/long-index.xml"))
    assert (finished.state, finished.pages, finished.failed_pages) == ("completed", 2, 0)
    assert list(Artifact.objects.values_list("url", flat=True)) == [site.url("/docs/1.html")]


def test_a_truncated_child_gives_its_urls_and_the_run_concludes_nothing_missing(site, run_worker):
    source = make_source(site)
    discover(run_worker, source)
    body = site.sitemap(2).encode()
    site.replies["/sitemaps/2.xml"] = (200, "application/xml", body[: body.index(b"</url>") + 6])
    second = discover(run_worker, source)
    listed = set(Artifact.objects.filter(last_seen_run=second).values_list("url", flat=True))
    assert site.url("/docs/3.html") in listed and site.url("/docs/4.html") not in listed
    assert second.failed_pages == 1 and not issues(IssueKind.MISSING_FROM_SOURCE)
    [issue] = issues(IssueKind.LISTING_FAILED)
    assert issue.details["recovered"] == 1


def test_text_sitemaps_and_robots_txt_sitemap_lines_are_read(site, run_worker):
    site.robots_txt = f"User-agent: *\nDisallow: /private/\nSitemap: {site.url('/urls.txt')}\n"
    lines = "\n".join(site.url(f"/docs/{n}.html") for n in (1, 2)) + "\n"
    site.replies["/urls.txt"] = (200, "text/plain", lines.encode())
    source = make_source(site, "/robots.txt")
    finished = discover(run_worker, source)
    assert (finished.state, finished.pages, finished.items) == ("completed", 2, 2)
    assert Artifact.objects.filter(state="fetched").count() == 2


def test_a_prev_archive_feed_is_read_through_its_archives(site, run_worker):
    archive = window_feed(site, [1, 2]).replace(b"<title>w</title>", b"<title>a</title>")
    current = window_feed(site, [3]).replace(
        b"<title>w</title>",
        b"<title>w</title><link rel='prev-archive' href='/archive/1'/>",
    )
    site.replies["/feed-current.xml"] = (200, "application/atom+xml", current)
    site.replies["/archive/1"] = (200, "application/atom+xml", archive)
    source = make_source(site, "/feed-current.xml", kind="feed")
    finished = discover(run_worker, source)
    assert (finished.state, finished.pages, finished.items) == ("completed", 2, 3)
    assert finished.exhaustive is True  # an archived feed lists everything it ever had


def test_a_large_index_is_read_without_rewriting_the_run_on_every_page(site, run_worker):
    """Each page writes its own row: no statement of a page's commit grows with the index
    (the old cursor and visited lists were rewritten whole: quadratic for 50,000)."""
    assert discovery.MAX_RUN_PAGES > 50_000
    children = 60
    index = "".join(
        f"<sitemap><loc>{site.url(f'/s/{n}.xml')}</loc></sitemap>" for n in range(children)
    )
    site.replies["/big.xml"] = (
        200, "application/xml",
        f"<sitemapindex xmlns='http://www.sitemaps.org/schemas/sitemap/0.9'>{index}</sitemapindex>".encode(),
    )  # fmt: skip
    for n in range(children):
        loc = site.url("/docs/1.html")
        site.replies[f"/s/{n}.xml"] = (
            200,
            "application/xml",
            f"<urlset><url><loc>{loc}</loc></url></urlset>".encode(),
        )
    source = make_source(site, "/big.xml")
    Source.objects.filter(pk=source.pk).update(max_pages_per_run=children + 1)
    with CaptureQueriesContext(connection) as queries:
        finished = discover(run_worker, source)
    assert (finished.state, finished.pages) == ("completed", children + 1)
    run_updates = [
        q["sql"] for q in queries.captured_queries if 'UPDATE "discovery_runs"' in q["sql"]
    ]
    assert run_updates and max(len(sql) for sql in run_updates) < 2000
    assert DiscoveryPage.objects.filter(run=finished).count() == children + 1


# --- the blob store ---------------------------------------------------------------------------


def test_gc_blobs_removes_only_unreferenced_old_blobs_and_stale_temporary_files(
    blob_dir, transactional_db
):
    source = Source.objects.create(
        name="s", kind="sitemap", url="https://example.org/", schedule="@daily"
    )
    kept_by_artifact = blobs.store(b"an artifact's body")
    Artifact.objects.create(source=source, url="https://example.org/a", sha256=kept_by_artifact)
    kept_by_spool = blobs.store(b"a spool log excerpt")
    lab = Lab.objects.create(name="lab")
    IngestedSubmission.objects.create(
        hash="f" * 64,
        file_name="x.json",
        lab=lab,
        submitted_at=timezone.now(),
        log_excerpt=kept_by_spool,
    )
    orphan = blobs.store(b"nothing references me")
    young_orphan = blobs.store(b"stored a moment ago, its row not committed yet")
    long_ago = time.time() - 3 * 86400
    for digest in (kept_by_artifact, kept_by_spool, orphan):
        os.utime(blobs.path_for(digest), (long_ago, long_ago))
    stale_tmp = blobs.path_for(orphan).parent / ".tmp-crashed"
    stale_tmp.write_bytes(b"half a blob")
    os.utime(stale_tmp, (long_ago, long_ago))

    dry = run_json("gc_blobs", "--dry-run")
    assert dry == {"removed": 1, "removed_bytes": 21, "referenced": 2, "kept_young": 1,
                   "temporary_removed": 1, "dry_run": True}  # fmt: skip
    assert blobs.exists(orphan) and stale_tmp.exists()
    assert "removed 1 unreferenced blob" in run("gc_blobs")
    assert not blobs.exists(orphan) and not stale_tmp.exists()
    assert all(blobs.exists(d) for d in (kept_by_artifact, kept_by_spool, young_orphan))
    # Storing an old unreferenced blob again makes it young: a collection keeps it.
    again = blobs.store(b"nothing references me")
    assert run_json("gc_blobs")["removed"] == 0 and blobs.exists(again)


def test_gc_blobs_keeps_a_blob_only_an_indexed_text_references(blob_dir, transactional_db):
    source = Source.objects.create(
        name="s", kind="sitemap", url="https://example.org/", schedule="@daily"
    )
    new_body = blobs.store(b"the body fetched since, not indexed yet")
    indexed = blobs.store(b"the body the searchable text came from")
    artifact = Artifact.objects.create(source=source, url="https://example.org/a", sha256=new_body)
    ArtifactText.objects.create(artifact=artifact, title="t", text="x", sha256=indexed)
    long_ago = time.time() - 3 * 86400
    for digest in (new_body, indexed):
        os.utime(blobs.path_for(digest), (long_ago, long_ago))
    assert run_json("gc_blobs")["removed"] == 0
    assert blobs.exists(new_body) and blobs.exists(indexed)


def test_gc_blobs_racing_a_store_of_the_same_bytes_never_loses_the_blob(blob_dir, monkeypatch):
    """A fetch stores bytes an old, unreferenced blob already holds (only its age is
    refreshed) just as a collection is about to delete it: whoever goes first, the blob
    is there when the store returns."""
    data = b"an old body that a fetch is storing again"
    digest = blobs.store(data)
    long_ago = time.time() - 3 * 86400
    os.utime(blobs.path_for(digest), (long_ago, long_ago))
    real_unlink = Path.unlink
    racing: list[threading.Thread] = []

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name == digest and not racing:  # the collection's last moment: a store now
            racing.append(threading.Thread(target=blobs.store, args=(data,)))
            racing[0].start()
            racing[0].join(timeout=1.0)  # blocked on the shard lock, or done already
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(blobs, "references", [])
    blobs.collect()
    racing[0].join(timeout=10)
    assert not racing[0].is_alive()
    assert blobs.exists(digest) and blobs.read(digest) == data


def test_new_shard_directories_are_fsynced_into_their_parents(blob_dir, monkeypatch):
    synced: list[str] = []
    real = blobs.fsync_dir
    monkeypatch.setattr(blobs, "fsync_dir", lambda path: (synced.append(str(path)), real(path)))
    digest = blobs.store(b"first blob in a new shard")
    shard = blobs.path_for(digest).parent
    assert str(shard.parent.parent) in synced  # <root> got the new <h[:2]>
    assert str(shard.parent) in synced  # <h[:2]> got the new <h[2:4]>
    assert str(shard) in synced  # the shard got the blob
