"""Full-text search over artifacts (DESIGN §11): indexing jobs, queries, command and API.

Bodies go into the real blob store (a temporary directory) with real ``Artifact`` rows;
``ingestion.index_artifact`` jobs run through a real in-process burst worker, so every
write goes through the engine's fenced, completing transaction.
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from ingestion import blobs, search
from ingestion.models import Artifact, ArtifactText, Source
from ingestion.search import INDEX_ARTIFACT
from ingestion.sources import SourceNotFound
from jobs import engine, enqueueing
from jobs.context import JobContext
from jobs.exceptions import InvalidJob, LeaseLost
from jobs.models import Job, State
from ops import serializers, tokens
from tests.support.workers import WorkerPool

from .helpers import claim_one, exit_code, run, run_json

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("blob_dir")]

HTML = b"""<!doctype html>
<html><head><title>Keeping the Lighthouse</title>
<style>.gull { color: seagreen }</style>
<script>var albatross = "never indexed";</script></head>
<body><h1>Lamps</h1><p>The keeper trims the wick of the great lamp every evening.</p>
<noscript>cormorant</noscript></body></html>"""

XML = b"""<?xml version="1.0" encoding="utf-8"?>
<feed xmlns="http://www.w3.org/2005/Atom"><title>Tide tables</title>
<entry><title>Spring tides</title><summary>Harbour pilots read the tide tables.</summary></entry>
</feed>"""

TEXT = "Fog signals: the foghorn sounds twice a minute. Café naïve façade.".encode()

HOSTILE = [
    '"',
    '""',
    '"unclosed phrase',
    "AND OR",
    "NOT",
    "*",
    "lamp*",
    "NEAR(",
    "NEAR(keeper wick, 2)",
    "title:keeper",
    "keeper OR",
    "-",
    "--",
    "(((",
    ")",
    "^lamp",
    "' OR 1=1 --",
    "'; DROP TABLE artifact_texts; --",
    "\\",
    "%_",
    "{title text}: lamp",
    "!@#$%^&*()",
    "the and of",
    "keeper -lamp",
    "x" * 990,
]


def make_source(name: str = "docs") -> Source:
    return Source.objects.create(
        allow_private=True,
        name=name,
        kind="sitemap",
        url=f"https://{name}.example.org/sitemap.xml",
        schedule="@daily",
    )


def fetched(source: Source, path: str, body: bytes, content_type: str) -> Artifact:
    """A fetched artifact whose body is in the blob store, as the fetch leaves it."""
    return Artifact.objects.create(
        source=source,
        url=f"https://{source.name}.example.org/{path}",
        state="fetched",
        sha256=blobs.store(body),
        size=len(body),
        content_type=content_type,
        http_status=200,
        fetched_at=timezone.now(),
    )


def refetched(artifact: Artifact, body: bytes, content_type: str | None = None) -> None:
    """A later fetch got a new body."""
    artifact.sha256 = blobs.store(body)
    if content_type is not None:
        artifact.content_type = content_type
    artifact.save(update_fields=["sha256", "content_type"])


@pytest.fixture
def index(run_worker: Callable[..., int]) -> Callable[..., list[Job]]:
    """Enqueue an index job per artifact and run them all through a real worker."""

    def index(*artifacts: Artifact) -> list[Job]:
        jobs = [enqueueing.enqueue(INDEX_ARTIFACT, {"artifact_id": a.pk}) for a in artifacts]
        assert run_worker() == len(jobs)
        for job in jobs:
            job.refresh_from_db()
            assert job.state == State.SUCCEEDED, job.last_error
        return jobs

    return index


def urls(query: str, **options) -> list[str]:
    return [hit.url for hit in search.search(query, **options)]


# --- extraction and indexing -------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_html_xml_and_text_bodies_are_indexed_through_the_worker(index):
    docs = make_source()
    page = fetched(docs, "lamp.html", HTML, "text/html; charset=utf-8")
    feed = fetched(docs, "tides.xml", XML, "application/atom+xml")
    note = fetched(docs, "fog.txt", TEXT, "text/plain; charset=utf-8")
    jobs = index(page, feed, note)

    assert all(job.result["indexed"] for job in jobs)
    assert urls("wick") == [page.url]
    assert urls("harbour pilots") == [feed.url]
    assert urls("foghorn") == [note.url]
    assert urls("café") == [note.url]
    # Neither scripts, styles nor noscript fallbacks are text a reader sees.
    for hidden in ("albatross", "seagreen", "cormorant"):
        assert urls(hidden) == []
    page.refresh_from_db()
    feed.refresh_from_db()
    assert (page.title, page.indexed_sha256) == ("Keeping the Lighthouse", page.sha256)
    assert feed.title == "Tide tables"
    text = ArtifactText.objects.get(artifact=page)
    assert text.title == "Keeping the Lighthouse"
    assert text.text == "Lamps The keeper trims the wick of the great lamp every evening."


@pytest.mark.django_db(transaction=True)
def test_the_declared_charset_decodes_the_body(index):
    docs = make_source()
    latin = fetched(
        docs, "a.txt", "Crème brûlée".encode("latin-1"), "text/plain; charset=ISO-8859-1"
    )
    unknown = fetched(docs, "b.txt", "Crème fraîche".encode(), "text/plain; charset=no-such")
    index(latin, unknown)
    assert urls("brûlée") == [latin.url]
    assert urls("fraîche") == [unknown.url]  # an unknown charset falls back to UTF-8


@pytest.mark.django_db(transaction=True)
def test_a_listed_title_is_kept_and_the_hit_shows_the_documents_own(index):
    page = fetched(make_source(), "lamp.html", HTML, "text/html")
    Artifact.objects.filter(pk=page.pk).update(title="From the feed")
    index(page)
    page.refresh_from_db()
    assert page.title == "From the feed"
    assert search.search("wick")[0].title == "Keeping the Lighthouse"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("body", "content_type", "reason"),
    [
        (b"%PDF-1.7 lamp", "application/pdf", "'application/pdf' is not indexed"),
        (b"lamp", "", "'(none)' is not indexed"),
        (b"<feed><title>lamp</feed>", "application/xml", "does not parse"),
        (
            b'<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "lamp lamp">]><x>&a;&a;</x>',
            "text/xml",
            "declares or references an entity",
        ),
    ],
)
def test_a_body_without_indexable_text_is_logged_and_takes_old_text_out(
    index, body, content_type, reason
):
    page = fetched(make_source(), "lamp.html", HTML, "text/html")
    index(page)
    refetched(page, body, content_type)
    [job] = index(page)
    assert job.result["indexed"] is False
    assert reason in job.result["reason"]
    assert urls("lamp") == []
    assert not ArtifactText.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_reindexing_replaces_the_text(index):
    page = fetched(make_source(), "lamp.html", HTML, "text/html")
    index(page)
    refetched(page, b"<title>Keeping the Lighthouse</title><p>Now with an electric beacon.</p>")
    index(page)
    assert urls("wick") == []
    assert urls("electric beacon") == [page.url]
    assert ArtifactText.objects.count() == 1
    page.refresh_from_db()
    assert page.indexed_sha256 == page.sha256


@pytest.mark.django_db(transaction=True)
def test_gone_artifacts_leave_the_index(index):
    docs = make_source()
    page = fetched(docs, "lamp.html", HTML, "text/html")
    note = fetched(docs, "fog.txt", TEXT, "text/plain")
    index(page, note)

    assert search.unindex(note.pk) is True
    assert search.unindex(note.pk) is False  # twice is harmless
    assert urls("foghorn") == []
    note.refresh_from_db()
    assert note.indexed_sha256 == ""

    # An index job that finds the artifact gone takes its text out too.
    Artifact.objects.filter(pk=page.pk).update(state="gone")
    [job] = index(page)
    assert job.result == {
        "artifact_id": page.pk,
        "indexed": False,
        "reason": "the artifact is gone, not fetched",
    }
    assert urls("wick") == []

    # An artifact deleted with its source takes its index entry along.
    other = fetched(make_source("other"), "fog.txt", TEXT, "text/plain")
    index(other)
    Source.objects.filter(name="other").delete()
    assert urls("foghorn") == []


def test_a_stale_attempt_cannot_write_the_index():
    page = fetched(make_source(), "lamp.html", HTML, "text/html")
    job = enqueueing.enqueue(INDEX_ARTIFACT, {"artifact_id": page.pk})
    stale = JobContext(claim_one("w-old"), "w-old")
    Job.objects.filter(pk=job.pk).update(lease_expires_at=timezone.now() - timedelta(minutes=5))
    assert engine.reclaim_expired() == [job.pk]
    current = JobContext(claim_one("w-new"), "w-new")

    with pytest.raises(LeaseLost):
        search.index_artifact(stale, page.pk)
    assert not ArtifactText.objects.exists()
    page.refresh_from_db()
    assert page.indexed_sha256 == ""

    assert search.index_artifact(current, page.pk)["indexed"] is True
    assert urls("wick") == [page.url]
    job.refresh_from_db()
    assert job.state == State.SUCCEEDED


def test_an_index_job_that_read_an_older_body_writes_nothing(monkeypatch):
    page = fetched(make_source(), "lamp.html", HTML, "text/html")
    job = enqueueing.enqueue(INDEX_ARTIFACT, {"artifact_id": page.pk})
    ctx = JobContext(claim_one(), "w1")
    extract = search.extract

    def fetched_meanwhile(body: bytes, content_type: str) -> search.Extracted:
        refetched(page, b"<p>A newer body, with its own index job.</p>")
        return extract(body, content_type)

    monkeypatch.setattr(search, "extract", fetched_meanwhile)
    result = search.index_artifact(ctx, page.pk)
    assert (result["indexed"], result["reason"]) == (False, "a newer fetch replaced this body")
    assert not ArtifactText.objects.exists()
    job.refresh_from_db()
    assert job.state == State.SUCCEEDED


# --- queries -----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_hits_are_ranked_best_first_with_marked_snippets(index):
    docs = make_source()
    once = fetched(
        docs, "once.txt", b"Notes on harbours, tides, buoys and one lighthouse.", "text/plain"
    )
    titled = fetched(
        docs,
        "titled.html",
        b"<title>Lighthouse keeping</title><p>A lighthouse keeper keeps the lighthouse lit.</p>",
        "text/html",
    )
    index(once, titled)

    hits = search.search("lighthouse")
    assert [hit.url for hit in hits] == [titled.url, once.url]
    assert hits[0].rank > hits[1].rank > 0
    assert "[lighthouse]" in hits[1].snippet.lower()
    assert "buoys" in hits[1].snippet
    assert search.hit_dict(hits[0]) == {
        "url": titled.url,
        "source": "docs",
        "title": "Lighthouse keeping",
        "snippet": hits[0].snippet,
        "rank": hits[0].rank,
        "fetched_at": titled.fetched_at.isoformat(),
        "artifact_id": titled.pk,
    }
    # Stemming: one form finds the others.
    assert set(urls("lighthouses")) == {titled.url, once.url}
    # Every word must match.
    assert urls("lighthouse buoys") == [once.url]
    assert urls('"keeps the lighthouse"') == [titled.url]


@pytest.mark.django_db(transaction=True)
def test_source_filter_and_limit(index):
    docs, news = make_source("docs"), make_source("news")
    pages = [fetched(docs, f"{n}.txt", f"lamp number {n}".encode(), "text/plain") for n in range(4)]
    other = fetched(news, "lamp.txt", b"lamp news", "text/plain")
    index(*pages, other)

    assert len(search.search("lamp")) == 5
    assert urls("lamp", source="news") == [other.url]
    assert set(urls("lamp", source="docs")) == {page.url for page in pages}
    assert len(search.search("lamp", limit=2)) == 2
    with pytest.raises(SourceNotFound, match="no source named 'nope'"):
        search.search("lamp", source="nope")
    for bad in (0, -1, search.MAX_LIMIT + 1):
        with pytest.raises(InvalidJob, match="limit"):
            search.search("lamp", limit=bad)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("query", HOSTILE)
def test_hostile_queries_never_error(index, query):
    index(fetched(make_source(), "lamp.html", HTML, "text/html"))
    hits = search.search(query)
    assert all(hit.url for hit in hits)
    assert search.search(f"wick {query}") is not None
    printed = json.loads(run("search", "--json", "--", query))  # "--": the query may be "-x"
    assert printed["count"] == len(hits)


@pytest.mark.parametrize("query", ["", "   ", "\t\n", "lamp\x00", "\ud800", "x" * 1001])
def test_a_blank_or_unstorable_query_is_bad_input(query):
    with pytest.raises(InvalidJob):
        search.search(query)


# --- the command -------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_search_command_prints_hits_as_text_and_json(index):
    page = fetched(make_source(), "lamp.html", HTML, "text/html")
    index(page)
    data = run_json("search", "keeper wick", "--source", "docs", "--limit", "5")
    assert data["count"] == 1
    [hit] = data["hits"]
    assert set(hit) == {"url", "source", "title", "snippet", "rank", "fetched_at", "artifact_id"}
    assert (hit["url"], hit["artifact_id"], hit["source"]) == (page.url, page.pk, "docs")
    text = run("search", "keeper")
    assert "Keeping the Lighthouse" in text and page.url in text and "(1 hits)" in text
    assert run_json("search", "albatross") == {"count": 0, "hits": []}
    # Unquoted words are one query, as typed into a search box (it was a usage error).
    assert run_json("search", "keeper", "wick", "--source", "docs") == data
    # A word excluded as documented (`search cats -dogs`): a word, not an unknown option.
    assert run_json("search", "keeper", "-wick", "--limit", "5") == {"count": 0, "hits": []}
    assert run_json("search", "keeper", "-albatross")["count"] == 1
    assert run_json("search", "-albatross") == {"count": 0, "hits": []}


@pytest.mark.parametrize(
    "args",
    [
        ("search", ""),
        ("search", "  "),
        ("search", "lamp\x00"),
        ("search", "lamp", "--source", "nope"),
    ],
)
def test_the_search_command_refuses_bad_input_with_exit_2(args):
    make_source()
    assert exit_code(*args) == 2


@pytest.mark.process
def test_the_real_command_exits_2_with_one_line_and_no_traceback(worker_env, tmp_path):
    """Usage errors (argparse's own) too: those only exit 2 outside ``call_command``."""
    make_source()
    cases = [
        ("search", "lamp", "--limit", "0"),
        ("search", "lamp", "--limit", "x"),
        ("search", "lamp", "--limit", "101"),
        ("search",),
        ("search", "lamp", "--source", "nope", "--json"),
        ("search", " "),
    ]
    with WorkerPool(worker_env, tmp_path / "logs") as pool:
        for args in cases:
            result = pool.command(*args)
            assert result.returncode == 2, result.describe()
            assert "Traceback" not in result.stderr
            # argparse's own errors come after its usage lines; the reason is the last.
            assert (
                result.stderr.strip()
                .splitlines()[-1]
                .startswith(("manage.py search: error", "CommandError"))
            )


# --- the API -----------------------------------------------------------------------------

API = "/internal/v1/search/"


@pytest.fixture
def read_token() -> str:
    return tokens.create("reader", "read")[1]


def get(query: str, token: str | None) -> object:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return Client().get(API + query, headers=headers)


@pytest.mark.django_db(transaction=True)
def test_the_api_answers_what_the_command_does(index, read_token):
    docs = make_source()
    page = fetched(docs, "lamp.html", HTML, "text/html")
    index(page, fetched(make_source("news"), "lamp.txt", b"lamp news", "text/plain"))
    response = get("?q=lamp&source=docs&limit=3", read_token)
    assert response.status_code == 200
    assert response.json() == run_json("search", "lamp", "--source", "docs", "--limit", "3")
    assert response.json()["hits"][0]["artifact_id"] == page.pk
    assert get("?q=lamp", read_token).json()["count"] == 2
    for query in HOSTILE:
        assert (
            get(f"?q={query}".replace("%", "%25").replace("&", "%26"), read_token).status_code
            == 200
        )


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("", "q"),
        ("?q=", "q"),
        ("?q=%20%20", "q"),
        ("?q=lamp%00", "q"),
        ("?q=lamp&limit=0", "limit"),
        ("?q=lamp&limit=101", "limit"),
        ("?q=lamp&limit=x", "limit"),
        ("?q=lamp&page=2", "page"),
        ("?q=lamp&q=wick", "q"),
    ],
)
def test_the_api_names_the_bad_parameter_in_a_400(read_token, query, field):
    make_source()
    response = get(query, read_token)
    assert response.status_code == 400
    data = response.json()
    assert data["code"] == "invalid"
    assert list(data["fields"]) == [field]


def test_the_api_answers_an_unknown_source_with_a_404(read_token):
    response = get("?q=lamp&source=nope", read_token)
    assert response.status_code == 404
    assert response.json() == {"error": "no source named 'nope'", "code": "not_found"}


def test_the_api_needs_a_token():
    assert get("?q=lamp", None).status_code == 401
    assert get("?q=lamp", "garbage").status_code == 401


def test_the_schema_describes_the_hits_served():
    assert set(serializers.SearchHit().fields) == {
        "url", "source", "title", "snippet", "rank", "fetched_at", "artifact_id"
    }  # fmt: skip
    assert set(serializers.SearchResponse().fields) == {"count", "hits"}
    document = Client().get("/internal/v1/schema/").json()
    operation = document["paths"]["/internal/v1/search/"]["get"]
    assert {p["name"] for p in operation["parameters"]} == {"q", "source", "limit"}


# --- the query syntax, the same on both databases -------------------------------------------

CORPUS = {
    "cats": "Cats sleep all day in the sun.",
    "dogs": "Dogs bark at the mail carrier.",
    "both": "Cats and dogs share the house, mostly in peace.",
    "kittens": "Kittens chase a red ball of yarn.",
    "black-cat": "A black cat crossed the road at night.",
    "cat-black": "The cat was not black but grey; black shoes stood by the door.",
    "fish": "Fish swim in a bowl; cats watch them.",
    "host": "Visit docs.example.com or write to ops@example.org about /var/log/syslog 1.2.3.",
    "cafe": "The Café on the square serves crème brûlée to Dvořák.",
}

# (query, the documents it finds): the web-search syntax documented in docs/sources.md.
SYNTAX = [
    ("cats", {"cats", "both", "black-cat", "cat-black", "fish"}),  # stems: cat = cats
    ("cats dogs", {"both"}),  # every word is needed
    ("cats -dogs", {"cats", "black-cat", "cat-black", "fish"}),  # -word excludes
    ("cats -dogs -fish", {"cats", "black-cat", "cat-black"}),
    ("cats or kittens", {"cats", "both", "black-cat", "cat-black", "fish", "kittens"}),
    ("kittens OR dogs", {"kittens", "dogs", "both"}),
    ("dogs or kittens yarn", {"dogs", "both", "kittens"}),  # "or" binds loosest
    ("kittens or dogs -cats", {"kittens", "dogs"}),  # the exclusion is the second's
    ('"black cat"', {"black-cat"}),  # a phrase: adjacent, in order
    ('"cat black"', set()),
    ('"black cat" or kittens', {"black-cat", "kittens"}),
    ('cat -"black cat"', {"cats", "both", "cat-black", "fish"}),
    ("the cats", {"cats", "both", "black-cat", "cat-black", "fish"}),  # stop words ignored
    ("-dogs", set()),  # nothing required: nothing found
    ("or", set()),
    ("cats or", {"cats", "both", "black-cat", "cat-black", "fish"}),
    ("zebra", set()),
    ("zebra or kittens", {"kittens"}),
    # Characters no word holds on either database split words or are dropped, on both.
    ("kittens _", {"kittens"}),
    ("kittens ²", {"kittens"}),
    ("red_ball", {"kittens"}),
    ('"red_ball" -_', {"kittens"}),
    # Hosts, addresses, paths and dotted numbers are words apart on both: PostgreSQL's
    # parser kept each whole (audit); accents of Latin letters count on neither.
    ("example", {"host"}),
    ("docs.example.com", {"host"}),
    ("ops", {"host"}),
    ("syslog", {"host"}),
    ('"1.2.3"', {"host"}),
    ("cafe", {"cafe"}),
    ("café", {"cafe"}),
    ("CAFÉ -square", set()),
    ('"creme brulee"', {"cafe"}),
    ("dvorak", {"cafe"}),
]


@pytest.fixture
def corpus(index) -> dict[str, str]:
    source = make_source()
    artifacts = [
        fetched(source, f"{name}.txt", text.encode(), "text/plain") for name, text in CORPUS.items()
    ]
    index(*artifacts)
    return {artifact.url: name for artifact, name in zip(artifacts, CORPUS, strict=True)}


@pytest.mark.django_db(transaction=True)
def test_the_query_syntax_answers_the_same_on_both_databases(corpus):
    """One table, run on SQLite and on PostgreSQL: the same documents for every query."""
    for query, expected in SYNTAX:
        found = {corpus[hit.url] for hit in search.search(query, limit=search.MAX_LIMIT)}
        assert found == expected, query


def test_html_is_read_as_a_stream_and_its_tags_bounded():
    """No tree of the page: its text and first title, without scripts and styles, read up
    to MAX_HTML_TAGS tags (10 MB of tags took 2 GB as a tree); what follows is not read."""
    page = (
        b"<html><head><title>First &amp; only</title><style>p{}</style></head><body>"
        b"<p>kept <b>words</b></p><script>var hidden = 1;</script><noscript>no</noscript>"
        b"<title>second title</title>"
    )
    extracted = search.extract(page, "text/html; charset=utf-8")
    assert extracted == search.Extracted("First & only", "kept words second title")

    flood = b"<p>early</p>" + b"<b>" * (search.MAX_HTML_TAGS + search.HTML_CHUNK) + b"late"
    assert search.extract(flood, "text/html").text == "early"


def _extracted_with_peak(body: bytes) -> tuple[search.Extracted, int]:
    """The XML body's extraction, and the most memory Python held meanwhile."""
    tracemalloc.start()
    try:
        extracted = search.extract(body, "application/xml")
        return extracted, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_xml_is_read_as_a_stream_in_document_order():
    """No tree (a 2 MB document took 41 MB as one, audit): expat's text nodes in order, the
    first title's (nested markup included) as the title, the rest not read past the cut."""
    doc = (
        b'<?xml version="1.0"?><a:feed xmlns:a="urn:x"><a:title>Tide <b>tables</b></a:title>'
        b"<p>one &amp; two</p><title>later title</title>\n<p>three</p></a:feed>"
    )
    assert search.extract(doc, "application/atom+xml") == search.Extracted(
        "Tide tables", "Tide tables one & two later title three"
    )
    body = b"<doc>" + b"<p>word</p>" * 200_000 + b"</doc>"  # 2.2 MB
    extracted, peak = _extracted_with_peak(body)
    assert len(extracted.text) == search.MAX_TEXT_CHARS
    assert peak < 12 * 1024 * 1024, peak
    # One text node of 10 MB: counted as its pieces arrive, not once it ends (helper-28
    # #2: about 120 MB of pieces before the size was first looked at).
    node = b"<doc><p>" + b"word " * 2_000_000 + b"</p></doc>"
    extracted, peak = _extracted_with_peak(node)
    assert len(extracted.text) == search.MAX_TEXT_CHARS
    assert peak < 16 * 1024 * 1024, peak


@pytest.mark.parametrize(
    "body",
    [
        b'<?xml version="1.0"?><!DOCTYPE d [<!ENTITY x "expanded">]><d>&x;</d>',
        b'<?xml version="1.0"?><!DOCTYPE d [<!ENTITY x SYSTEM "file:///etc/passwd">]><d>&x;</d>',
        b"<d><unclosed></d>",
    ],
)
def test_xml_with_entities_or_that_does_not_parse_is_not_indexable(body):
    with pytest.raises(search.NotIndexable):
        search.extract(body, "application/xml")


@pytest.mark.django_db(transaction=True)
def test_a_huge_title_or_a_lone_surrogate_is_indexed_not_fatal(index):
    """An XML title was unbounded (a tsvector over PostgreSQL's 1 MB: the index job died),
    and ``utf-7`` can decode to a lone surrogate no database stores (audit)."""
    docs = make_source()
    words = " ".join(f"w{n}" for n in range(200_000)).encode()
    long = fetched(docs, "long.xml", b"<d><title>" + words + b"</title><p>tail</p></d>", "text/xml")
    odd = fetched(docs, "odd.txt", b"lighthouse +2AA- keeper", "text/plain; charset=utf-7")
    jobs = index(long, odd)
    assert all(job.result["indexed"] for job in jobs)
    long.refresh_from_db()
    assert len(long.title) == search.MAX_TITLE_CHARS and long.title.startswith("w0 w1 ")
    assert urls("w5") == [long.url]
    assert ArtifactText.objects.get(artifact=odd).text == "lighthouse \ufffd keeper"
    assert urls("lighthouse") == [odd.url]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_migration_rebuilds_documents_indexed_the_old_way(index):
    """Documents indexed before the search words were split as FTS5 splits them are
    rebuilt by ``ingestion.0010_search_words``: ``example`` then finds them."""
    from django.core.management import call_command
    from django.db import connection

    host = fetched(make_source(), "host.txt", CORPUS["host"].encode(), "text/plain")
    index(host)
    call_command("migrate", "ingestion", "0009_discovery_page_starts", verbosity=0)
    try:
        with connection.cursor() as cursor:  # as 0.2's index jobs wrote it
            cursor.execute(
                "UPDATE artifact_texts SET document = setweight(to_tsvector('english', title),"
                " 'A') || setweight(to_tsvector('english', text), 'B')"
            )
        assert urls("example") == []
    finally:
        call_command("migrate", "ingestion", verbosity=0)
    assert urls("example") == [host.url]


@pytest.mark.timeout(30)  # the old parser took minutes: a hang, not a figure
@pytest.mark.parametrize("size", [120_000, 1_000_000])
def test_an_unclosed_tag_flood_is_read_in_bounded_time_and_the_text_kept(size: int) -> None:
    """``html.parser``'s close() is quadratic in an unfinished construct (Python before
    3.13.5, CVE-2025-6069): 120 KB of ``<a `` held an index job for three minutes, and a
    cancel was not heard meanwhile (helper-28 #1)."""
    body = b"<title>t</title><p>before " + b"<a " * (size // 3) + b"</p><p>after</p>"
    extracted = search.extract_html(body, None)
    assert extracted.title == "t"
    assert extracted.text.split()[:1] == ["before"] and extracted.text.split()[-1] == "after"


@pytest.mark.parametrize(
    ("body", "title"),
    [
        (b"<title>Caf\xe9</title>", "Café"),  # undeclared Latin-1: read as windows-1252
        ("<title>Café — ok</title>".encode(), "Café — ok"),  # UTF-8
        (b'<meta charset="iso-8859-2"><title>\xb1</title>', "ą"),  # the page's own charset
        (b"<title>Evil \x1b RED</title><p>kangaroo</p>", "Evil \x1b RED"),  # not UTF-16
    ],
)
def test_a_page_without_a_declared_charset_is_read_as_a_browser_would(
    body: bytes, title: str
) -> None:
    """bs4's byte statistics came first: "Café" became "Cafķ" (cp775), and a control byte
    made the page UTF-16 mojibake, its words never found (helper-25)."""
    assert search.extract_html(body, None).title == title
