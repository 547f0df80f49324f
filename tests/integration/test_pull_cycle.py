"""The pull side end to end (DESIGN §11): discovery → fetch → index → search, twice.

A real HTTP site on 127.0.0.1 (``demo.site.FixtureSite``) is added as a source, and every
job runs through the real engine: ``manage.py enqueue_discovery`` then ``manage.py
runworker --burst`` until nothing is runnable. Between cycles the site changes (one
document removed, one changed, one added), and the second cycle must do exactly what that
calls for: fetch the new and the changed document and nothing else, re-index those two,
and open one ``missing_from_source`` issue for the removed one. A forced refresh then finds
the removed one gone (404): out of the index, with a ``gone_at_source`` issue.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from demo.site import FixtureSite
from ingestion import search
from ingestion.models import Artifact, ArtifactText
from ingestion.reconciliation import issues
from jobs.models import Job

from .helpers import run, run_json

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("blob_dir")]

DISCOVER, FETCH, INDEX = (
    "ingestion.discover_source",
    "ingestion.fetch_artifact",
    "ingestion.index_artifact",
)
DOCS = {
    "/docs/lighthouse.html": ("Keeping the lighthouse", "The keeper trims the wick at dusk."),
    "/docs/tides.html": ("Tide tables", "Spring tides follow the full moon."),
    "/docs/knots.html": ("Knots", "The bowline makes a fixed loop that will not slip."),
    "/docs/charts.html": ("Charts", "Soundings are given at the lowest astronomical tide."),
}


@pytest.fixture
def site() -> Iterator[FixtureSite]:
    # Two URLs per sitemap: the index and two child sitemaps, read in bounded jobs.
    with FixtureSite(per_sitemap=2) as site:
        for path, (title, text) in DOCS.items():
            site.add(path, title, text)
        yield site


def cycle(*command: str) -> Counter[tuple[str, str]]:
    """Run ``command`` (a discovery of the source by default), then a burst worker until
    nothing is runnable; the jobs this enqueued, by (kind, state)."""
    before = Job.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
    run(*(command or ("enqueue_discovery", "local")))
    run("runworker", "--burst", "--worker-id", "cycle")
    return Counter(Job.objects.filter(pk__gt=before).values_list("kind", "state"))


def urls(query: str) -> list[str]:
    return [hit.url for hit in search.search(query)]


def indexed_bodies() -> dict[str, str]:
    """URL → sha256 of the text in the index, checked against the artifact's last body."""
    found = {}
    for artifact in Artifact.objects.filter(state="fetched"):
        text = ArtifactText.objects.get(artifact=artifact)
        assert text.sha256 == artifact.sha256 == artifact.indexed_sha256, artifact.url
        found[artifact.url] = text.sha256
    return found


def test_discovery_fetch_index_and_search_follow_the_site(site: FixtureSite) -> None:
    run(
        "add_source", "local", "--kind", "sitemap", "--url", site.url("/sitemap.xml"),
        "--spacing", "0", "--max-pages-per-run", "2", "--allow-private",
    )  # fmt: skip

    # First cycle: four listing pages in two bounded jobs, every document fetched and
    # indexed once.
    assert cycle() == {
        (DISCOVER, "succeeded"): 2,
        (FETCH, "succeeded"): 4,
        (INDEX, "succeeded"): 4,
    }
    first = indexed_bodies()
    assert set(first) == {site.url(path) for path in DOCS}
    assert urls("keeper wick") == [site.url("/docs/lighthouse.html")]
    assert urls("bowline") == [site.url("/docs/knots.html")]
    assert urls("tides") == [site.url("/docs/tides.html"), site.url("/docs/charts.html")]
    hit = run_json("search", "bowline", "--source", "local")["hits"][0]
    assert (hit["title"], hit["source"]) == ("Knots", "local")
    assert "[bowline]" in hit["snippet"].lower()
    assert not issues(status="open").exists()

    # The site changes: one document goes, one changes (new lastmod), one arrives.
    site.remove("/docs/tides.html")
    site.change("/docs/knots.html", "The clove hitch holds a line to a post.")
    site.add("/docs/anchors.html", "Anchors", "A fisherman anchor digs into gravel.")

    # Second cycle: only the new and the changed document are fetched and re-indexed.
    assert cycle() == {
        (DISCOVER, "succeeded"): 2,
        (FETCH, "succeeded"): 2,
        (INDEX, "succeeded"): 2,
    }
    fetched_now = {
        job.args["artifact_id"] for job in Job.objects.filter(kind=FETCH).order_by("-pk")[:2]
    }
    assert fetched_now == set(
        Artifact.objects.filter(
            url__in=[site.url("/docs/knots.html"), site.url("/docs/anchors.html")]
        ).values_list("pk", flat=True)
    )
    second = indexed_bodies()
    changed = {url for url in second if first.get(url) != second[url]}
    assert changed == {site.url("/docs/knots.html"), site.url("/docs/anchors.html")}
    assert urls("bowline") == []
    assert urls("clove hitch") == [site.url("/docs/knots.html")]
    assert urls("fisherman anchor") == [site.url("/docs/anchors.html")]

    # The removed document: still as last fetched, and reported missing from its source.
    [missing] = issues(status="open")
    assert (missing.kind, missing.source, missing.subject) == (
        "missing_from_source",
        "local",
        site.url("/docs/tides.html"),
    )
    assert Artifact.objects.get(url=site.url("/docs/tides.html")).state == "fetched"
    assert Artifact.objects.count() == 5

    # A third cycle with nothing changed at the site fetches nothing and opens nothing new.
    assert cycle() == {(DISCOVER, "succeeded"): 2}
    assert indexed_bodies() == second
    assert [issue.pk for issue in issues(status="open")] == [missing.pk]

    # A forced refresh of the whole source: the four pages still there answer 304 and are
    # not re-indexed; the removed one answers 404, is gone and leaves the index.
    assert urls("spring tides") == [site.url("/docs/tides.html")]
    assert cycle("force_refresh", "--source", "local") == {(FETCH, "succeeded"): 5}
    assert Artifact.objects.get(url=site.url("/docs/tides.html")).state == "gone"
    assert urls("spring tides") == []
    assert indexed_bodies() == {
        url: sha for url, sha in second.items() if url != site.url("/docs/tides.html")
    }
    assert sorted(issue.kind for issue in issues(status="open")) == [
        "gone_at_source",
        "missing_from_source",
    ]


def test_the_sources_demo_runs_two_cycles_and_shows_a_hit_and_the_issue() -> None:
    output = run("demo_sources")
    assert "cycle 1:" in output and "cycle 2:" in output
    assert "lighthouse" in output.lower()
    assert "missing_from_source" in output
    data = run_json("demo_sources", "--name", "demo-again")
    assert data["hit"]["source"] == "demo-again"
    assert [issue["kind"] for issue in data["issues"]] == ["missing_from_source"]
    assert data["issues"][0]["subject"].endswith("/docs/tides.html")
