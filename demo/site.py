"""A small website on 127.0.0.1 to discover and fetch from: the tests' and the demo's source.

It serves a sitemap index, paged Atom and RSS feeds (RFC 5005 ``next`` links), robots.txt,
and its documents as HTML with strong ETags and Last-Modified (answering conditional
requests with 304), plus fixed routes that misbehave on purpose. Listings always show the
current ``documents``, so a test can add, change and remove documents between discovery
cycles and watch Holdfast notice. Every request is recorded with its arrival time::

    with FixtureSite() as site:
        site.add("/docs/a.html", "A", "first text")
        add_source("local", "sitemap", site.url("/sitemap.xml"), spacing=0, allow_private=True)
        ...
        assert [r.path for r in site.requests] == [...]

Routes: ``/robots.txt`` (``robots_txt``; None answers 404), ``/sitemap.xml`` (the index)
and ``/sitemaps/N.xml``, ``/feed.xml?page=N`` (Atom), ``/rss.xml?page=N`` (RSS),
``/status/CODE``, ``/slow`` (answers after ``slow_seconds``), ``/huge`` (``huge_bytes``),
``/redirect/N`` (N hops, then 200), ``/private/page.html`` (disallowed by the default
robots.txt), ``redirects`` (path to path, ahead of every other route), and ``hold(path)``
to stall one path until released. Listings hold the documents, then ``extra_urls`` (e.g.
``/status/404``). With ``feed_loops`` the last feed page's ``next`` link leads back to
page 1, like a broken feed whose paging goes round in a circle.

Run it alone for the demo: ``.venv/bin/python -m demo.site --port 8008``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import html
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime, parsedate_to_datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import MappingProxyType
from typing import Any, NamedTuple, Self
from urllib.parse import parse_qs, urlsplit

DEFAULT_ROBOTS = "User-agent: *\nDisallow: /private/\n"
SITEMAP_NS = "http://www.sitemaps.org/schemas/sitemap/0.9"
ATOM_NS = "http://www.w3.org/2005/Atom"
XML_DECLARATION = '<?xml version="1.0" encoding="UTF-8"?>\n'
HOLD_TIMEOUT = 60.0  # seconds a held request waits at most, so a failed test cannot hang


@dataclass
class Document:
    """One page of the site; ``lastmod`` moves forward on every change."""

    title: str
    body_html: str
    lastmod: datetime

    @property
    def body(self) -> bytes:
        return self.body_html.encode()

    @property
    def etag(self) -> str:
        """A strong ETag: the sha256 of the body."""
        return f'"{hashlib.sha256(self.body).hexdigest()}"'


class RecordedRequest(NamedTuple):
    time: float  # time.time() on arrival
    method: str
    path: str  # with the query string
    headers: dict[str, str]  # names lower-cased


class Entry(NamedTuple):
    """One URL as the listings show it."""

    url: str
    title: str
    lastmod: datetime | None


def w3c(moment: datetime) -> str:
    """The W3C datetime that sitemaps and Atom use, in UTC."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def page_html(title: str, text: str) -> str:
    return (
        f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"</head>\n<body><h1>{html.escape(title)}</h1>\n<p>{html.escape(text)}</p></body></html>\n"
    )


class FixtureSite:
    """The site, served by a ``ThreadingHTTPServer`` on a random port in a daemon thread."""

    def __init__(
        self,
        *,
        robots_txt: str | None = DEFAULT_ROBOTS,
        per_sitemap: int = 3,
        per_feed_page: int = 3,
        slow_seconds: float = 5.0,
        huge_bytes: int = 2 * 1024 * 1024,
        port: int = 0,
    ) -> None:
        self.robots_txt = robots_txt
        self.per_sitemap = per_sitemap
        self.per_feed_page = per_feed_page
        self.slow_seconds = slow_seconds
        self.huge_bytes = huge_bytes
        self.documents: dict[str, Document] = {}
        self.extra_urls: list[str] = []
        self.feed_loops = False
        self.redirects: dict[str, str] = {}
        # Tests answer a path their own way: the callable writes the whole raw response
        # (status line, headers, body) to the socket, e.g. a stacked encoding or a trickle.
        self.raw: dict[str, Callable[[BaseHTTPRequestHandler], None]] = {}
        # Or with a fixed reply: (status, content type, body[, extra headers]).
        self.replies: dict[str, tuple[Any, ...]] = {}
        self.requests: list[RecordedRequest] = []
        self.port = port
        self._holds: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._last_lastmod = datetime(2000, 1, 1, tzinfo=UTC)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> Self:
        handler = type("FixtureHandler", (_Handler,), {"site": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fixture-site", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        for event in list(self._holds.values()):
            event.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    # --- content -------------------------------------------------------------------------

    def add(self, path: str, title: str, text: str, lastmod: datetime | None = None) -> Document:
        document = Document(title, page_html(title, text), self._next_lastmod(lastmod))
        with self._lock:
            self.documents[path] = document
        return document

    def change(self, path: str, text: str, lastmod: datetime | None = None) -> Document:
        """Give a document a new body; its lastmod moves on unless one is given."""
        with self._lock:
            document = self.documents[path]
            document.body_html = page_html(document.title, text)
            document.lastmod = self._next_lastmod(lastmod)
        return document

    def remove(self, path: str) -> None:
        with self._lock:
            del self.documents[path]

    def add_samples(self) -> None:
        """A handful of documents with real prose, for the demo and search."""
        for path, title, text in SAMPLES:
            self.add(path, title, text)

    def _next_lastmod(self, lastmod: datetime | None) -> datetime:
        if lastmod is None:
            now = datetime.now(UTC).replace(microsecond=0)
            lastmod = max(now, self._last_lastmod + timedelta(seconds=1))
        self._last_lastmod = max(self._last_lastmod, lastmod)
        return lastmod

    # --- requests ------------------------------------------------------------------------

    def hold(self, path: str) -> threading.Event:
        """Stall requests for ``path`` (without the query) until the event is set."""
        event = threading.Event()
        self._holds[path] = event
        return event

    def requests_to(self, path: str) -> list[RecordedRequest]:
        with self._lock:
            return [request for request in self.requests if request.path == path]

    def record(self, request: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def held(self, path: str) -> threading.Event | None:
        return self._holds.get(path)

    # --- listings ------------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        """What the sitemaps list: the documents by path, then ``extra_urls``."""
        with self._lock:
            documents = sorted(self.documents.items())
            extras = list(self.extra_urls)
        listed = [Entry(self.url(path), doc.title, doc.lastmod) for path, doc in documents]
        return listed + [Entry(self._absolute(url), url, None) for url in extras]

    def feed_entries(self) -> list[Entry]:
        """What the feeds list: newest first, like a real feed."""
        epoch = datetime.min.replace(tzinfo=UTC)
        return sorted(self.entries(), key=lambda entry: entry.lastmod or epoch, reverse=True)

    def _absolute(self, url: str) -> str:
        return url if "://" in url else self.url(url)

    def sitemap_count(self) -> int:
        return max(1, math.ceil(len(self.entries()) / self.per_sitemap))

    def feed_page_count(self) -> int:
        return max(1, math.ceil(len(self.entries()) / self.per_feed_page))

    def sitemap_index(self) -> str:
        children = "".join(
            f"<sitemap><loc>{self.url(f'/sitemaps/{n}.xml')}</loc></sitemap>\n"
            for n in range(1, self.sitemap_count() + 1)
        )
        return f'{XML_DECLARATION}<sitemapindex xmlns="{SITEMAP_NS}">\n{children}</sitemapindex>\n'

    def sitemap(self, number: int) -> str | None:
        if not 1 <= number <= self.sitemap_count():
            return None
        chunk = self.entries()[(number - 1) * self.per_sitemap : number * self.per_sitemap]
        urls = "".join(
            f"<url><loc>{html.escape(entry.url)}</loc>"
            + (f"<lastmod>{w3c(entry.lastmod)}</lastmod>" if entry.lastmod else "")
            + "</url>\n"
            for entry in chunk
        )
        return f'{XML_DECLARATION}<urlset xmlns="{SITEMAP_NS}">\n{urls}</urlset>\n'

    def _feed_page(self, number: int) -> list[Entry] | None:
        if not 1 <= number <= self.feed_page_count():
            return None
        size = self.per_feed_page
        return self.feed_entries()[(number - 1) * size : number * size]

    def atom(self, number: int) -> str | None:
        entries = self._feed_page(number)
        if entries is None:
            return None
        links = self._page_links("/feed.xml", number, "link")
        items = "".join(
            f"<entry><title>{html.escape(entry.title)}</title>"
            f'<link href="{html.escape(entry.url)}"/><id>{html.escape(entry.url)}</id>'
            f"<updated>{w3c(entry.lastmod or self._last_lastmod)}</updated></entry>\n"
            for entry in entries
        )
        return (
            f'{XML_DECLARATION}<feed xmlns="{ATOM_NS}">\n'
            f"<title>Fixture site</title><id>{self.url('/feed.xml')}</id>"
            f"<updated>{w3c(self._last_lastmod)}</updated>\n{links}{items}</feed>\n"
        )

    def rss(self, number: int) -> str | None:
        entries = self._feed_page(number)
        if entries is None:
            return None
        links = self._page_links("/rss.xml", number, "atom:link")
        items = "".join(
            f"<item><title>{html.escape(entry.title)}</title>"
            f"<link>{html.escape(entry.url)}</link><guid>{html.escape(entry.url)}</guid>"
            + (
                f"<pubDate>{format_datetime(entry.lastmod, usegmt=True)}</pubDate>"
                if entry.lastmod
                else ""
            )
            + "</item>\n"
            for entry in entries
        )
        return (
            f'{XML_DECLARATION}<rss version="2.0" xmlns:atom="{ATOM_NS}">'
            f"<channel>\n<title>Fixture site</title><link>{self.base_url}/</link>"
            f"<description>Fixture site</description>\n{links}{items}</channel></rss>\n"
        )

    def _page_links(self, path: str, number: int, tag: str) -> str:
        """RFC 5005 paging links: self, first, last, and next/previous where they exist."""
        last = self.feed_page_count()
        rels = {"self": number, "first": 1, "last": last}
        if number < last:
            rels["next"] = number + 1
        elif self.feed_loops and last > 1:
            rels["next"] = 1
        if number > 1:
            rels["previous"] = number - 1
        return "".join(
            f'<{tag} rel="{rel}" href="{self.url(path)}?page={page}"/>\n'
            for rel, page in rels.items()
        )


class _Handler(BaseHTTPRequestHandler):
    site: FixtureSite
    server_version = "FixtureSite/1.0"

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the site records requests in ``site.requests`` instead."""

    def _answer(self, head: bool) -> None:
        site = self.site
        headers = {name.lower(): value for name, value in self.headers.items()}
        site.record(RecordedRequest(time.time(), self.command, self.path, headers))
        parts = urlsplit(self.path)
        held = site.held(parts.path)
        if held is not None:
            held.wait(HOLD_TIMEOUT)
        custom = site.raw.get(parts.path)
        if custom is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                custom(self)
            return
        fixed = site.replies.get(parts.path)
        if fixed is not None:
            status, content_type, body, *extra = fixed
            reply = Reply(status, content_type, body, *(extra or [{}]))
        else:
            reply = self._route(parts.path, parse_qs(parts.query), headers)
        # The client may have given up (a timeout, a size cap): nothing more to say then.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._send(reply, head)

    def _route(self, path: str, query: dict[str, list[str]], headers: dict[str, str]) -> Reply:
        site = self.site
        page = _page_number(query)
        if path in site.redirects:  # first: a test may move any page, listings included
            return _redirect(site.redirects[path])
        if path == "/robots.txt":
            if site.robots_txt is None:
                return Reply(404, "text/plain", b"no robots.txt\n")
            return Reply(200, "text/plain", site.robots_txt.encode())
        if path == "/sitemap.xml":
            return _xml(site.sitemap_index())
        if path.startswith("/sitemaps/") and path.endswith(".xml"):
            number = path.removeprefix("/sitemaps/").removesuffix(".xml")
            return _xml(site.sitemap(int(number)) if number.isdigit() else None)
        if path == "/feed.xml":
            return _xml(site.atom(page) if page else None, "application/atom+xml")
        if path == "/rss.xml":
            return _xml(site.rss(page) if page else None, "application/rss+xml")
        if path.startswith("/status/") and path.removeprefix("/status/").isdigit():
            code = int(path.removeprefix("/status/"))
            return Reply(code, "text/plain", f"status {code}\n".encode())
        if path == "/slow":
            time.sleep(site.slow_seconds)
            return Reply(200, "text/plain", b"finally\n")
        if path == "/huge":
            return Reply(200, "text/plain", b"x" * site.huge_bytes)
        if path.startswith("/redirect/") and path.removeprefix("/redirect/").isdigit():
            hops = int(path.removeprefix("/redirect/"))
            if hops == 0:
                return Reply(200, "text/plain", b"end of the redirect chain\n")
            return _redirect(f"/redirect/{hops - 1}")
        if path.startswith("/private/"):
            text = page_html("Private", "Crawlers are asked not to read this.")
            return Reply(200, HTML, text.encode())
        document = site.documents.get(path)
        if document is None:
            return Reply(404, "text/plain", b"not found\n")
        return _document(document, headers)

    def _send(self, reply: Reply, head: bool) -> None:
        self.send_response(reply.status, _reason(reply.status))
        if reply.content_type:
            self.send_header("Content-Type", reply.content_type)
        for name, value in reply.headers.items():
            self.send_header(name, value)
        if reply.status != 304:
            self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        if not head and reply.status != 304:
            self.wfile.write(reply.body)


HTML = "text/html; charset=utf-8"


class Reply(NamedTuple):
    status: int
    content_type: str | None
    body: bytes
    headers: Mapping[str, str] = MappingProxyType({})


def _xml(text: str | None, content_type: str = "application/xml") -> Reply:
    if text is None:
        return Reply(404, "text/plain", b"no such page\n")
    return Reply(200, f"{content_type}; charset=utf-8", text.encode())


def _redirect(target: str) -> Reply:
    return Reply(302, "text/plain", b"moved\n", {"Location": target})


def _document(document: Document, headers: dict[str, str]) -> Reply:
    modified = document.lastmod.replace(microsecond=0)
    validators = {"ETag": document.etag, "Last-Modified": format_datetime(modified, usegmt=True)}
    if _not_modified(document.etag, modified, headers):
        return Reply(304, None, b"", validators)
    return Reply(200, HTML, document.body, validators)


def _page_number(query: dict[str, list[str]]) -> int | None:
    value = query.get("page", ["1"])[0]
    return int(value) if value.isdigit() else None


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Status"


def _etags(value: str) -> Iterable[str]:
    for tag in value.split(","):
        yield tag.strip().removeprefix("W/")


def _not_modified(etag: str, modified: datetime, headers: dict[str, str]) -> bool:
    """RFC 9110 §13.2.2: If-None-Match decides when present, else If-Modified-Since."""
    if "if-none-match" in headers:
        tags = set(_etags(headers["if-none-match"]))
        return "*" in tags or etag in tags
    since = headers.get("if-modified-since")
    if not since:
        return False
    try:
        return modified <= parsedate_to_datetime(since)
    except (TypeError, ValueError):
        return False


SAMPLES = [
    (
        "/docs/lighthouses.html",
        "Lighthouses of the North Sea",
        "A lighthouse keeper trimmed the wick every four hours; the fog signal ran on "
        "compressed air from a hand-cranked pump.",
    ),
    (
        "/docs/tides.html",
        "Reading a tide table",
        "Spring tides follow the full and new moon; neap tides fall between them, when the "
        "sun and moon pull at right angles.",
    ),
    (
        "/docs/knots.html",
        "Knots every sailor ties",
        "The bowline makes a fixed loop that will not slip; the clove hitch holds a line to "
        "a post and is quick to untie.",
    ),
    (
        "/docs/charts.html",
        "Nautical charts",
        "Depths on a chart are given at the lowest astronomical tide, so the water is "
        "usually deeper than the number printed.",
    ),
    (
        "/docs/weather.html",
        "Shipping forecast",
        "Gale warnings name the sea area first, then the wind force on the Beaufort scale "
        "and its direction.",
    ),
    (
        "/docs/harbours.html",
        "Small harbours",
        "A drying harbour empties at low water; boats settle on the mud on legs or twin "
        "keels until the flood returns.",
    ),
    (
        "/docs/navigation.html",
        "Dead reckoning",
        "Without satellites, position comes from speed, heading and time run, corrected by "
        "bearings on known landmarks.",
    ),
]


def main() -> None:
    """Serve the sample site until interrupted (used by the demo)."""
    parser = argparse.ArgumentParser(description="Serve the Holdfast fixture site.")
    parser.add_argument("--port", type=int, default=8008)
    options = parser.parse_args()
    site = FixtureSite(port=options.port).start()
    site.add_samples()
    print(f"fixture site at {site.base_url}/sitemap.xml and {site.base_url}/feed.xml", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        site.stop()


if __name__ == "__main__":
    main()
