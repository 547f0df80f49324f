"""The polite HTTP client against a real server on 127.0.0.1 (demo/site.py): statuses,
robots.txt (RFC 9309), redirects, malformed URLs, internal addresses, timeouts, size caps,
and spacing within and across processes."""

from __future__ import annotations

import gzip
import os
import socket
import ssl
import subprocess
import threading
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_address
from itertools import pairwise

import httpx
import pytest
from django.db import connection, transaction
from django.utils import timezone

from demo.site import FixtureSite
from ingestion import egress, http
from ingestion.discovery import start_discovery
from ingestion.models import Source
from ingestion.sources import add_source
from jobs.exceptions import InvalidJob
from jobs.models import Job, Lease, State
from tests.process.helpers import job_summary
from tests.support.pgcluster import free_port
from tests.support.workers import WorkerPool, wait_until

pytestmark = pytest.mark.django_db


@pytest.fixture
def site() -> Iterator[FixtureSite]:
    with FixtureSite(slow_seconds=3.0, huge_bytes=256 * 1024) as running:
        running.add("/docs/a.html", "Alpha", "the first document")
        yield running


def make_source(site: FixtureSite, spacing: float = 0.0) -> Source:
    return Source.objects.create(
        allow_private=True,
        name="fixture",
        kind="sitemap",
        url=site.url("/sitemap.xml"),
        schedule="0 3 * * *",
        spacing_seconds=spacing,
    )


@pytest.fixture
def source(site: FixtureSite) -> Source:
    return make_source(site)


def paths(site: FixtureSite) -> list[str]:
    return [request.path for request in site.requests]


def test_every_status_is_a_response_with_the_user_agent_and_headers(site, source, settings):
    response = http.get(source, site.url("/docs/a.html"))
    assert response.status == 200
    assert response.url == site.url("/docs/a.html")
    assert b"the first document" in response.body
    assert response.headers["ETAG"] == site.documents["/docs/a.html"].etag  # any case
    assert response.elapsed > 0
    for code in (404, 410, 500):
        assert http.get(source, site.url(f"/status/{code}")).status == code
    agents = {request.headers["user-agent"] for request in site.requests}
    assert agents == {settings.HOLDFAST_USER_AGENT}
    assert settings.HOLDFAST_USER_AGENT.startswith("Holdfast/")


def test_conditional_headers_are_sent_and_304_is_returned(site, source):
    etag = site.documents["/docs/a.html"].etag
    response = http.get(source, site.url("/docs/a.html"), headers={"If-None-Match": etag})
    assert (response.status, response.body) == (304, b"")
    assert site.requests_to("/docs/a.html")[0].headers["if-none-match"] == etag


def test_robots_txt_disallow_is_honoured_and_cached_on_the_source(site, source):
    with pytest.raises(http.RobotsDisallowed) as refused:
        http.get(source, site.url("/private/page.html"))
    assert refused.value.transient is False
    assert site.url("/private/page.html") in str(refused.value)
    assert "robots.txt" in str(refused.value)
    http.get(source, site.url("/docs/a.html"))
    assert paths(site) == ["/robots.txt", "/docs/a.html"]  # fetched once, never /private/
    source.refresh_from_db()
    assert "Disallow: /private/" in source.robots_txt
    assert source.robots_fetched_at is not None


def test_robots_txt_is_fetched_again_after_a_day_and_by_other_processes_copy(site, source):
    http.get(source, site.url("/docs/a.html"))
    site.robots_txt = "User-agent: *\nDisallow: /docs/\n"
    a_day_ago = timezone.now() - timedelta(days=1, minutes=1)
    Source.objects.filter(pk=source.pk).update(robots_fetched_at=a_day_ago)
    fresh = Source.objects.get(pk=source.pk)
    with pytest.raises(http.RobotsDisallowed):
        http.get(fresh, site.url("/docs/a.html"))
    assert paths(site).count("/robots.txt") == 2
    # An instance loaded before the refresh reads the row's newer copy, not the site.
    source.robots_fetched_at = a_day_ago
    with pytest.raises(http.RobotsDisallowed):
        http.get(source, site.url("/docs/a.html"))
    assert paths(site).count("/robots.txt") == 2


def test_robots_txt_of_other_hosts_is_kept_for_the_most_recent_hosts_only(source, monkeypatch):
    """A feed naming a new host per entry (each with a big robots.txt) must not grow a
    worker without bound: other hosts' robots.txt is kept for the latest few only."""
    monkeypatch.setattr(http, "OTHER_HOSTS_KEPT", 3)
    monkeypatch.setattr(http, "_other_hosts", http.OrderedDict())
    fetched: list[str] = []
    monkeypatch.setattr(
        http, "_fetch_robots", lambda client, source, origin, deadline: fetched.append(origin)
    )
    deadline = http.Deadline(30, "x")
    for origin in ["http://h0.example", "http://h1.example", "http://h0.example"] + [
        f"http://h{n}.example" for n in range(2, 6)
    ]:
        http._other_robots(None, source, origin, deadline)
    assert [origin for _, origin in http._other_hosts] == [
        f"http://h{n}.example" for n in (3, 4, 5)
    ]
    assert fetched.count("http://h0.example") == 1  # the cache still serves the hosts it keeps


def test_a_missing_robots_txt_allows_everything(site, source):
    site.robots_txt = None
    assert http.get(source, site.url("/private/page.html")).status == 200


def test_an_unavailable_robots_txt_is_a_transient_error_and_not_cached(site, source):
    site.redirects["/robots.txt"] = "/status/503"  # robots.txt redirects are followed
    with pytest.raises(http.FetchError) as failed:
        http.get(source, site.url("/docs/a.html"))
    assert failed.value.transient is True and "robots.txt answered 503" in str(failed.value)
    assert "/docs/a.html" not in paths(site)
    del site.redirects["/robots.txt"]
    assert http.get(source, site.url("/docs/a.html")).status == 200


@pytest.mark.parametrize("status", [408, 429])
def test_a_robots_txt_answering_later_is_transient_not_allow_all(site, source, status):
    """408 and 429 say "try later", not "there is none": read as a missing robots.txt,
    a site shedding load had its Disallow rules ignored for a day (audit)."""
    site.robots_txt = "User-agent: *\nDisallow: /private/\n"
    site.replies["/robots.txt"] = (status, "text/plain", b"slow down\n", {"Retry-After": "60"})
    with pytest.raises(http.FetchError) as failed:
        http.get(source, site.url("/private/page.html"))
    assert failed.value.transient is True and f"answered {status}" in str(failed.value)
    source.refresh_from_db()
    assert source.robots_fetched_at is None  # nothing cached
    del site.replies["/robots.txt"]
    with pytest.raises(http.RobotsDisallowed):
        http.get(source, site.url("/private/page.html"))


def test_retry_after_is_read_as_seconds_or_a_date_and_capped():
    def answer(value: str) -> float | None:
        return http.retry_after(
            # As the wire gives it: bytes, read by httpx (UTF-8 where it is not ASCII).
            http.Response(
                429, "http://x/", httpx.Headers([(b"Retry-After", value.encode())]), b"", 0.0
            )
        )

    assert answer("120") == 120
    assert answer("99999999999999999999") == 86400  # at most a day
    later = timezone.now() + timedelta(hours=1)
    assert 3500 < answer(later.strftime("%a, %d %b %Y %H:%M:%S GMT")) <= 3600
    for ignored in ("", "0", "-5", "soon", "Mon, 01 Jan 2001 00:00:00 GMT", "1.5", "\u0665"):
        assert answer(ignored) is None, ignored


def test_robots_txt_is_matched_against_holdfasts_user_agent(site, source):
    site.robots_txt = "User-agent: Holdfast\nDisallow: /docs/\n\nUser-agent: *\nDisallow:\n"
    with pytest.raises(http.RobotsDisallowed):
        http.get(source, site.url("/docs/a.html"))


@pytest.mark.parametrize(
    ("robots_txt", "path", "allowed"),
    [
        # The longest matching rule wins, wherever it stands in the group (RFC 9309 §2.2.2).
        ("Allow: /\nDisallow: /private/\n", "/private/secret", False),
        ("Disallow: /docs/\nAllow: /docs/a.html\n", "/docs/a.html", True),
        # "*" matches any run of characters, "$" the end of the path.
        ("Disallow: /*.pdf\n", "/doc.pdf", False),
        ("Disallow: /*.pdf\n", "/files/doc.pdf?download=1", False),
        ("Disallow: /*.pdf$\n", "/doc.pdf", False),
        ("Disallow: /*.pdf$\n", "/doc.pdf?download=1", True),
    ],
)
def test_robots_txt_rules_follow_rfc_9309(site, source, robots_txt, path, allowed):
    site.robots_txt = "User-agent: *\n" + robots_txt
    if allowed:
        assert http.get(source, site.url(path)).url == site.url(path)
    else:
        with pytest.raises(http.RobotsDisallowed):
            http.get(source, site.url(path))
        assert path not in paths(site)


def test_robots_txt_groups_match_the_product_token_only(site, source):
    """The User-Agent header says "ingestion bot"; a group for "bot" is not Holdfast's."""
    site.robots_txt = "User-agent: bot\nDisallow: /\n\nUser-agent: holdfast\nDisallow: /private/\n"
    assert http.get(source, site.url("/docs/a.html")).status == 200
    with pytest.raises(http.RobotsDisallowed):
        http.get(source, site.url("/private/page.html"))


def test_a_robots_txt_over_the_cap_is_read_up_to_the_cap(site, source):
    """RFC 9309 §2.5: parse the first 500 KiB or more, ignore the rest; a rule cut by the
    cap ("Disallow: /docs/a" of "Disallow: /docs/a.html.old") is dropped, not applied."""
    head = "User-agent: *\nDisallow: /private/\n"
    cut = "Disallow: /docs/a"
    filler = http.ROBOTS_MAX_BYTES - len(head) - len(cut)
    site.robots_txt = (
        head + "#" * (filler - 1) + "\n" + "Disallow: /docs/a.html.old\nDisallow: /docs/\n"
    )
    assert len(site.robots_txt) > http.ROBOTS_MAX_BYTES
    assert http.get(source, site.url("/docs/a.html")).status == 200
    with pytest.raises(http.RobotsDisallowed):
        http.get(source, site.url("/private/page.html"))
    source.refresh_from_db()
    assert source.robots_txt == head + "#" * (filler - 1) + "\n"


def test_redirects_are_followed_up_to_five_hops_each_robots_checked(site, source):
    response = http.get(source, site.url("/redirect/5"))
    assert (response.status, response.url) == (200, site.url("/redirect/0"))
    with pytest.raises(http.TooManyRedirects) as refused:
        http.get(source, site.url("/redirect/6"))
    assert refused.value.transient is False
    assert site.url("/redirect/6") in str(refused.value)
    site.redirects["/go-private"] = "/private/page.html"
    with pytest.raises(http.RobotsDisallowed):
        http.get(source, site.url("/go-private"))
    assert "/private/page.html" not in paths(site)


def test_a_slow_server_times_out_as_a_transient_error(site, source, settings):
    settings.HOLDFAST_FETCH_TIMEOUT_SECONDS = 0.3
    started = time.monotonic()
    with pytest.raises(http.FetchError) as failed:
        http.get(source, site.url("/slow"))
    assert time.monotonic() - started < 2.5
    assert failed.value.transient is True
    assert site.url("/slow") in str(failed.value) and "timed out" in str(failed.value)


def test_bodies_over_the_cap_are_abandoned(site, source, settings):
    with pytest.raises(http.TooLarge) as refused:
        http.get(source, site.url("/huge"), max_bytes=1024)
    assert refused.value.transient is False
    assert site.url("/huge") in str(refused.value) and "1024" in str(refused.value)
    settings.HOLDFAST_FETCH_MAX_BYTES = 100 * 1024
    with pytest.raises(http.TooLarge):
        http.get(source, site.url("/huge"))
    assert len(http.get(source, site.url("/huge"), max_bytes=300 * 1024).body) == 256 * 1024


def test_connection_refused_is_transient_and_names_the_url(source):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    source.url = f"http://127.0.0.1:{port}/sitemap.xml"
    with pytest.raises(http.FetchError) as failed:
        http.get(source, f"http://127.0.0.1:{port}/doc.html")
    assert failed.value.transient is True
    assert f"127.0.0.1:{port}" in str(failed.value)


def test_non_http_urls_are_refused(source):
    with pytest.raises(http.FetchError) as refused:
        http.get(source, "file:///etc/passwd")
    assert refused.value.transient is False


@pytest.mark.parametrize("url", ["http://[::1/x", "http://127.0.0.1:99999/x", "http://[oops]/"])
def test_malformed_urls_are_a_permanent_fetch_error_naming_the_url(source, url):
    with pytest.raises(http.FetchError) as refused:
        http.get(source, url)
    assert refused.value.transient is False
    assert url in str(refused.value) and "malformed URL" in str(refused.value)


@pytest.mark.parametrize("location", ["http://[::1/x", "http://a]b/", "http://[::1]x/"])
def test_a_malformed_redirect_location_is_a_permanent_fetch_error(site, source, location):
    site.redirects["/moved"] = location
    with pytest.raises(http.FetchError) as refused:
        http.get(source, site.url("/moved"))
    assert refused.value.transient is False
    assert site.url("/moved") in str(refused.value) and location in str(refused.value)


@pytest.mark.parametrize(
    ("address", "public", "with_flag"),
    [
        ("93.184.215.14", True, True),
        ("2606:4700::6810:84e5", True, True),
        ("::ffff:93.184.215.14", True, True),
        ("169.254.169.254", False, False),  # cloud metadata: never
        ("fd00:ec2::254", False, False),
        ("::ffff:169.254.169.254", False, False),
        ("fe80::1", False, True),  # link-local
        ("169.254.10.1", False, True),
        ("127.0.0.1", False, True),  # loopback
        ("::1", False, True),
        ("::ffff:127.0.0.1", False, True),  # loopback, IPv4-mapped
        ("2002:7f00:1::", False, True),  # 6to4 carrying 127.0.0.1
        ("10.0.0.8", False, True),  # private
        ("192.168.1.1", False, True),
        ("fd00::8", False, True),
        ("100.64.0.1", False, True),  # shared (carrier-grade NAT)
        ("224.0.0.251", False, False),  # multicast: never
        ("ff02::1", False, False),
        ("240.0.0.1", False, False),  # reserved: never
        ("0.0.0.0", False, False),  # unspecified: never
        ("::", False, False),
        ("::ffff:0.0.0.0", False, False),
        ("0.0.0.1", False, False),  # "this network" (0/8): never, not only 0.0.0.0
        ("0.1.2.3", False, False),
        ("::ffff:0.1.2.3", False, False),
        ("169.254.170.2", False, False),  # ECS task credentials: never
        ("169.254.170.23", False, False),  # EKS Pod Identity: never
        ("fd00:ec2::23", False, False),
        ("fec0::1", False, True),  # site-local (Python counts it global): not public
    ],
)
def test_the_address_policy_with_and_without_the_flag(address, public, with_flag):
    assert http.is_public(ip_address(address)) is public
    assert http.address_allowed(ip_address(address), allow_private=False) is public
    assert http.address_allowed(ip_address(address), allow_private=True) is with_flag


@pytest.fixture
def resolver(monkeypatch):
    """Host names resolved in-process: ``resolver["name"] = ["127.0.0.1"]`` (or a callable
    giving the answer of each lookup). Every lookup is recorded; the machine's resolver is
    left alone, and names not set resolve as usual."""
    answers: dict[str, object] = {}
    lookups: list[str] = []
    real = egress.resolve

    def resolve(host: str, port: int):
        lookups.append(host)
        answer = answers.get(host)
        if answer is None:
            return real(host, port)
        addresses = answer() if callable(answer) else answer
        return [ip_address(address) for address in addresses]

    monkeypatch.setattr(egress, "resolve", resolve)
    answers["lookups"] = lookups  # type: ignore[assignment]
    return answers


def public_source(site: FixtureSite, host: str = "docs.example") -> Source:
    return Source.objects.create(
        name="public", kind="sitemap", url=f"http://{host}:{site.port}/sitemap.xml",
        schedule="0 3 * * *", spacing_seconds=0,
    )  # fmt: skip


def test_a_name_that_resolves_to_loopback_is_refused_without_the_flag(site, resolver):
    """Nothing at all is requested, robots.txt included; with the flag the same name works."""
    resolver["docs.example"] = ["127.0.0.1"]
    source = public_source(site)
    with pytest.raises(http.ForbiddenAddress) as refused:
        http.get(source, f"http://docs.example:{site.port}/docs/a.html")
    assert refused.value.transient is False
    assert "127.0.0.1" in str(refused.value) and "--allow-private" in str(refused.value)
    assert site.requests == []
    Source.objects.filter(pk=source.pk).update(allow_private=True)
    source.refresh_from_db()
    response = http.get(source, f"http://docs.example:{site.port}/docs/a.html")
    assert response.status == 200 and b"the first document" in response.body
    assert [request.headers["host"] for request in site.requests] == [
        f"docs.example:{site.port}"
    ] * 2  # robots.txt and the page, with the name in Host although we connected by IP


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "::ffff:127.0.0.1", "169.254.169.254", "10.1.2.3"]
)
def test_a_public_source_reaches_no_internal_address(site, resolver, address):
    resolver["docs.example"] = [address]
    with pytest.raises(http.ForbiddenAddress):
        http.get(public_source(site), f"http://docs.example:{site.port}/docs/a.html")
    assert site.requests == []


def test_a_metadata_address_is_named_as_never_reachable_for_a_flagged_source(site, resolver):
    """Not "--allow-private covers the source's own host only", which reads as a way in."""
    source = public_source(site)
    Source.objects.filter(pk=source.pk).update(allow_private=True)
    source.refresh_from_db()
    resolver["meta.example"] = ["169.254.169.254"]
    with pytest.raises(http.ForbiddenAddress) as refused:
        http.get(source, "http://meta.example/latest/meta-data/")
    assert "no source may reach" in str(refused.value)


def test_a_name_with_one_internal_address_among_public_ones_is_refused(site, resolver):
    resolver["docs.example"] = ["93.184.215.14", "127.0.0.1"]
    with pytest.raises(http.ForbiddenAddress) as refused:
        http.get(public_source(site), f"http://docs.example:{site.port}/docs/a.html")
    assert "127.0.0.1" in str(refused.value)
    assert site.requests == []


def test_dns_rebinding_between_the_check_and_the_connection_is_refused(site, resolver):
    """The first lookup (the early check) says public, the next one (the connection's)
    says loopback: the connection judges its own answer, and connects to nothing."""
    answers = iter([["93.184.215.14"]] + [["127.0.0.1"]] * 10)
    resolver["docs.example"] = lambda: next(answers)
    with pytest.raises(http.ForbiddenAddress):
        http.get(public_source(site), f"http://docs.example:{site.port}/docs/a.html")
    assert site.requests == []
    assert resolver["lookups"].count("docs.example") >= 2


def test_the_connection_judges_its_own_answer_even_without_the_early_check(
    site, resolver, monkeypatch
):
    """The early check (``check_address``) is only the friendly answer: with it gone, the
    connection's own lookup still refuses, and nothing reaches the server."""
    monkeypatch.setattr(http, "check_address", lambda source, url: None)
    resolver["docs.example"] = ["127.0.0.1"]
    with pytest.raises(http.ForbiddenAddress):
        http.get(public_source(site), f"http://docs.example:{site.port}/docs/a.html")
    assert site.requests == []


def test_allow_private_covers_the_source_own_host_only(site, resolver):
    """An internal site's feed or sitemap, whose entries anyone may write, cannot send a
    flagged source's workers to another internal host, nor to another port of its own."""
    resolver["intranet.example"] = ["127.0.0.1"]
    resolver["other.example"] = ["127.0.0.1"]
    source = public_source(site, host="intranet.example")
    Source.objects.filter(pk=source.pk).update(allow_private=True)
    source.refresh_from_db()
    assert http.get(source, f"http://INTRANET.example:{site.port}/docs/a.html").status == 200
    site.requests.clear()
    for url in [
        f"http://other.example:{site.port}/docs/a.html",
        f"http://127.0.0.1:{site.port}/docs/a.html",
        f"http://localhost:{site.port}/docs/a.html",
        f"http://intranet.example:{free_port()}/docs/a.html",
    ]:
        with pytest.raises(http.ForbiddenAddress) as refused:
            http.get(source, url)
        assert "own host only" in str(refused.value), url
    site.redirects["/hop"] = f"http://localhost:{site.port}/docs/a.html"
    with pytest.raises(http.ForbiddenAddress):
        http.get(source, f"http://intranet.example:{site.port}/hop")
    assert paths(site) == ["/hop"]


def test_a_redirect_to_a_name_resolving_internal_is_refused(site, resolver):
    resolver["docs.example"] = ["127.0.0.1"]
    resolver["evil.example"] = ["127.0.0.1"]
    source = public_source(site)
    Source.objects.filter(pk=source.pk).update(allow_private=True)
    source.refresh_from_db()
    site.redirects["/away"] = "http://169.254.169.254/latest/meta-data/"
    with pytest.raises(http.ForbiddenAddress):
        http.get(source, f"http://docs.example:{site.port}/away")
    assert paths(site) == ["/robots.txt", "/away"]


@pytest.mark.parametrize(
    "url", ["http://169.254.169.254/latest/meta-data/", "http://0.0.0.0:8000/", "http://[ff02::1]/"]
)
def test_metadata_and_unspecified_addresses_are_refused_even_with_the_flag(site, source, url):
    with pytest.raises(http.ForbiddenAddress) as refused:
        http.get(source, url)  # refused before any connection: nothing listens there
    assert refused.value.transient is False
    assert url in str(refused.value)
    assert site.requests == []


def test_a_redirect_to_the_metadata_address_is_refused(site, source):
    site.redirects["/metadata"] = "http://169.254.169.254/latest/meta-data/"
    with pytest.raises(http.ForbiddenAddress) as refused:
        http.get(source, site.url("/metadata"))
    assert "http://169.254.169.254/latest/meta-data/" in str(refused.value)
    assert paths(site) == ["/robots.txt", "/metadata"]


def test_a_public_source_cannot_reach_localhost(site):
    """A third-party listing that points at 127.0.0.1 is refused before any request."""
    public = Source.objects.create(
        name="public", kind="sitemap", url="http://93.184.215.14/sitemap.xml", schedule="0 3 * * *"
    )
    with pytest.raises(http.ForbiddenAddress):
        http.get(public, site.url("/docs/a.html"))
    assert site.requests == []


def _raw_reply(encodings: list[str], body: bytes, trickle: float = 0.0):
    def answer(handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/plain")
        if encodings:
            handler.send_header("Content-Encoding", ", ".join(encodings))
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if not trickle:
            handler.wfile.write(body)
            return
        for byte in body:
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(trickle)

    return answer


def test_stacked_gzip_is_capped_on_decoded_bytes(site, source, settings):
    """gzip, gzip: about 20 KB on the wire, 1 GiB decoded; stopped at the cap, fast."""
    bomb = gzip.compress(gzip.compress(b"\0" * (1 << 30), 9), 9)
    assert len(bomb) < 64 * 1024
    site.raw["/bomb"] = _raw_reply(["gzip", "gzip"], bomb)
    settings.HOLDFAST_FETCH_MAX_BYTES = 1024 * 1024
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(http.TooLarge) as refused:
            http.get(source, site.url("/bomb"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.transient is False and "cap" in str(refused.value)
    assert peak < 32 * 1024 * 1024, peak
    assert time.monotonic() - started < 10


def test_an_encoded_body_that_decodes_to_nothing_is_capped_on_the_wire(site, source, settings):
    """Empty gzip members decode to nothing: without a bound on the wire the worker would
    read them until the deadline."""
    settings.HOLDFAST_FETCH_MAX_BYTES = 256 * 1024
    empty = gzip.compress(b"")
    site.raw["/empties"] = _raw_reply(["gzip"], empty * (4 * 1024 * 1024 // len(empty)))
    with pytest.raises(http.TooLarge) as refused:
        http.get(source, site.url("/empties"))
    assert "encoded body" in str(refused.value)
    incompressible = os.urandom(200 * 1024)  # gzip makes it a little bigger: still read
    site.raw["/random"] = _raw_reply(["gzip"], gzip.compress(incompressible))
    assert http.get(source, site.url("/random")).body == incompressible


def _cut_reply(encoding: str, wire: bytes):
    """A 200 whose length is the connection's, closed inside the compressed stream."""

    def answer(handler) -> None:
        handler.wfile.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Encoding: "
            + encoding.encode()
            + b"\r\nConnection: close\r\n\r\n"
            + wire
        )
        handler.close_connection = True

    return answer


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compressed_body_cut_in_transit_is_a_transient_error(site, source, encoding):
    """No Content-Length: only the stream's own end marker says the body is whole. A cut
    one decoded to half a document, which was stored over the good one (audit)."""
    whole = b"a line of the document\n" * 5000
    wire = gzip.compress(whole) if encoding == "gzip" else zlib.compress(whole)
    site.raw["/cut"] = _cut_reply(encoding, wire[: len(wire) // 2])
    with pytest.raises(http.FetchError) as failed:
        http.get(source, site.url("/cut"))
    assert failed.value.transient is True
    assert f"the {encoding} body was cut before its end" in str(failed.value)
    site.raw["/whole"] = _cut_reply(encoding, wire)  # the same, arriving whole
    assert http.get(source, site.url("/whole")).body == whole


def test_stacked_encodings_are_decoded_in_order(site, source):
    body = b"deflated then gzipped " * 100
    wire = gzip.compress(zlib.compress(body))
    site.raw["/stacked"] = _raw_reply(["deflate", "gzip"], wire)
    assert http.get(source, site.url("/stacked")).body == body


def test_a_one_byte_per_second_body_is_stopped_at_the_deadline(site, source, settings):
    """Every read gets a byte within the per-read timeout; the total deadline ends it."""
    settings.HOLDFAST_FETCH_DEADLINE_SECONDS = 2
    settings.HOLDFAST_FETCH_TIMEOUT_SECONDS = 20
    site.raw["/trickle"] = _raw_reply([], b"x" * 60, trickle=0.5)
    started = time.monotonic()
    with pytest.raises(http.FetchError) as failed:
        http.get(source, site.url("/trickle"))
    took = time.monotonic() - started
    assert failed.value.transient is True
    assert "deadline of 2 s" in str(failed.value)
    assert 1.5 < took < 6, took


def test_the_deadline_spans_a_chain_of_slow_redirects_and_slow_headers(site, source, settings):
    """Each hop answers within the per-read timeout, its headers a line at a time; the
    deadline is the whole call's, so the chain is cut off there."""
    settings.HOLDFAST_FETCH_DEADLINE_SECONDS = 2
    settings.HOLDFAST_FETCH_TIMEOUT_SECONDS = 20

    def slow_hop(n: int):
        def answer(handler) -> None:
            handler.wfile.write(b"HTTP/1.1 302 Found\r\n")
            for line in (f"Location: /hop{n + 1}", "Content-Length: 0", ""):
                handler.wfile.flush()
                time.sleep(0.25)
                handler.wfile.write(line.encode() + b"\r\n")

        return answer

    for n in range(5):
        site.raw[f"/hop{n}"] = slow_hop(n)
    started = time.monotonic()
    with pytest.raises(http.FetchError) as failed:
        http.get(source, site.url("/hop0"))
    assert "deadline of 2 s" in str(failed.value), failed.value
    assert time.monotonic() - started < 6


def test_add_source_refuses_a_private_address_at_once_naming_it(resolver):
    resolver["intranet.example"] = ["10.0.0.8"]
    with pytest.raises(InvalidJob) as refused:
        add_source("intranet", "sitemap", "http://intranet.example/sitemap.xml")
    assert "10.0.0.8" in str(refused.value) and "--allow-private" in str(refused.value)
    source = add_source(
        "intranet", "sitemap", "http://intranet.example/sitemap.xml", allow_private=True
    )
    assert source.allow_private is True
    with pytest.raises(InvalidJob) as refused:
        add_source("meta", "sitemap", "http://169.254.169.254/", allow_private=True)
    assert "169.254.169.254" in str(refused.value)


def test_requests_of_one_source_are_spaced(site):
    source = make_source(site, spacing=0.3)
    for _ in range(3):
        http.get(source, site.url("/docs/a.html"))
    times = [request.time for request in site.requests]  # robots.txt, then three pages
    assert len(times) == 4
    assert all(later - earlier >= 0.25 for earlier, later in pairwise(times)), times
    source.refresh_from_db()
    assert source.next_request_at is not None


@pytest.mark.django_db(transaction=True)
def test_the_source_row_is_not_locked_while_a_request_waits_its_turn(site):
    source = make_source(site, spacing=2.0)
    http.wait_turn(source)  # the next slot is now 2 s away
    waiter = threading.Thread(target=_wait_in_thread, args=(source,))
    waiter.start()
    time.sleep(0.3)  # the thread has reserved its slot and is sleeping
    started = time.monotonic()
    with transaction.atomic():
        locked = Source.objects.select_for_update().get(pk=source.pk)
        Source.objects.filter(pk=locked.pk).update(max_pages_per_run=5)
    assert time.monotonic() - started < 0.5
    waiter.join(5)
    assert not waiter.is_alive()


def test_spacing_is_held_to_the_cap_whatever_the_row_says(site):
    """A row written around add_source's check neither overflows nor waits past the cap."""
    source = make_source(site, spacing=1e308)
    before = timezone.now()
    assert http.wait_turn(source) <= 0
    source.refresh_from_db()
    ahead = (source.next_request_at - before).total_seconds()
    assert http.MAX_SPACING_SECONDS <= ahead < http.MAX_SPACING_SECONDS + 5


def _wait_in_thread(source: Source) -> None:
    try:
        http.wait_turn(source)
    finally:
        connection.close()


@pytest.mark.process
def test_spacing_holds_across_two_processes(site, worker_env, tmp_path):
    spacing = 0.5
    source = make_source(site, spacing=spacing)
    # robots.txt already known, and the first slot a moment away so both processes queue.
    Source.objects.filter(pk=source.pk).update(
        robots_txt="User-agent: *\nDisallow:\n",
        robots_fetched_at=timezone.now(),
        next_request_at=timezone.now() + timedelta(seconds=2),
    )
    code = (
        "from ingestion import http\nfrom ingestion.models import Source\n"
        "source = Source.objects.get(name='fixture')\n"
        "for _ in range(3):\n"
        "    http.get(source, {url!r}, headers={{'X-Process': {name!r}}})\n"
    )
    with WorkerPool(worker_env, tmp_path / "logs") as pool:
        procs = [
            pool.spawn(name, "shell", "-c", code.format(url=site.url("/docs/a.html"), name=name))
            for name in ("p1", "p2")
        ]
        for proc in procs:
            assert proc.wait_exit(30) == 0, proc.describe()
    requests = sorted(site.requests, key=lambda request: request.time)
    assert sorted(request.headers["x-process"] for request in requests) == ["p1"] * 3 + ["p2"] * 3
    gaps = [later.time - earlier.time for earlier, later in pairwise(requests)]
    assert min(gaps) >= spacing - 0.1, gaps


@pytest.mark.process
def test_spacing_holds_across_two_workers_discovering_and_fetching(site, worker_env, tmp_path):
    """Discovery on one worker enqueues fetches that both workers run: every request to
    the source, from either worker, keeps the spacing (times recorded by the server)."""
    spacing = 0.4
    for n in range(2, 7):
        site.add(f"/docs/{n}.html", f"Doc {n}", f"text {n}")
    source = add_source(
        "spaced", "sitemap", site.url("/sitemap.xml"), spacing=spacing, allow_private=True
    )
    job, _ = start_discovery(source)
    with WorkerPool(worker_env, tmp_path / "logs") as pool:
        pool.start("w1")
        pool.start("w2")
        fetches = Job.objects.filter(kind="ingestion.fetch_artifact")

        def all_fetched() -> bool:
            states = set(fetches.values_list("state", flat=True))
            return fetches.count() == 6 and states == {State.SUCCEEDED}

        wait_until(all_fetched, 30, interval=0.1, message=lambda: job_summary())
    assert Job.objects.get(pk=job.pk).state == State.SUCCEEDED
    fetchers = set(Lease.objects.filter(job__in=fetches).values_list("worker_id", flat=True))
    assert fetchers == {"w1", "w2"}
    requests = sorted(site.requests, key=lambda request: request.time)
    assert len(requests) == 1 + 3 + 6  # robots.txt, the index and 2 sitemaps, 6 documents
    gaps = [later.time - earlier.time for earlier, later in pairwise(requests)]
    assert min(gaps) >= spacing - 0.1, gaps


@pytest.fixture
def tls_site(tmp_path):
    """An HTTPS server on 127.0.0.1 with a self-signed certificate for docs.example; it
    records the SNI names it was asked for."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=docs.example",
         "-addext", "subjectAltName=DNS:docs.example"],
        check=True, capture_output=True,
    )  # fmt: skip
    names: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"over tls" if self.path != "/robots.txt" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda sock, name, ctx: names.append(name)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], cert, names
    finally:
        server.shutdown()
        server.server_close()


def test_https_connects_by_ip_with_the_host_name_for_sni_and_the_certificate(
    tls_site, resolver, monkeypatch
):
    """The pinned connection still does TLS as the URL's host: SNI is the name, and the
    certificate is checked against the name (not the IP connected to)."""
    port, cert, names = tls_site
    monkeypatch.setattr(
        http.httpx, "create_ssl_context", lambda **kw: ssl.create_default_context(cafile=cert)
    )
    resolver["docs.example"] = ["127.0.0.1"]
    resolver["other.example"] = ["127.0.0.1"]
    for host in ("docs.example", "other.example"):
        Source.objects.create(
            name=host, kind="sitemap", url=f"https://{host}:{port}/sitemap.xml",
            schedule="0 3 * * *", spacing_seconds=0, allow_private=True,
        )  # fmt: skip
    response = http.get(Source.objects.get(name="docs.example"), f"https://docs.example:{port}/x")
    assert (response.status, response.body) == (200, b"over tls")
    assert set(names) == {"docs.example"}
    with pytest.raises(http.FetchError) as refused:  # the certificate does not name it
        http.get(Source.objects.get(name="other.example"), f"https://other.example:{port}/x")
    assert "certificate" in str(refused.value).lower() or "hostname" in str(refused.value)
    # The site's certificate is its configuration: retrying within minutes cannot help.
    assert refused.value.transient is False
    assert "TLS certificate refused" in str(refused.value)


def test_an_untrusted_certificate_is_a_permanent_error_naming_it(tls_site, resolver):
    port, _, _ = tls_site  # self-signed: no trusted authority signed it
    resolver["docs.example"] = ["127.0.0.1"]
    source = Source.objects.create(
        name="tls", kind="sitemap", url=f"https://docs.example:{port}/sitemap.xml",
        schedule="0 3 * * *", spacing_seconds=0, allow_private=True,
    )  # fmt: skip
    with pytest.raises(http.FetchError) as refused:
        http.get(source, f"https://docs.example:{port}/x")
    assert refused.value.transient is False
    assert "TLS certificate refused" in str(refused.value) and "self-signed" in str(refused.value)


@pytest.fixture
def blackhole(site: FixtureSite) -> Iterator[str]:
    """127.0.0.2 on the site's port: a listener whose backlog is full and that never
    accepts, so a connect there times out (a dead A or AAAA record)."""
    listener = socket.socket()
    listener.bind(("127.0.0.2", site.port))
    listener.listen(0)
    fillers = [socket.socket() for _ in range(4)]
    for filler in fillers:
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.2", site.port))
    time.sleep(0.2)
    probe = socket.socket()
    probe.settimeout(0.5)
    try:
        probe.connect(("127.0.0.2", site.port))
        pytest.fail("could not make a black-holed address on 127.0.0.2")
    except TimeoutError:
        pass
    finally:
        probe.close()
    try:
        yield "127.0.0.2"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def test_a_dead_first_address_falls_back_to_the_next(site, resolver, blackhole, settings):
    """A connect that times out on one address goes on to the next, as
    socket.create_connection and browsers do; it raised at once (audit)."""
    settings.HOLDFAST_FETCH_TIMEOUT_SECONDS = 1
    resolver["dual.example"] = [blackhole, "127.0.0.1"]
    source = Source.objects.create(
        name="dual", kind="sitemap", url=f"http://dual.example:{site.port}/sitemap.xml",
        schedule="0 3 * * *", spacing_seconds=0, allow_private=True,
    )  # fmt: skip
    response = http.get(source, f"http://dual.example:{site.port}/docs/a.html")
    assert response.status == 200
    resolver["dual.example"] = [blackhole]  # no other address: the timeout, transient
    with pytest.raises(http.FetchError) as failed:
        http.get(source, f"http://dual.example:{site.port}/docs/b.html")
    assert failed.value.transient is True and "ConnectTimeout" in str(failed.value)
