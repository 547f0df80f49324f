"""Reconciliation issues from real discovery runs and fetches against a site on 127.0.0.1.

Each cycle enqueues a discovery of the source and runs an in-process burst worker until
nothing is runnable: the discovery job, the fetch jobs its hooks enqueue, and indexing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.test import Client

from demo.site import FixtureSite
from ingestion.artifacts import FETCH_KIND
from ingestion.discovery import start_discovery
from ingestion.models import Artifact, DiscoveryRun, IssueKind, ReconciliationIssue, Source
from ingestion.reconciliation import record, resolve
from jobs.models import Job
from ops import tokens

from .helpers import exit_code, run_json

PAGES = {"/docs/a.html": "A", "/docs/b.html": "B", "/docs/c.html": "C"}

pytestmark = pytest.mark.usefixtures("blob_dir")


@pytest.fixture
def site() -> Iterator[FixtureSite]:
    with FixtureSite() as site:
        for path, title in PAGES.items():
            site.add(path, title, f"text of {title}")
        yield site


@pytest.fixture
def source(site: FixtureSite, transactional_db: None) -> Source:
    return Source.objects.create(
        allow_private=True,
        name="local",
        kind="sitemap",
        url=site.url("/sitemap.xml"),
        schedule="0 3 * * *",
        spacing_seconds=0,
    )


def discover(run_worker, source: Source) -> DiscoveryRun:
    """One complete discovery cycle, fetches included; returns the run."""
    job, _ = start_discovery(source)
    assert job is not None
    run_worker()
    run = DiscoveryRun.objects.filter(source=source).latest("pk")
    assert run.state == "completed", run.error
    return run


def artifact(site: FixtureSite, path: str) -> Artifact:
    return Artifact.objects.get(url=site.url(path))


def issues(kind: str, site: FixtureSite, path: str) -> list[ReconciliationIssue]:
    subject = site.url(path)
    return list(ReconciliationIssue.objects.filter(kind=kind, subject=subject).order_by("pk"))


def force_fetch(run_worker, item: Artifact) -> None:
    assert run_json("force_refresh", "--artifact", str(item.pk))["enqueued"] == 1
    run_worker()
    item.refresh_from_db()


def test_discovered_items_are_fetched_once_each(site, source, run_worker):
    discover(run_worker, source)
    fetched = Artifact.objects.filter(source=source, state="fetched")
    assert sorted(a.url for a in fetched) == sorted(site.url(path) for path in PAGES)
    keys = sorted(Job.objects.filter(kind=FETCH_KIND).values_list("unique_key", flat=True))
    assert keys == sorted(f"fetch:{a.pk}" for a in fetched)

    discover(run_worker, source)  # nothing new, nothing changed: nothing fetched again
    assert Job.objects.filter(kind=FETCH_KIND).count() == len(PAGES)
    assert not ReconciliationIssue.objects.exists()


def test_missing_from_source_opens_once_over_two_runs_and_resolves_when_listed_again(
    site, source, run_worker
):
    discover(run_worker, source)
    site.remove("/docs/b.html")
    first = discover(run_worker, source)
    second = discover(run_worker, source)

    [issue] = issues(IssueKind.MISSING_FROM_SOURCE, site, "/docs/b.html")
    assert issue.status == "open" and issue.source == "local"
    assert issue.details["run_id"] == first.pk != second.pk
    assert issue.details["artifact_id"] == artifact(site, "/docs/b.html").pk
    assert issue.details["last_seen_run_id"] == first.pk - 1
    assert ReconciliationIssue.objects.count() == 1  # a and c are listed: no issues

    site.add("/docs/b.html", "B", "text of B, back again")
    back = discover(run_worker, source)
    issue.refresh_from_db()
    assert issue.status == "resolved" and issue.resolved_by == "holdfast"
    assert issue.comment == f"listed again by discovery run {back.pk}"
    assert issue.resolved_at is not None


def test_a_body_changed_under_an_unchanged_lastmod_is_content_changed_unannounced(
    site, source, run_worker
):
    discover(run_worker, source)
    page = artifact(site, "/docs/a.html")
    old_hash = page.sha256
    listed = site.documents["/docs/a.html"].lastmod
    site.change("/docs/a.html", "silently edited", lastmod=listed)
    discover(run_worker, source)  # same lastmod: discovery sees no change, fetches nothing
    assert artifact(site, "/docs/a.html").sha256 == old_hash

    force_fetch(run_worker, page)
    assert page.sha256 != old_hash
    [issue] = issues(IssueKind.CONTENT_CHANGED_UNANNOUNCED, site, "/docs/a.html")
    assert issue.status == "open"
    assert issue.details["old_sha256"] == old_hash
    assert issue.details["new_sha256"] == page.sha256
    assert issue.details["lastmod"] == page.lastmod == page.fetched_lastmod
    assert issue.details["http_status"] == 200
    assert Job.objects.filter(pk=issue.details["job_id"], kind=FETCH_KIND).exists()

    site.change("/docs/a.html", "edited and announced")  # lastmod moves on
    discover(run_worker, source)
    page.refresh_from_db()
    issue.refresh_from_db()
    assert page.fetched_lastmod == page.lastmod != issue.details["lastmod"]
    assert (issue.status, issue.resolved_by) == ("resolved", "holdfast")
    assert issue.comment == "the source lists a new lastmod"
    assert ReconciliationIssue.objects.count() == 1  # an announced change is no issue


@pytest.mark.parametrize("lastmod", ["same", "new"])
def test_gone_at_source_resolves_when_the_page_comes_back(site, source, run_worker, lastmod):
    discover(run_worker, source)
    page = artifact(site, "/docs/b.html")
    document = site.documents["/docs/b.html"]
    site.remove("/docs/b.html")
    force_fetch(run_worker, page)
    assert page.state == "gone"
    [gone] = issues(IssueKind.GONE_AT_SOURCE, site, "/docs/b.html")
    assert gone.status == "open" and gone.details["http_status"] == 404

    # Back with the same lastmod (discovery sees no change, but the run refetches listed
    # gone pages) or with a new one (discovery sees the change and fetches it).
    site.add(
        "/docs/b.html", "B", "text of B", lastmod=document.lastmod if lastmod == "same" else None
    )
    discover(run_worker, source)
    page.refresh_from_db()
    gone.refresh_from_db()
    assert page.state == "fetched" and page.http_status in (200, 304)
    assert (gone.status, gone.resolved_by) == ("resolved", "holdfast")
    assert gone.comment.startswith(f"fetched again with HTTP {page.http_status} by job ")


def test_an_operator_may_resolve_an_issue_whose_condition_persists(site, source, run_worker):
    discover(run_worker, source)
    site.remove("/docs/c.html")
    discover(run_worker, source)
    [issue] = issues(IssueKind.MISSING_FROM_SOURCE, site, "/docs/c.html")
    resolve(issue.pk, by="alice", comment="removed on purpose")
    issue.refresh_from_db()
    assert (issue.status, issue.resolved_by, issue.comment) == (
        "resolved",
        "alice",
        "removed on purpose",
    )

    site.add("/docs/c.html", "C", "back")
    discover(run_worker, source)
    issue.refresh_from_db()
    assert issue.resolved_by == "alice"  # an operator's resolution is never rewritten


def test_an_unknown_source_in_the_issue_filter_is_bad_input(source):
    record(IssueKind.GONE_AT_SOURCE, "https://old.example/a", "retired")  # its row is gone
    record(IssueKind.QUARANTINED_SUBMISSION, "lab-1.json")  # no source at all
    assert run_json("list_reconciliation_issues", "--source", "local")["count"] == 0
    assert run_json("list_reconciliation_issues", "--source", "retired")["count"] == 1
    assert exit_code("list_reconciliation_issues", "--source", "nosuch", "--json") == 2

    _, token = tokens.create("reader", "read")
    client = Client(enforce_csrf_checks=True)
    headers = {"Authorization": f"Bearer {token}"}
    answer = client.get("/internal/v1/reconciliation-issues/?source=nosuch", headers=headers)
    assert answer.status_code == 404  # like search/: a query naming no source finds nothing
    assert "no source named 'nosuch'" in answer.json()["error"]
    answer = client.get("/internal/v1/reconciliation-issues/?source=retired", headers=headers)
    assert answer.status_code == 200 and answer.json()["count"] == 1
