"""Discovery against a real site on 127.0.0.1 (demo/site.py): parsing, bounded runs with
continuations, upserts that repeat harmlessly, failures, and resuming an interrupted run."""

from __future__ import annotations

import gzip
from collections import Counter
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from structlog.testing import capture_logs

from demo.site import FixtureSite, w3c
from ingestion import artifacts as artifacts_module
from ingestion import discovery, listings
from ingestion.artifacts import FETCH_KIND
from ingestion.discovery import ListingError, normalize_lastmod, parse_listing, start_discovery
from ingestion.models import Artifact, DiscoveryPage, DiscoveryRun, ReconciliationIssue, Source
from ingestion.sources import DISCOVER_KIND, add_source
from jobs import engine, enqueueing, scheduler
from jobs.exceptions import LaneFull
from jobs.models import Job, State
from jobs.registry import autodiscover
from tests.support.races import decided_in_turn

BASE = "https://example.org"


# --- parsing -----------------------------------------------------------------------------


def test_a_sitemap_index_lists_its_sitemaps_and_a_sitemap_its_urls():
    index = (
        b'<?xml version="1.0"?><sitemapindex xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
        b"<sitemap><loc>https://example.org/s1.xml</loc></sitemap>"
        b"<sitemap><loc> /s2.xml </loc></sitemap></sitemapindex>"
    )
    listing = parse_listing(index, f"{BASE}/sitemap.xml")
    assert (listing.items, listing.pages) == ([], [f"{BASE}/s1.xml", f"{BASE}/s2.xml"])
    urlset = (
        b'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
        b"<url><loc>https://example.org/a#top</loc><lastmod>2026-11-01</lastmod></url>"
        b"<url><loc>mailto:someone@example.org</loc></url>"
        b"<url><loc>https://example.org/b</loc></url></urlset>"
    )
    listing = parse_listing(gzip.compress(urlset), f"{BASE}/s1.xml.gz")
    assert [(item.url, item.lastmod) for item in listing.items] == [
        (f"{BASE}/a", "2026-11-01"),
        (f"{BASE}/b", ""),
    ]


def test_a_gzipped_sitemap_of_countless_empty_members_is_refused_at_once():
    """Thousands of empty gzip members (20 bytes each) inflate to nothing, but fed whole
    each one copied the rest of the file: 10 MiB of them kept a worker busy 107 s."""
    empty = gzip.compress(b"")
    body = empty * (10 * 1024 * 1024 // len(empty))
    with pytest.raises(ListingError, match="more than 10000 gzip members"):
        parse_listing(body, f"{BASE}/many.xml.gz")


def test_a_feed_of_countless_tags_is_refused_before_its_parser_runs():
    nested = b"<div>" * 150_000
    feed = b'<rss version="2.0"><channel><title>t</title><description>' + nested + b"</rss>"
    with pytest.raises(ListingError, match=r"a feed of 1500\d\d tags \(at most 100000"):
        parse_listing(feed, f"{BASE}/deep.xml", "application/rss+xml")


def test_an_entity_declaration_hidden_by_a_declared_encoding_is_refused():
    """``encoding="hz"`` decodes ``<!ENTITY`` into other characters, while a feed parser
    may read the same bytes as ASCII: the bytes are searched too."""
    feed = (
        b'<?xml version="1.0" encoding="hz"?>\n'
        b'<!DOCTYPE rss [<?x ~{?><!ENTITY a "aaaa">]><!--~}-->\n'
        b'<rss version="2.0"><channel><title>t</title><item><title>&a;</title>'
        b"<link>https://example.org/a</link></item></channel></rss>"
    )
    with pytest.raises(ListingError, match="entity declarations are not read"):
        parse_listing(feed, f"{BASE}/f.xml", "text/xml")


def test_a_gzipped_sitemap_file_is_read_member_by_member_and_capped(settings):
    """A .xml.gz of several gzip members (concatenated files) is read whole; one that
    inflates past the fetch cap is refused without inflating it all."""
    head = b'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
    first = head + b"<url><loc>https://example.org/a</loc></url>"
    second = b"<url><loc>https://example.org/b</loc></url></urlset>"
    listing = parse_listing(gzip.compress(first) + gzip.compress(second), f"{BASE}/s.xml.gz")
    assert [item.url for item in listing.items] == [f"{BASE}/a", f"{BASE}/b"]
    settings.HOLDFAST_FETCH_MAX_BYTES = 1024 * 1024
    bomb = gzip.compress(head + b" " * (64 * 1024 * 1024) + b"</urlset>", 9)
    with pytest.raises(ListingError, match="inflates to more than"):
        parse_listing(gzip.compress(b"") + bomb, f"{BASE}/bomb.xml.gz")


def test_feeds_list_entries_and_their_rfc5005_next_page():
    atom = (
        b'<feed xmlns="http://www.w3.org/2005/Atom"><title>t</title>'
        b'<link rel="next" href="/feed?page=2"/>'
        b'<entry><title>One</title><link href="https://example.org/1"/>'
        b"<updated>2026-11-02T10:00:00Z</updated></entry></feed>"
    )
    listing = parse_listing(atom, f"{BASE}/feed")
    assert listing.pages == [f"{BASE}/feed?page=2"]
    assert listing.items == [discovery.Item(f"{BASE}/1", "2026-11-02T10:00:00Z", "One")]
    assert listing.archived is False and listing.complete is False
    rss = (
        b'<rss version="2.0" xmlns:atom="http://www.w3.org/2005/Atom"><channel><title>t</title>'
        b"<item><title>Two</title><link>https://example.org/2</link>"
        b"<pubDate>Mon, 30 Nov 2026 10:00:00 GMT</pubDate></item></channel></rss>"
    )
    listing = parse_listing(rss, f"{BASE}/rss")
    assert listing.pages == []
    assert listing.items == [discovery.Item(f"{BASE}/2", "2026-11-30T10:00:00Z", "Two")]


@pytest.mark.parametrize(
    "body",
    [
        # The "billion laughs": entity expansion must be refused, not attempted.
        b'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
        b'<!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">]>'
        b'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9"><url><loc>&lol2;</loc>'
        b"</url></urlset>",
        b'<?xml version="1.0"?><!DOCTYPE feed [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
        b'<feed xmlns="http://www.w3.org/2005/Atom"><title>&x;</title></feed>',
        b"<html><body>not a listing</body></html>",
        b"<urlset><url><loc>unclosed",
        b"\x1f\x8bnot really gzip",
    ],
)
def test_unsafe_or_unreadable_listings_are_refused(body):
    with pytest.raises(ListingError) as refused:
        parse_listing(body, f"{BASE}/listing.xml")
    assert f"{BASE}/listing.xml" in str(refused.value)


# --- runs ----------------------------------------------------------------------------------


@dataclass
class Hooks:
    """What discovery told the artifact side, per call."""

    discovered: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    retried: list[int] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)


@pytest.fixture
def hooks(monkeypatch) -> Hooks:
    """Discovery's hooks, recorded (instead of the artifact side's fetches)."""
    autodiscover()  # the artifact side connects its hooks on import: before they are replaced
    seen = Hooks()
    monkeypatch.setattr(
        discovery,
        "items_discovered",
        [
            lambda source, new, changed, retry: (
                seen.discovered.append((source.name, new, changed)),
                seen.retried.extend(retry),
            )
        ],
    )
    monkeypatch.setattr(discovery, "run_completed", [lambda run: seen.completed.append(run.pk)])
    return seen


@pytest.fixture
def site() -> Iterator[FixtureSite]:
    with FixtureSite(per_sitemap=3, per_feed_page=3) as running:
        for n in range(1, 8):
            running.add(f"/docs/{n}.html", f"Document {n}", f"text number {n}")
        yield running


def discover(run_worker, name: str) -> DiscoveryRun:
    job, _ = start_discovery(Source.objects.get(name=name))
    assert job is not None
    run_worker()
    return DiscoveryRun.objects.filter(source__name=name).latest("pk")


def artifacts(name: str) -> dict[str, tuple[str, str]]:
    rows = Artifact.objects.filter(source__name=name)
    return {row.url: (row.lastmod, row.title) for row in rows}


def documents(site: FixtureSite) -> dict[str, str]:
    return {
        site.url(path): normalize_lastmod(w3c(doc.lastmod)) for path, doc in site.documents.items()
    }


def make_run(source: Source, pending: list[str], **fields: object) -> DiscoveryRun:
    """A run in progress whose cursor holds ``pending`` (as a job that died left it)."""
    run = DiscoveryRun.objects.create(source=source, known_pages=len(pending), **fields)
    DiscoveryPage.objects.bulk_create([DiscoveryPage(run=run, url=url) for url in pending])
    return run


def pending(run: DiscoveryRun) -> list[str]:
    rows = DiscoveryPage.objects.filter(run=run, state="pending").order_by("pk")
    return list(rows.values_list("url", flat=True))


def test_a_sitemap_index_is_discovered_in_bounded_jobs(site, hooks, run_worker):
    add_source(
        "docs",
        "sitemap",
        site.url("/sitemap.xml"),
        spacing=0,
        max_pages_per_run=2,
        allow_private=True,
    )
    run = discover(run_worker, "docs")
    # Index + 3 sitemaps = 4 listing pages, 2 per job.
    assert (run.state, run.pages, run.items, run.jobs) == ("completed", 4, 7, 2)
    assert pending(run) == [] and run.finished_at >= run.started_at
    found = artifacts("docs")
    assert {url: lastmod for url, (lastmod, _) in found.items()} == documents(site)
    assert set(Artifact.objects.values_list("state", flat=True)) == {"discovered"}
    jobs = list(Job.objects.filter(kind=DISCOVER_KIND).order_by("pk"))
    assert [job.state for job in jobs] == [State.SUCCEEDED, State.SUCCEEDED]
    assert jobs[1].unique_key == f"discover:docs:run{run.pk}:job2"
    assert jobs[1].args == {"source": "docs", "run": run.pk}
    assert jobs[1].result == {"run": run.pk, "pages": 2, "new": 4, "changed": 0, "malformed": 0,
                              "failed_pages": 0, "completed": True, "items": 7}  # fmt: skip
    new_ids = sorted(pk for _, new, _ in hooks.discovered for pk in new)
    assert new_ids == sorted(Artifact.objects.values_list("pk", flat=True))
    assert hooks.completed == [run.pk]
    listing_requests = [r.path for r in site.requests if r.path != "/robots.txt"]
    assert listing_requests == ["/sitemap.xml", "/sitemaps/1.xml", "/sitemaps/2.xml",
                                "/sitemaps/3.xml"]  # fmt: skip


def test_a_paged_feed_is_followed_through_its_next_links(site, hooks, run_worker):
    add_source(
        "news", "feed", site.url("/feed.xml"), spacing=0, max_pages_per_run=1, allow_private=True
    )
    run = discover(run_worker, "news")
    assert (run.state, run.pages, run.items, run.jobs) == ("completed", 3, 7, 3)
    found = artifacts("news")
    assert {url: lastmod for url, (lastmod, _) in found.items()} == documents(site)
    assert found[site.url("/docs/1.html")][1] == "Document 1"
    rss = add_source("rss", "feed", site.url("/rss.xml"), spacing=0, allow_private=True)
    run = discover(run_worker, rss.name)
    assert (run.state, run.pages, run.items, run.jobs) == ("completed", 3, 7, 1)


def test_a_second_run_reports_new_and_changed_items_and_repeats_harmlessly(site, hooks, run_worker):
    add_source(
        "docs",
        "sitemap",
        site.url("/sitemap.xml"),
        spacing=0,
        max_pages_per_run=3,
        allow_private=True,
    )
    first = discover(run_worker, "docs")
    before = {a.url: (a.pk, a.lastmod, a.discovered_at) for a in Artifact.objects.all()}
    hooks.discovered.clear()
    # Nothing changed: the same pages again change nothing but last_seen_run.
    second = discover(run_worker, "docs")
    after = {a.url: (a.pk, a.lastmod, a.discovered_at) for a in Artifact.objects.all()}
    assert after == before
    assert all(new == [] and changed == [] for _, new, changed in hooks.discovered)
    assert set(Artifact.objects.values_list("last_seen_run", flat=True)) == {second.pk}
    # Now one document changes, one goes away, one is added.
    site.change("/docs/2.html", "new text")
    site.remove("/docs/5.html")
    site.add("/docs/8.html", "Document 8", "brand new")
    hooks.discovered.clear()
    third = discover(run_worker, "docs")
    new = [pk for _, ids, _ in hooks.discovered for pk in ids]
    changed = [pk for _, _, ids in hooks.discovered for pk in ids]
    assert [Artifact.objects.get(pk=pk).url for pk in new] == [site.url("/docs/8.html")]
    assert [Artifact.objects.get(pk=pk).url for pk in changed] == [site.url("/docs/2.html")]
    gone = Artifact.objects.get(url=site.url("/docs/5.html"))
    assert gone.last_seen_run_id == second.pk  # kept; reconciliation decides what it means
    assert third.items == 7 and first.items == 7
    assert hooks.completed[-1] == third.pk


def test_a_missing_source_url_fails_the_run_with_one_issue(site, hooks, run_worker):
    add_source("docs", "sitemap", site.url("/sitemaps/9.xml"), spacing=0, allow_private=True)
    run = discover(run_worker, "docs")
    assert run.state == "failed" and site.url("/sitemaps/9.xml") in run.error
    assert "404" in run.error
    job = Job.objects.get(kind=DISCOVER_KIND)
    assert job.state == State.SUCCEEDED and job.attempts == 1  # a defect of the site: no retry
    [issue] = ReconciliationIssue.objects.filter(kind="listing_failed")
    assert (issue.subject, issue.source) == (site.url("/sitemaps/9.xml"), "docs")
    discover(run_worker, "docs")  # fails again: still the one issue
    assert ReconciliationIssue.objects.filter(kind="listing_failed").count() == 1
    # A failed run does not block the next one.
    site.documents.clear()
    Source.objects.filter(name="docs").update(url=site.url("/sitemap.xml"))
    assert discover(run_worker, "docs").state == "completed"


def test_listings_disallowed_by_robots_are_failed_pages_of_the_run(site, hooks, run_worker):
    site.robots_txt = "User-agent: *\nDisallow: /sitemaps/\n"
    add_source("docs", "sitemap", site.url("/sitemap.xml"), spacing=0, allow_private=True)
    run = discover(run_worker, "docs")
    assert (run.state, run.failed_pages) == ("completed", 3) and "robots.txt" in run.error
    assert run.pages == 1  # the index was read; its sitemaps were refused
    assert "/sitemaps/1.xml" not in [request.path for request in site.requests]


def skip_waits() -> None:
    Job.objects.filter(state=State.QUEUED).update(run_at=engine.db_now())


def test_a_server_error_moves_the_page_back_and_the_others_are_read(site, hooks, run_worker):
    add_source(
        "docs",
        "sitemap",
        site.url("/sitemap.xml"),
        spacing=0,
        max_pages_per_run=10,
        allow_private=True,
    )
    site.redirects["/sitemaps/2.xml"] = "/status/503"
    job, _ = start_discovery(Source.objects.get(name="docs"))
    run_worker()
    job.refresh_from_db()
    assert job.state == State.SUCCEEDED and job.attempts == 1
    run = DiscoveryRun.objects.get()
    # The index and sitemaps 1 and 3 are read; 2 waits for a delayed continuation.
    assert (run.state, run.pages, pending(run)) == ("running", 3, [site.url("/sitemaps/2.xml")])
    continuation = Job.objects.filter(kind=DISCOVER_KIND).latest("pk")
    assert continuation.state == State.QUEUED and continuation.run_at > engine.db_now()
    del site.redirects["/sitemaps/2.xml"]
    skip_waits()
    run_worker()
    run.refresh_from_db()
    assert (run.state, run.pages, run.items, run.failed_pages) == ("completed", 4, 7, 0)
    assert [r.path for r in site.requests].count("/sitemaps/1.xml") == 1


def test_an_interrupted_run_is_resumed_not_restarted(site, hooks, run_worker):
    add_source(
        "docs",
        "sitemap",
        site.url("/sitemap.xml"),
        spacing=0,
        max_pages_per_run=2,
        allow_private=True,
    )
    source = Source.objects.get(name="docs")
    run = make_run(source, [site.url("/sitemaps/3.xml")], pages=3, jobs=2)
    job, message = start_discovery(source)
    assert job is not None and f"resumes interrupted discovery run {run.pk}" in message
    second, message = start_discovery(source)
    assert second is None and "already queued" in message
    run_worker()
    run.refresh_from_db()
    assert (run.state, run.pages, run.jobs) == ("completed", 4, 3)
    assert [r.path for r in site.requests if r.path != "/robots.txt"] == ["/sitemaps/3.xml"]
    assert DiscoveryRun.objects.count() == 1


def test_a_scheduled_discovery_leaves_a_run_in_progress_alone(site, hooks, run_worker):
    add_source(
        "docs",
        "sitemap",
        site.url("/sitemap.xml"),
        spacing=0,
        max_pages_per_run=1,
        allow_private=True,
    )
    source = Source.objects.get(name="docs")
    run = make_run(source, [site.url("/sitemaps/1.xml")])
    continuation = enqueueing.enqueue(
        DISCOVER_KIND, {"source": "docs", "run": run.pk}, unique_key="continuation", delay=3600
    )
    scheduled = enqueueing.enqueue(DISCOVER_KIND, {"source": "docs"})
    run_worker()
    scheduled.refresh_from_db()
    assert scheduled.state == State.SUCCEEDED
    assert scheduled.result == {"skipped": f"run {run.pk} is in progress (job {continuation.pk})"}
    assert site.requests == []


def test_a_disabled_source_stops_discovering_between_jobs(site, hooks, run_worker):
    add_source(
        "docs",
        "sitemap",
        site.url("/sitemap.xml"),
        spacing=0,
        max_pages_per_run=1,
        allow_private=True,
    )
    source = Source.objects.get(name="docs")
    run = make_run(source, [site.url("/sitemaps/1.xml")])
    continuation = enqueueing.enqueue(DISCOVER_KIND, {"source": "docs", "run": run.pk})
    Source.objects.filter(pk=source.pk).update(enabled=False)
    run_worker()
    continuation.refresh_from_db()
    assert continuation.state == State.SUCCEEDED
    assert continuation.result == {"skipped": "source disabled"}
    assert site.requests == []
    # The run ends, saying why: left running it showed as in progress for as long as the
    # source stayed disabled, and resumed from its stale cursor once enabled again (audit).
    run.refresh_from_db()
    assert (run.state, run.error) == (
        "failed",
        "the source was disabled while the run was in progress",
    )
    assert run.finished_at is not None


# --- malformed URLs, unexpected errors, loops ----------------------------------------------


def test_a_malformed_url_is_skipped_and_counted_not_fatal():
    urlset = (
        b'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
        b"<url><loc>http://[::1/x</loc></url>"  # urllib: ValueError("Invalid IPv6 URL")
        b"<url><loc>https://example.org/b</loc></url></urlset>"
    )
    listing = parse_listing(urlset, f"{BASE}/s1.xml")
    assert [item.url for item in listing.items] == [f"{BASE}/b"]
    assert listing.malformed == ["http://[::1/x"]
    index = (
        b'<sitemapindex xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
        b"<sitemap><loc>http://[::1/s.xml</loc></sitemap>"
        b"<sitemap><loc>/s2.xml</loc></sitemap></sitemapindex>"
    )
    listing = parse_listing(index, f"{BASE}/sitemap.xml")
    assert (listing.pages, listing.malformed) == ([f"{BASE}/s2.xml"], ["http://[::1/s.xml"])


@pytest.mark.parametrize("bad", ["https://example.org/a\x00b", "https://example.org/\x1b[31m",
                                 "https://example.org/\x7f"])  # fmt: skip
def test_a_listed_url_holding_a_control_character_is_malformed(bad):
    """PostgreSQL's text cannot store a NUL: one such line failed the page's commit, and so
    the page, on every run (audit). A control character or a lone surrogate is skipped."""
    text = f"{bad}\nhttps://example.org/good\n"
    listing = parse_listing(text.encode("utf-8", "surrogatepass"), f"{BASE}/urls.txt")
    assert [item.url for item in listing.items] == [f"{BASE}/good"]
    assert len(listing.malformed) == 1 and "\x00" not in listing.malformed[0]
    robots = f"User-agent: *\nSitemap: {bad}\nSitemap: https://example.org/s.xml\n"
    listing = parse_listing(robots.encode("utf-8", "surrogatepass"), f"{BASE}/robots.txt")
    assert (listing.pages, len(listing.malformed)) == ([f"{BASE}/s.xml"], 1)
    malformed: list[str] = []  # a lone surrogate, as a charref or a codec may give
    assert listings.absolute(BASE, "https://example.org/\ud800", malformed) == ""
    assert malformed == ["https://example.org/\ufffd"]


def test_a_text_sitemap_with_a_nul_in_a_line_completes(site, hooks, run_worker):
    body = site.url("/docs/1.html").encode() + b"\n" + site.url("/a\x00b").encode() + b"\n"
    site.raw["/urls.txt"] = lambda handler: handler.wfile.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )
    add_source("docs", "sitemap", site.url("/urls.txt"), spacing=0, allow_private=True)
    run = discover(run_worker, "docs")
    assert (run.state, run.pages, run.items) == ("completed", 1, 1)
    assert Job.objects.get(kind=DISCOVER_KIND).result["malformed"] == 1
    assert list(artifacts("docs")) == [site.url("/docs/1.html")]


def test_a_run_whose_listing_has_a_malformed_url_completes(site, hooks, run_worker):
    site.extra_urls.append("http://[::1/x")
    add_source(
        "docs",
        "sitemap",
        site.url("/sitemap.xml"),
        spacing=0,
        max_pages_per_run=10,
        allow_private=True,
    )
    run = discover(run_worker, "docs")
    assert (run.state, run.pages, run.items) == ("completed", 4, 7)
    job = Job.objects.get(kind=DISCOVER_KIND)
    assert job.state == State.SUCCEEDED and job.attempts == 1
    assert job.result["malformed"] == 1


def test_an_unexpected_error_on_a_pages_last_attempt_fails_the_run(
    site, hooks, run_worker, monkeypatch
):
    def broken(source, new, changed, retry):
        raise RuntimeError("the artifact side is broken")

    monkeypatch.setattr(discovery, "items_discovered", [broken])
    add_source(
        "docs",
        "sitemap",
        site.url("/sitemap.xml"),
        spacing=0,
        max_pages_per_run=10,
        allow_private=True,
    )
    job, _ = start_discovery(Source.objects.get(name="docs"))
    Job.objects.filter(pk=job.pk).update(max_attempts=2)
    run_worker()
    job.refresh_from_db()
    run = DiscoveryRun.objects.get()
    assert (job.state, run.state) == (State.QUEUED, "running")  # an early attempt: retried
    assert pending(run)[0] == site.url("/sitemaps/1.xml")
    Job.objects.filter(pk=job.pk).update(run_at=engine.db_now())  # skip the backoff
    run_worker()
    job.refresh_from_db()
    run.refresh_from_db()
    assert job.state == State.DEAD
    assert run.state == "failed" and run.finished_at is not None
    assert site.url("/sitemaps/1.xml") in run.error
    assert "RuntimeError: the artifact side is broken" in run.error
    # The run is not left running with that page at its head: the next discovery is new.
    monkeypatch.setattr(discovery, "items_discovered", [])
    assert discover(run_worker, "docs").state == "completed"


def test_feed_pages_that_link_to_each_other_are_read_once_each(
    site, hooks, run_worker, monkeypatch
):
    monkeypatch.setattr(discovery, "MAX_RUN_PAGES", 20)  # without the fix: fails at 20 pages
    site.per_feed_page = 4  # 7 documents: two pages
    site.feed_loops = True  # page 1 -> page 2 -> page 1
    add_source(
        "news",
        "feed",
        site.url("/feed.xml?page=1"),
        spacing=0,
        max_pages_per_run=10,
        allow_private=True,
    )
    run = discover(run_worker, "news")
    assert (run.state, run.pages, run.items, run.jobs) == ("completed", 2, 7, 1), run.error
    pages = DiscoveryPage.objects.filter(run=run).order_by("pk")
    assert list(pages.values_list("url", "state")) == [
        (site.url("/feed.xml?page=1"), "read"),
        (site.url("/feed.xml?page=2"), "read"),
    ]
    listing_requests = [r.path for r in site.requests if r.path != "/robots.txt"]
    assert listing_requests == ["/feed.xml?page=1", "/feed.xml?page=2"]


# --- manual and scheduled discoveries -------------------------------------------------------


def test_a_scheduled_discovery_gives_way_to_a_manual_one(site, hooks, run_worker):
    add_source(
        "docs",
        "sitemap",
        site.url("/sitemap.xml"),
        spacing=0,
        max_pages_per_run=10,
        allow_private=True,
    )
    manual, message = start_discovery(Source.objects.get(name="docs"))
    assert manual is not None and message == f"job {manual.pk} discovers 'docs'"
    # The manual job waits out a backoff; the schedule's slot comes up meanwhile.
    Job.objects.filter(pk=manual.pk).update(run_at=engine.db_now() + timedelta(hours=1))
    first_slot = scheduler.run_now("discover:docs")
    run_worker()
    first_slot.refresh_from_db()
    assert first_slot.state == State.SUCCEEDED
    assert first_slot.result == {"skipped": f"discovery job {manual.pk} is already queued"}
    assert site.requests == [] and not DiscoveryRun.objects.exists()
    # A slot queued behind the manual job runs after it, and finds the source just read.
    # A second earlier: SQLite's now() (enqueue) has millisecond precision, db_now() has
    # microseconds, so "now" for both could put the later slot first within one millisecond.
    Job.objects.filter(pk=manual.pk).update(run_at=engine.db_now() - timedelta(seconds=1))
    second_slot = scheduler.run_now("discover:docs")
    run_worker()
    manual.refresh_from_db()
    second_slot.refresh_from_db()
    run = DiscoveryRun.objects.get()
    assert manual.state == State.SUCCEEDED and run.state == "completed"
    assert second_slot.result == {"skipped": f"run {run.pk} completed after this job was enqueued"}
    assert [r.path for r in site.requests].count("/sitemap.xml") == 1


def test_a_start_that_lost_the_race_does_not_report_a_new_job(site, hooks, transactional_db):
    add_source("docs", "sitemap", site.url("/sitemap.xml"), spacing=0, allow_private=True)
    source = Source.objects.get(name="docs")
    first, second = decided_in_turn(lambda: start_discovery(source))
    job, _ = first
    assert job is not None
    assert second == (
        None,
        f"discovery of 'docs' is already queued (job {job.pk}); nothing enqueued",
    )
    assert Job.objects.filter(kind=DISCOVER_KIND).count() == 1


def _urlset(*entries: tuple[str, str]) -> bytes:
    body = "".join(
        f"<url><loc>{url}</loc>" + (f"<lastmod>{lastmod}</lastmod>" if lastmod else "") + "</url>"
        for url, lastmod in entries
    )
    return f'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">{body}</urlset>'.encode()


def test_an_item_listed_without_a_lastmod_keeps_the_one_stored(site, hooks, run_worker):
    """Erased, the same date listed again later read as a change, and a URL in two
    sitemaps (one without dates) was "changed", so refetched, on every run (audit)."""
    url = site.url("/docs/1.html")
    add_source("docs", "sitemap", site.url("/s.xml"), spacing=0, allow_private=True)
    for lastmod in ("2026-01-01", "", "2026-01-01"):
        site.replies["/s.xml"] = (200, "application/xml", _urlset((url, lastmod)))
        assert discover(run_worker, "docs").state == "completed"
        assert Artifact.objects.get(url=url).lastmod == "2026-01-01"
    site.replies["/s.xml"] = (200, "application/xml", _urlset((url, "2026-01-01"), (url, "")))
    assert discover(run_worker, "docs").state == "completed"
    assert Artifact.objects.get(url=url).lastmod == "2026-01-01"
    assert not [changed for _, _, changed in hooks.discovered if changed]


# --- a full lane: the run and its fetches go on (audit) ------------------------------------


def _lanes(max_queued: int | None = None, on_full: str = "drop", fetch: dict | None = None):
    discovery_lane: dict = {"kinds": [DISCOVER_KIND]}
    if max_queued is not None:
        discovery_lane.update(max_queued=max_queued, on_full=on_full)
    return {"default": {}, "disc": discovery_lane, "fetch": fetch or {"kinds": [FETCH_KIND]}}


def _listing_requests(site: FixtureSite) -> Counter:
    return Counter(r.path for r in site.requests if r.path.startswith("/sitemap"))


@pytest.mark.parametrize("on_full", ["drop", "reject"])
def test_a_full_discovery_lane_does_not_stop_a_runs_continuation(
    site, settings, run_worker, on_full
):
    """Dropped, the continuation left the run with no job until the next scheduled slot (a
    day); refused (LaneFull), it rolled the page back, the retry fetched it again, and the
    job died. A continuation carries on admitted work: max_queued does not refuse it."""
    autodiscover()
    settings.HOLDFAST_LANES = _lanes()
    add_source("docs", "sitemap", site.url("/sitemap.xml"), spacing=0, max_pages_per_run=1,
               allow_private=True)  # fmt: skip
    job, _ = start_discovery(Source.objects.get(name="docs"))
    filler = enqueueing.enqueue(DISCOVER_KIND, {"source": "docs"}, delay=3600, unique_key="x")
    settings.HOLDFAST_LANES = _lanes(max_queued=1, on_full=on_full)  # full: the filler
    run_worker(lanes=["disc"])
    job.refresh_from_db()
    run = DiscoveryRun.objects.get()
    assert (job.state, run.state, run.pages, run.items) == (State.SUCCEEDED, "completed", 4, 7)
    assert set(_listing_requests(site).values()) == {1}  # no page read twice
    assert Job.objects.filter(kind=DISCOVER_KIND, state=State.SUCCEEDED).count() == 4
    with pytest.raises(LaneFull) if on_full == "reject" else nullcontext():
        assert enqueueing.enqueue(DISCOVER_KIND, {"source": "other"}) is None  # new work is
    filler.refresh_from_db()
    assert filler.state == State.QUEUED


@pytest.mark.parametrize("on_full", ["drop", "reject"])
def test_fetches_a_full_lane_refuses_are_due_for_the_refresher(site, settings, run_worker, on_full):
    """Dropped, a page's fetches were never enqueued again (a later run lists the items as
    neither new nor changed, and the refresher skipped them); refused, the page rolled
    back. Now the page commits and its artifacts are due at once for the refresher."""
    autodiscover()
    settings.HOLDFAST_LANES = _lanes()
    add_source("docs", "sitemap", site.url("/sitemap.xml"), spacing=0, allow_private=True)
    filler = enqueueing.enqueue(FETCH_KIND, {"artifact_id": 10**9}, delay=3600, unique_key="f")
    settings.HOLDFAST_LANES = _lanes(
        fetch={"kinds": [FETCH_KIND], "max_queued": 1, "on_full": on_full}
    )
    with capture_logs() as logs:
        run = discover(run_worker, "docs")
    assert (run.state, run.items) == ("completed", 7)
    assert Job.objects.filter(kind=FETCH_KIND).count() == 1  # the filler alone
    deferred = [e["count"] for e in logs if e["event"] == "artifact_fetches_deferred"]
    assert sum(deferred) == 7
    Job.objects.filter(pk=filler.pk).delete()  # the lane has room again
    settings.HOLDFAST_LANES = _lanes()
    assert artifacts_module.refresh_due(100) == 7
    assert Job.objects.filter(kind=FETCH_KIND).count() == 7
