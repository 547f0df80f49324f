"""Reading listings as the web writes them: sitemaps (XML and text), robots.txt, feeds.

Real-world listings are often not well-formed. This module recovers what the tolerant
parsers crawlers rely on recover (ultimate-sitemap-parser for sitemaps, feedparser for
feeds), and refuses what is dangerous:

* **Refused**: any entity declaration (``<!ENTITY``: the "billion laughs", external
  entities reading local files or URLs). Nothing is ever expanded but the five XML
  entities, character references and HTML's named entities (``&nbsp;``), which are
  plain characters.
* **Recovered**: the entries before a truncation or a syntax error; a raw ``&``; HTML
  entities; undeclared namespace prefixes (``<image:image>`` without ``xmlns:image``);
  a comment, whitespace or BOM before ``<?xml``; a charset given only in the HTTP
  ``Content-Type``; an unknown encoding label over bytes that are valid UTF-8.
* **Also read**: text sitemaps (one URL a line, sitemaps.org), robots.txt ``Sitemap:``
  lines, RFC 5005 ``next`` and ``prev-archive`` links, ``fh:complete`` feeds.

A recovered page says what it recovered from in ``Listing.defect``: its entries are used,
but the run knows it may not have seen all of them. What cannot be read at all raises
:class:`ListingError`, a defect of the listing (never retried as transient).

``lastmod`` values are validated: :func:`normalize_lastmod` gives the canonical form of a
W3C datetime (or RFC 822 date), and "" for anything else, which counts as unknown.
"""

from __future__ import annotations

import codecs
import html.entities
import io
import re
import zlib
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urldefrag, urljoin, urlsplit
from xml.parsers import expat
from xml.sax import SAXException

import feedparser
from django.conf import settings
from protego import Protego

from jobs.exceptions import HoldfastError

LASTMOD_LENGTH = 64
FEED_ROOTS = ("feed", "rss", "rdf")
# A gzipped listing's members: bgzip writes one per 64 KiB, so a 10 MiB cap is 160 of them;
# a file of thousands of empty members is built to cost time, not to hold a listing.
MAX_GZIP_MEMBERS = 10_000
GZIP_CHUNK = 65_536  # bytes fed to the decoder at a time
# A feed's tags: a thousand entries of twenty tags each are 20,000; more is not a feed but
# work for its parser, which takes seconds per hundred thousand and no deadline stops.
MAX_FEED_TAGS = 100_000
URL_LENGTH = 2000  # bytes of UTF-8: the longest URL a listing may give (a longer one is skipped)
# The sitemaps protocol's limit of one file (URLs of a sitemap, sitemaps of an index). A
# page is committed in one transaction: a million-URL page would hold the database's write
# lock (SQLite: every worker's) for minutes, so the URLs past it are not read.
MAX_PAGE_URLS = 50_000
# What a listed URL may not hold: C0 controls but tab, CR and LF (which urlsplit drops),
# DEL, and lone surrogates (from a charref or a codec that let one through).
UNSTORABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class ListingError(HoldfastError, ValueError):
    """A listing page that is not a sitemap or feed Holdfast can read: its own defect."""


@dataclass(frozen=True)
class Item:
    """One document a listing names."""

    url: str
    lastmod: str = ""  # canonical (normalize_lastmod), "" when unknown
    title: str = ""


@dataclass(frozen=True)
class Listing:
    items: list[Item]
    pages: list[str]  # further listing pages (child sitemaps, next and prev-archive pages)
    malformed: list[str] = field(default_factory=list)  # URLs that do not parse; skipped
    defect: str = ""  # what was recovered from; "" for a clean page
    complete: bool = False  # an RFC 5005 complete feed: it lists every entry there is
    archived: bool = False  # an RFC 5005 archived feed (it links prev-archive pages)


def parse_listing(body: bytes, url: str, content_type: str = "") -> Listing:
    """Read a sitemap index, a sitemap (XML or text), robots.txt, an Atom or RSS feed.

    ``content_type`` is the HTTP header: its charset is honoured (RFC 7303). Gzipped
    bodies are inflated up to ``HOLDFAST_FETCH_MAX_BYTES``. At most ``MAX_PAGE_URLS``
    items and as many further pages are kept: a page that names more is read in part and
    says so (its ``defect``).
    """
    return _bounded(_parsed(body, url, content_type), url)


def _bounded(listing: Listing, url: str) -> Listing:
    """``listing`` with at most ``MAX_PAGE_URLS`` items and pages, its defect saying what
    was left out."""
    over = [
        f"{len(named)} {what}"
        for named, what in ((listing.items, "URLs"), (listing.pages, "listing pages"))
        if len(named) > MAX_PAGE_URLS
    ]
    if not over:
        return listing
    cut = (
        f"{url}: the page names {' and '.join(over)}; the first {MAX_PAGE_URLS:,} of each "
        "are read (the sitemaps protocol's limit of one file)"
    )
    return replace(
        listing,
        items=listing.items[:MAX_PAGE_URLS],
        pages=listing.pages[:MAX_PAGE_URLS],
        defect="; ".join(part for part in (listing.defect, cut) if part),
    )


def _parsed(body: bytes, url: str, content_type: str) -> Listing:
    """``parse_listing`` before its bound."""
    body = _inflated(body, url)
    if urlsplit(url).path.endswith("/robots.txt"):
        return _robots(body, url)
    if ENTITY_BYTES.search(body):  # as bytes too: a declared encoding may hide it as text
        raise ListingError(f"{url}: refused XML (entity declarations are not read)")
    try:
        text = decode(body, content_type, url)
    except ListingError:
        if root_tag(body.decode("latin-1")) in FEED_ROOTS:
            return _feed(body, url, content_type)  # feedparser has its own fallbacks
        raise
    start = text.lstrip("\ufeff \t\r\n")
    if not start.startswith("<"):
        return _text_sitemap(start, url)
    if ENTITY.search(text):  # as text too: UTF-16 hides it from the bytes' search
        raise ListingError(f"{url}: refused XML (entity declarations are not read)")
    tag = root_tag(text)
    if tag in ("sitemapindex", "urlset"):
        return _sitemap_xml(text, url, tag)
    if tag in FEED_ROOTS:
        return _feed(body, url, content_type)
    raise ListingError(f"{url}: <{tag or '?'}> is neither a sitemap nor an RSS/Atom feed")


# --- bytes to text -----------------------------------------------------------------------

BOMS = [
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
]
ENTITY = re.compile(r"<!ENTITY", re.IGNORECASE)
ENTITY_BYTES = re.compile(rb"<!ENTITY", re.IGNORECASE)
XML_DECLARATION = re.compile(rb"""<\?xml[^>]*?encoding\s*=\s*["']([A-Za-z0-9._:-]+)["']""")


def decode(body: bytes, content_type: str, url: str) -> str:
    """The body as text: BOM, then the HTTP charset, then the XML declaration, then UTF-8.

    An encoding label Python does not know is skipped; bytes that do not decode under
    the chosen encoding become U+FFFD (an entry with them is junk, the others stand).
    Only bytes that are neither valid in a known declared encoding nor UTF-8 are refused.
    """
    for bom, name in BOMS:
        if body.startswith(bom):
            return body[len(bom) :].decode(name, errors="replace")
    candidates = [charset_of(content_type)]
    declared = XML_DECLARATION.search(body[:1024].lstrip(b"\x00"))
    if declared is not None:
        candidates.append(declared.group(1).decode("ascii"))
    for name in candidates:
        if name and known_encoding(name):
            return body.decode(name, errors="replace")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        unknown = [name for name in candidates if name]
        if not unknown:
            return body.decode("utf-8", errors="replace")
        raise ListingError(
            f"{url}: unknown encoding {unknown[-1]!r} and the bytes are not UTF-8"
        ) from None


def charset_of(content_type: str) -> str:
    for param in content_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip("\"'")
    return ""


def known_encoding(name: str) -> bool:
    try:
        codecs.lookup(name)
    except LookupError:
        return False
    return True


def _inflated(body: bytes, url: str) -> bytes:
    """A gzipped listing inflated, every member of it, bounded by the fetch cap.

    The body is fed in chunks (``zlib`` copies what follows a member's end into
    ``unused_data``: fed whole, a file of many tiny members cost time in the square of its
    size), and at most ``MAX_GZIP_MEMBERS`` members are read."""
    if not body.startswith(b"\x1f\x8b"):
        return body
    cap = settings.HOLDFAST_FETCH_MAX_BYTES
    inflated = bytearray()
    view = memoryview(body)
    position = members = 0
    while position < len(body) and body[position] != 0 and len(inflated) <= cap:
        members += 1  # a NUL after a member is padding: the end
        if members > MAX_GZIP_MEMBERS:
            raise ListingError(f"{url}: more than {MAX_GZIP_MEMBERS} gzip members")
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            while not decoder.eof and position < len(body) and len(inflated) <= cap:
                chunk = view[position : position + GZIP_CHUNK]
                inflated += decoder.decompress(chunk, cap + 1 - len(inflated))
                unread = len(decoder.unused_data) + len(decoder.unconsumed_tail)
                position += len(chunk) - unread
        except zlib.error as exc:
            if inflated:
                break  # what follows the first member is not gzip: keep what was read
            raise ListingError(f"{url}: broken gzip data ({exc})") from None
        if not decoder.eof:
            break  # truncated, or stopped at the cap
    if len(inflated) > cap:
        raise ListingError(f"{url}: inflates to more than {cap} bytes")
    return bytes(inflated)


# --- XML sitemaps ------------------------------------------------------------------------

PROLOG = re.compile(r"\s*(?:<\?.*?\?>|<!--.*?-->|<!DOCTYPE[^>]*>|\s+)", re.DOTALL | re.IGNORECASE)
TAG = re.compile(r"<\s*([A-Za-z_][\w.:-]*)")
AMPERSAND = re.compile(r"&(#[0-9]{1,7};|#[xX][0-9a-fA-F]{1,6};|[A-Za-z][A-Za-z0-9]{0,31};)?")
XML_ENTITIES = frozenset({"amp", "lt", "gt", "quot", "apos"})


def root_tag(text: str) -> str:
    """The local name of the root element (lower case), past any prolog; "" if none."""
    position = 0
    while True:
        prolog = PROLOG.match(text, position)
        if prolog is None or prolog.end() == position:
            break
        position = prolog.end()
    tag = TAG.match(text, position)
    return tag.group(1).rsplit(":", 1)[-1].lower() if tag else ""


def repaired(text: str) -> str:
    """What a tolerant reader makes of the text, for expat: no XML declaration (the text is
    decoded already; one after a comment is an error in XML), a raw ``&`` as ``&amp;``,
    HTML's named entities as character references, unknown ones as literal text."""
    text = re.sub(r"<\?xml\b.*?\?>", "", text, count=1, flags=re.DOTALL)
    return AMPERSAND.sub(_ampersand, text)


def _ampersand(match: re.Match[str]) -> str:
    reference = match.group(1)
    if reference is None:
        return "&amp;"
    if reference.startswith("#"):
        digits = reference[1:-1]
        code = int(digits[1:], 16) if digits[0] in "xX" else int(digits)
        return match.group(0) if _xml_char(code) else "&amp;" + reference
    name = reference[:-1]
    if name in XML_ENTITIES:
        return match.group(0)
    named = html.entities.name2codepoint.get(name)
    return f"&#{named};" if named is not None else "&amp;" + reference


def _xml_char(code: int) -> bool:
    return code in (0x9, 0xA, 0xD) or 0x20 <= code <= 0xD7FF or 0xE000 <= code <= 0x10FFFF


class EntityRefused(Exception):
    """The XML declares an entity or names an external one; nothing of it is read."""


def _refuse(*_args: Any) -> int:
    raise EntityRefused


def defused_expat() -> Any:
    """An expat parser, without namespace processing, that refuses every entity declaration
    and external reference (:class:`EntityRefused`): neither the "billion laughs" nor a
    ``SYSTEM "file:///etc/passwd"`` is expanded. Its caller sets the content handlers and
    feeds it, so nothing but what they keep is held in memory."""
    parser = expat.ParserCreate()
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    parser.EntityDeclHandler = _refuse
    parser.ExternalEntityRefHandler = _refuse
    parser.UnparsedEntityDeclHandler = _refuse
    return parser


def _sitemap_xml(text: str, url: str, root: str) -> Listing:
    """Entries of a sitemap or sitemap index, read by expat without namespace processing
    (so an undeclared prefix is just part of a name), kept up to the first fatal error."""
    entry_tag = "sitemap" if root == "sitemapindex" else "url"
    entries: list[tuple[str, str]] = []
    stack: list[str] = []
    current: dict[str, str] | None = None
    chars: list[str] = []

    def start(name: str, _attrs: dict[str, str]) -> None:
        nonlocal current
        local = name.rsplit(":", 1)[-1].lower()
        stack.append(local)
        if local == entry_tag and len(stack) == 2:
            current = {}
        chars.clear()

    def end(name: str) -> None:
        nonlocal current
        local = stack.pop() if stack else ""
        if current is not None and len(stack) == 2 and local in ("loc", "lastmod"):
            current[local] = "".join(chars).strip()
        elif current is not None and len(stack) == 1 and local == entry_tag:
            entries.append((current.get("loc", ""), current.get("lastmod", "")))
            current = None
        chars.clear()

    parser = defused_expat()
    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = chars.append
    defect = ""
    try:
        parser.Parse(repaired(text).encode("utf-8"), True)
    except EntityRefused:
        raise ListingError(f"{url}: refused XML (entity declarations are not read)") from None
    except expat.ExpatError as exc:
        if not entries:
            raise ListingError(f"{url}: not well-formed XML ({exc})") from None
        defect = f"not well-formed XML ({exc}); the {len(entries)} entries before it are kept"
    malformed: list[str] = []
    kept = [
        (loc, normalize_lastmod(lastmod))
        for raw, lastmod in entries
        if (loc := absolute(url, raw, malformed))
    ]
    if root == "sitemapindex":
        return Listing([], [loc for loc, _ in kept], malformed, defect)
    return Listing([Item(loc, lastmod) for loc, lastmod in kept], [], malformed, defect)


# --- text sitemaps and robots.txt ------------------------------------------------------


def _text_sitemap(text: str, url: str) -> Listing:
    """sitemaps.org text sitemap: one absolute URL a line; other lines are skipped."""
    malformed: list[str] = []
    items = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            loc = absolute(url, line, malformed) if "://" in line else ""
            if loc:
                items.append(Item(loc))
            elif "://" not in line:
                malformed.append(line[:URL_LENGTH])
    if not items:
        raise ListingError(f"{url}: neither XML nor a text sitemap (no URL on any line)")
    return Listing(items, [], malformed)


def _robots(body: bytes, url: str) -> Listing:
    """robots.txt as a listing: its ``Sitemap:`` lines name the sitemaps to read."""
    text = body.decode("utf-8", errors="replace")
    malformed: list[str] = []
    pages = [
        page for line in Protego.parse(text).sitemaps if (page := absolute(url, line, malformed))
    ]
    return Listing([], list(dict.fromkeys(pages)), malformed)


# --- feeds -------------------------------------------------------------------------------


def _feed(body: bytes, url: str, content_type: str) -> Listing:
    """An Atom, RSS or RDF feed through feedparser's own tolerant reading.

    The body goes in as a stream: given bytes, feedparser would first try them as a file
    name. Entity declarations were refused before this (``parse_listing``).
    """
    tags = body.count(b"<")
    if tags > MAX_FEED_TAGS:  # feedparser's time grows with them: 400,000 nested tags, 15 s
        raise ListingError(f"{url}: a feed of {tags} tags (at most {MAX_FEED_TAGS} are read)")
    headers = {"content-location": url, "content-type": content_type or "application/xml"}
    try:
        parsed = feedparser.parse(io.BytesIO(_charrefs_repaired(body)), response_headers=headers)
    except (ValueError, UnicodeError, RecursionError, OverflowError) as exc:
        # feedparser's own failures (not a SAXException it records): the page is refused
        # with the reason, as any listing it cannot read, never a crashed discovery job.
        raise ListingError(f"{url}: feedparser could not read it ({exc})") from None
    malformed: list[str] = []
    items = []
    for entry in parsed.entries:
        link = absolute(url, entry.get("link", ""), malformed)
        if not link:
            continue
        # feedparser maps a missing ``updated`` to ``published`` with a warning: ask first.
        moment = entry["updated_parsed"] if "updated_parsed" in entry else None  # noqa: SIM401
        moment = moment or entry.get("published_parsed")
        lastmod = _canonical(_utc(moment)) if moment else ""
        items.append(Item(link, lastmod, feed_title(entry.get("title", ""))))
    links = parsed.feed.get("links", [])
    pages = [
        page
        for link in links
        if link.get("rel") in ("next", "prev-archive")
        if (page := absolute(url, link.get("href", ""), malformed))
    ]
    defect = ""
    error = parsed.get("bozo_exception")
    if parsed.get("bozo") and isinstance(error, SAXException):
        if not items and not parsed.get("version"):
            raise ListingError(f"{url}: not a feed feedparser can read ({error})")
        defect = f"not well-formed XML ({error}); {len(items)} entries recovered"
    complete = bool(re.search(rb"<(?:\w+:)?complete\b[^>]*/?>", body[:65536])) and (
        b"http://purl.org/syndication/history/1.0" in body[:65536]
    )
    archived = any(link.get("rel") == "prev-archive" for link in links)
    return Listing(items, list(dict.fromkeys(pages)), malformed, defect, complete, archived)


#: A numeric character reference (``&#55296;``, ``&#xD800;``), in a feed's bytes.
CHARREF_BYTES = re.compile(rb"&#([xX][0-9a-fA-F]{1,16}|[0-9]{1,20});")
MAX_TITLE_CHARS = 1000


def _charrefs_repaired(body: bytes) -> bytes:
    """References to code points XML has no character for (a lone surrogate ``&#xD800;``,
    past U+10FFFF) kept as literal text: feedparser's ``chr()`` on them raised, and one
    such entry failed the whole feed. As ``repaired`` does for sitemaps."""

    def literal(match: re.Match[bytes]) -> bytes:
        digits = match.group(1)
        code = int(digits[1:], 16) if digits[:1] in (b"x", b"X") else int(digits)
        return match.group(0) if _xml_char(code) else b"&amp;" + match.group(0)[1:]

    return CHARREF_BYTES.sub(literal, body) if b"&#" in body else body


def feed_title(title: Any) -> str:
    """An entry's title as the database stores it on both databases: :func:`clean`, at
    most ``MAX_TITLE_CHARS``."""
    return clean(title)[:MAX_TITLE_CHARS] if isinstance(title, str) else ""


def clean(text: str) -> str:
    """Text as both databases store it: one line of words (runs of whitespace as one
    space), NUL (PostgreSQL's text refuses it) gone, a lone surrogate (a charref, or a
    declared ``utf-7``, can decode to one; UTF-8 cannot encode it) as U+FFFD."""
    return " ".join(LONE_SURROGATE.sub("\ufffd", text.replace("\x00", " ")).split())


# --- URLs and dates ----------------------------------------------------------------------


def absolute(base: str, url: str, malformed: list[str]) -> str:
    """An absolute http(s) URL without fragment, or "" for anything else.

    A URL that does not even parse (``http://[::1/x``: urllib raises ``ValueError``), or
    that names another scheme (``file:///etc/passwd``, ``ftp:``), is added to ``malformed``
    (counted and logged, so it does not vanish unseen) and skipped: one bad entry must not
    stop the page, or the run. So is one holding a control character (NUL, ESC, DEL) or a
    lone surrogate: no server serves such a URL, and PostgreSQL's text cannot store a NUL,
    so one such line would fail the page's commit on every run. (Tab, CR and LF inside a
    URL are dropped by ``urlsplit``, as browsers do, so a wrapped ``<loc>`` still reads.)
    """
    if not url:
        return ""
    if UNSTORABLE.search(url.strip()):
        malformed.append(UNSTORABLE.sub("\ufffd", url.strip()[:URL_LENGTH]))
        return ""
    try:
        joined = urldefrag(urljoin(base, url.strip())).url
        parts = urlsplit(joined)
        parts.port  # noqa: B018 -- raises ValueError for a port out of range
    except ValueError:
        malformed.append(url.strip()[:URL_LENGTH])
        return ""
    if parts.scheme not in ("http", "https") or not parts.hostname:
        malformed.append(url.strip()[:URL_LENGTH])
        return ""
    if len(joined.encode("utf-8", errors="replace")) > URL_LENGTH:
        # Counted in bytes: PostgreSQL cannot index a value over ~2,700 bytes, and 2,000
        # characters of CJK are 6,000. One such entry must not make the page's commit fail.
        malformed.append(url.strip()[:URL_LENGTH])
        return ""
    return joined


W3C_DATETIME = re.compile(
    r"(\d{4})(?:-(\d{2})(?:-(\d{2})(?:[T ](\d{2}):(\d{2})(?::(\d{2})(?:[.,]\d+)?)?"
    r"\s*(Z|[+-]\d{2}:?\d{2})?)?)?)?"
)


def normalize_lastmod(value: str) -> str:
    """The canonical form of a listed ``lastmod``, or "" when it is not a date.

    W3C datetimes (``2026``, ``2026-11``, ``2026-11-01``, ``2026-11-01T10:00+02:00``, a
    space for ``T``, no zone meaning UTC) and RFC 822 dates (``Mon, 30 Nov 2026 10:00:00
    GMT``) are accepted; a date alone stays a date (``2026-11-01``), a time becomes UTC
    (``2026-11-01T08:00:00Z``). Anything else (``yesterday``, ``2026-13-45``) is unknown:
    it never counts as a change, nor as unchanged.
    """
    value = (value or "").strip()[:LASTMOD_LENGTH]
    if not value:
        return ""
    match = W3C_DATETIME.fullmatch(value)
    if match is None:
        try:
            moment = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return ""
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return _canonical(moment)
    year, month, day, hour, minute, second, zone = match.groups()
    try:
        if hour is None:
            date = datetime(int(year), int(month or 1), int(day or 1))
            return date.date().isoformat()
        moment = datetime.fromisoformat(
            f"{year}-{month}-{day}T{hour}:{minute}:{second or '00'}" + _zone(zone or "Z")
        )
    except ValueError:
        return ""
    return _canonical(moment)


def _utc(moment: Any) -> datetime:
    """A ``time.struct_time`` in UTC (as feedparser gives dates) as an aware datetime."""
    year, month, day, hour, minute, second = tuple(moment)[:6]
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


def _zone(zone: str) -> str:
    if zone == "Z":
        return "+00:00"
    return zone if ":" in zone else f"{zone[:3]}:{zone[3:]}"


def _canonical(moment: datetime) -> str:
    if not 1 <= moment.year <= 9998:
        return ""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
