"""Full-text search over artifacts (DESIGN §11): text extraction, indexing and queries.

``ingestion.index_artifact`` (enqueued by the fetch when a body changed) reads the body
from the blob store, extracts its text and writes the ``ArtifactText`` row in the same
fenced transaction that completes the job, so a stale attempt cannot write and the text
of one body lands exactly once. ``unindex`` removes an artifact from the index, inside
the caller's transaction (the fetch calls it when an artifact is gone or failed).
``search`` answers ``manage.py search`` and ``GET /internal/v1/search/``.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from datetime import datetime
from html.parser import HTMLParser
from typing import Any
from xml.parsers import expat

from bs4.dammit import EncodingDetector, UnicodeDammit
from django.db import transaction

from jobs.context import JobContext
from jobs.exceptions import InvalidJob, PermanentError
from jobs.log import get_logger
from jobs.serialization import timestamp

from . import blobs, listings, search_sql
from .models import Artifact, ArtifactState, ArtifactText
from .sources import get_source

log = get_logger("ingestion.search")

INDEX_ARTIFACT = "ingestion.index_artifact"

DEFAULT_LIMIT = 10
MAX_LIMIT = 100
MAX_QUERY_CHARS = 1000
# Beyond this the text is cut: PostgreSQL refuses a tsvector over 1 MB, and positions
# past 16,383 are not told apart anyway.
MAX_TEXT_CHARS = 262_144
# A title as long as a feed's (listings): it is shown in every hit, and weighted apart.
MAX_TITLE_CHARS = listings.MAX_TITLE_CHARS

HTML_TYPES = {"text/html", "application/xhtml+xml"}
XML_TYPES = {"application/xml", "text/xml"}
TEXT_TYPES = {"text/plain"}
UNWANTED_HTML = frozenset({"script", "style", "noscript", "template"})
MAX_HTML_TAGS = 200_000  # a page's first tags: more is markup, not text worth indexing
HTML_CHUNK = 65_536  # characters the parser reads at a time
HTML_MAX_PENDING = 262_144  # characters of one unfinished construct kept between chunks
HTML_CLOSE_PENDING = 4_096  # the longest remainder the parser's close() is given
XML_CHUNK = 65_536  # bytes expat reads at a time


class NotIndexable(Exception):
    """The body has no text this index can take: its type, or it does not parse."""


@dataclass(frozen=True)
class Extracted:
    title: str
    text: str


# --- extraction --------------------------------------------------------------------------


def extract(body: bytes, content_type: str) -> Extracted:
    """The title and plain text of a body, by its media type; ``NotIndexable`` otherwise."""
    media_type, charset = parse_content_type(content_type)
    if media_type in HTML_TYPES:
        extracted = extract_html(body, charset)
    elif media_type in XML_TYPES or media_type.endswith("+xml"):
        extracted = extract_xml(body)
    elif media_type in TEXT_TYPES:
        extracted = Extracted("", body.decode(charset or "utf-8", errors="replace"))
    else:
        raise NotIndexable(f"content type {media_type or '(none)'!r} is not indexed")
    title = listings.feed_title(extracted.title)  # as a listed title: one line, cut
    return Extracted(title, listings.clean(extracted.text)[:MAX_TEXT_CHARS])


def parse_content_type(content_type: str) -> tuple[str, str | None]:
    """``text/html; charset=UTF-8`` as ``("text/html", "utf-8")``; a bad charset is None."""
    media_type, _, params = content_type.partition(";")
    charset = None
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip("\"'").lower() or None
    if charset is not None:
        try:
            codecs.lookup(charset)
        except LookupError:
            charset = None
    return media_type.strip().lower(), charset


def extract_html(body: bytes, charset: str | None) -> Extracted:
    """The first ``title`` and the text outside ``UNWANTED_HTML``, read as a stream.

    No tree is built: a tree of a page under the fetch cap can take two hundred times the
    page's size (10 MB of ``<b>`` tags, 2 GB), so the parser keeps only the text, and stops
    once it holds more than the index takes (``MAX_TEXT_CHARS``) or has read
    ``MAX_HTML_TAGS`` tags. The body is decoded as a browser would (its declared or
    sniffed charset: ``decoded_html``).

    ``html.parser`` keeps an unfinished construct (a tag never closed) as pending input
    and rescans it at every feed, and its ``close()`` takes time quadratic in it (Python
    before 3.13.5, CVE-2025-6069: 120 KB of ``<a `` held a worker for three minutes, and a
    page at the fetch cap would have held it for weeks). So pending input longer than
    ``HTML_MAX_PENDING`` is dropped (the parser reads on from the next chunk), and
    ``close()`` runs only on a short remainder: a page's text is never in either."""
    markup = decoded_html(body, charset)
    parser = _HtmlText()
    for start in range(0, len(markup), HTML_CHUNK):
        parser.feed(markup[start : start + HTML_CHUNK])
        if parser.chars > 2 * MAX_TEXT_CHARS or parser.tags > MAX_HTML_TAGS:
            break  # enough: cleaning only shortens the text, and the index cuts it
        if len(parser.rawdata) > HTML_MAX_PENDING:
            parser.rawdata = ""  # an unfinished tag this long is not markup worth reading
    else:
        if len(parser.rawdata) <= HTML_CLOSE_PENDING:
            parser.close()
    return Extracted(" ".join(parser.title), " ".join(parser.text))


def decoded_html(body: bytes, charset: str | None) -> str:
    """The page as text: its declared charset (the header's, else a ``<meta>``'s), else
    UTF-8 if it decodes as such, else windows-1252 (what browsers assume). ``UnicodeDammit``
    alone guessed from byte statistics first: a Latin-1 page read as cp775 ("Cafķ"), a page
    with a control byte as UTF-16 (its text lost to mojibake)."""
    declared = charset or EncodingDetector.find_declared_encoding(body, is_html=True)
    dammit = UnicodeDammit(
        body, [declared] if declared else [], is_html=True, user_encodings=["utf-8", "windows-1252"]
    )
    return dammit.unicode_markup or ""


class _HtmlText(HTMLParser):
    """Collects a page's text (and its first title's) as ``html.parser`` reads it."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title: list[str] = []
        self.text: list[str] = []
        self.title_chars = 0
        self.chars = 0
        self.tags = 0
        self.unwanted = 0  # depth inside script, style, noscript, template
        self.in_title = False
        self.titled = False  # the first title is read: later ones are text

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags += 1
        if tag in UNWANTED_HTML:
            self.unwanted += 1
        elif tag == "title" and not self.titled:
            self.in_title = True

    def handle_endtag(self, tag: str) -> None:
        if tag in UNWANTED_HTML:
            self.unwanted = max(0, self.unwanted - 1)
        elif tag == "title" and self.in_title:
            self.in_title, self.titled = False, True

    def handle_data(self, data: str) -> None:
        if self.unwanted:
            return
        if self.in_title:
            if self.title_chars < 2 * MAX_TITLE_CHARS:  # a count: summing each time is quadratic
                self.title.append(data)
                self.title_chars += len(data)
            return
        self.text.append(data)
        self.chars += len(data)


def extract_xml(body: bytes) -> Extracted:
    """Every text node; the first ``title`` element (any namespace) as the title.

    Read as a stream by a defused expat parser (``listings.defused_expat``): no entity is
    declared or expanded, no external one read, and no tree is built (a tree of a 2 MB
    document of small elements peaked at 27.7 MB, the stream at 8.7 MB). Reading stops once
    the text holds more than the index takes.
    """
    reader = _XmlText()
    parser = listings.defused_expat()
    parser.StartElementHandler = reader.start
    parser.EndElementHandler = reader.end
    parser.CharacterDataHandler = reader.data
    try:
        for start in range(0, len(body), XML_CHUNK):
            parser.Parse(body[start : start + XML_CHUNK], False)
            if reader.size + reader.pending > 2 * MAX_TEXT_CHARS:
                break  # enough: cleaning only shortens the text, and the index cuts it
        else:
            parser.Parse(b"", True)
    except listings.EntityRefused:
        raise NotIndexable("the XML declares or references an entity (not read)") from None
    except expat.ExpatError as exc:
        raise NotIndexable(f"the XML does not parse: {exc}") from None
    reader.flush()
    return Extracted(" ".join(reader.title), " ".join(reader.text))


class _XmlText:
    """Collects a document's text nodes, and its first ``title``'s, as expat reports them.

    Character data between two tags is one text node (expat may report it in pieces,
    counted as they arrive: one 10 MB node was read whole, its pieces held at about
    twelve times its size, before the size was first looked at).
    """

    def __init__(self) -> None:
        self.chars: list[str] = []
        self.pending = 0  # characters in ``chars``
        self.text: list[str] = []
        self.title: list[str] = []
        self.size = 0
        self.title_chars = 0
        self.title_depth = 0  # inside the first title: its depth there, else 0
        self.titled = False

    def start(self, name: str, _attrs: dict[str, str]) -> None:
        self.flush()
        if self.title_depth:
            self.title_depth += 1
        elif not self.titled and name.rpartition(":")[2].lower() == "title":
            self.title_depth, self.titled = 1, True

    def end(self, _name: str) -> None:
        self.flush()
        self.title_depth = max(0, self.title_depth - 1)

    def data(self, piece: str) -> None:
        self.chars.append(piece)
        self.pending += len(piece)

    def flush(self) -> None:
        if not self.chars:
            return
        node = "".join(self.chars)
        self.chars.clear()
        self.pending = 0
        self.text.append(node)
        self.size += len(node)
        if self.title_depth and self.title_chars < 2 * MAX_TITLE_CHARS:
            self.title.append(node)
            self.title_chars += len(node)


# --- indexing ----------------------------------------------------------------------------


def index_artifact(ctx: JobContext, artifact_id: int) -> dict[str, Any]:
    """The body of the ``ingestion.index_artifact`` job: index the artifact's current body.

    The write is fenced and completes the job (``ctx.atomic(complete=True)``). It also
    checks, with the artifact's row locked, that the artifact is still as it was read: if
    a newer fetch replaced the body meanwhile, that fetch's own index job indexes the new
    one, and this job writes nothing rather than put older text back (or take it out).
    """
    artifact = Artifact.objects.filter(pk=artifact_id).first()
    if artifact is None:
        return finish(ctx, artifact_id, None, "the artifact no longer exists")
    if artifact.state != ArtifactState.FETCHED or not artifact.sha256:
        return finish(ctx, artifact_id, artifact, f"the artifact is {artifact.state}, not fetched")
    try:
        body = blobs.read(artifact.sha256)
    except FileNotFoundError:
        raise PermanentError(
            f"blob {artifact.sha256} of artifact {artifact_id} is missing"
        ) from None
    try:
        extracted = extract(body, artifact.content_type)
    except NotIndexable as exc:
        return finish(ctx, artifact_id, artifact, str(exc))
    result = {"artifact_id": artifact_id, "indexed": True, "sha256": artifact.sha256}
    with ctx.atomic(complete=True, result=result):
        if not unchanged_since(artifact):
            log.info("artifact_index_skipped", artifact_id=artifact_id, reason="body replaced")
            result.update(indexed=False, reason="a newer fetch replaced this body")
            return result
        write(artifact_id, artifact.sha256, extracted)
    log.info(
        "artifact_indexed",
        artifact_id=artifact_id,
        sha256=artifact.sha256,
        chars=len(extracted.text),
    )
    return result


def finish(
    ctx: JobContext, artifact_id: int, artifact: Artifact | None, reason: str
) -> dict[str, Any]:
    """Complete the job without indexing, taking any older text of the artifact out."""
    result = {"artifact_id": artifact_id, "indexed": False, "reason": reason}
    with ctx.atomic(complete=True, result=result):
        if artifact is not None and unchanged_since(artifact):
            unindex(artifact_id)
    log.warning("artifact_not_indexed", artifact_id=artifact_id, reason=reason)
    return result


def unchanged_since(artifact: Artifact) -> bool:
    """Lock the artifact's row; True if its state and body are still those of ``artifact``."""
    now = Artifact.objects.select_for_update().filter(pk=artifact.pk).values("state", "sha256")
    return now.first() == {"state": artifact.state, "sha256": artifact.sha256}


def write(artifact_id: int, digest: str, extracted: Extracted) -> None:
    """Replace the artifact's searchable text (inside the caller's transaction)."""
    ArtifactText.objects.update_or_create(
        artifact_id=artifact_id,
        defaults={"title": extracted.title, "text": extracted.text, "sha256": digest},
    )
    search_sql.write_document(artifact_id, extracted.title, extracted.text)
    Artifact.objects.filter(pk=artifact_id).update(indexed_sha256=digest)
    if extracted.title:
        Artifact.objects.filter(pk=artifact_id, title="").update(title=extracted.title)


def unindex(artifact_id: int) -> bool:
    """Take an artifact out of the index; True if it was in it.

    Call it inside the transaction that marks the artifact gone or failed, so the two
    commit together.
    """
    with transaction.atomic():
        deleted, _ = ArtifactText.objects.filter(artifact_id=artifact_id).delete()
        Artifact.objects.filter(pk=artifact_id).exclude(indexed_sha256="").update(indexed_sha256="")
    if deleted:
        log.info("artifact_unindexed", artifact_id=artifact_id)
    return bool(deleted)


# --- queries -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Hit:
    artifact_id: int
    url: str
    source: str
    title: str
    snippet: str
    rank: float
    fetched_at: datetime | None


def search(query: str, source: str | None = None, limit: int = DEFAULT_LIMIT) -> list[Hit]:
    """The best ``limit`` artifacts for ``query``, best first.

    ``query`` is untrusted user text: any text is a valid query, and only a blank one (or
    one that cannot be stored or is too long) is bad input. An unknown source raises
    ``SourceNotFound`` (bad input on the command line, a 404 over HTTP).
    """
    query = checked_query(query)
    if isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidJob(f"limit must be from 1 to {MAX_LIMIT}, not {limit!r}")
    source_id = None if source is None else get_source(source).pk
    found = search_sql.matches(query, source_id, limit)
    artifacts = Artifact.objects.select_related("source").in_bulk(
        [match.artifact_id for match in found]
    )
    return [
        hit_of(artifacts[match.artifact_id], match)
        for match in found
        if match.artifact_id in artifacts
    ]


def checked_query(query: str) -> str:
    query = query.strip()
    if not query:
        raise InvalidJob("the search query is blank")
    if len(query) > MAX_QUERY_CHARS:
        raise InvalidJob(f"the search query is longer than {MAX_QUERY_CHARS} characters")
    if "\x00" in query or listings.LONE_SURROGATE.search(query):
        raise InvalidJob("the search query contains a NUL character or invalid Unicode")
    return query


def hit_of(artifact: Artifact, match: search_sql.Match) -> Hit:
    return Hit(
        artifact_id=artifact.pk,
        url=artifact.url,
        source=artifact.source.name,
        title=match.title or artifact.title,
        snippet=match.snippet,
        rank=round(match.rank, 6),
        fetched_at=artifact.fetched_at,
    )


def hit_dict(hit: Hit) -> dict[str, Any]:
    return {
        "url": hit.url,
        "source": hit.source,
        "title": hit.title,
        "snippet": hit.snippet,
        "rank": hit.rank,
        "fetched_at": timestamp(hit.fetched_at),
        "artifact_id": hit.artifact_id,
    }
