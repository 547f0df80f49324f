"""Polite HTTP for ingestion: every request a source causes goes through :func:`get`.

Politeness is kept in the database, so it holds across every worker and host, not per
process: before each request the source's row is locked for a moment, the request takes
the slot ``max(now, next_request_at)`` (database clock) and moves ``next_request_at``
``spacing_seconds`` past it; the row is unlocked before the wait, so a sleeping request
never blocks anyone. robots.txt is fetched through the same path, kept on the source row
for a day, parsed by RFC 9309 (longest match wins; ``*`` and ``$`` in paths) and checked
before every hop, redirects included (they are followed by hand, at most
:data:`MAX_REDIRECTS`). Every hop's host must resolve to public addresses, or to the
source's own host's addresses, so a listing cannot point workers at internal services.
Bodies are streamed and abandoned past a byte cap.

``get`` returns every HTTP status as a :class:`Response` (callers decide what a 304, 404
or 503 means for them) and raises :class:`FetchError` only when no usable answer came:
``transient`` says whether trying again later can help.

Call it outside any transaction: the spacing reservation must commit before the wait.
"""

from __future__ import annotations

import ipaddress
import math
import socket
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from urllib.parse import urldefrag, urljoin, urlsplit

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from protego import Protego

from jobs import engine
from jobs.exceptions import HoldfastError
from jobs.log import get_logger

from .models import Source
from .sources import MAX_SPACING_SECONDS

log = get_logger("ingestion.http")

MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
ROBOTS_MAX_AGE = timedelta(days=1)
ROBOTS_MAX_BYTES = 512 * 1024  # RFC 9309 asks crawlers to read at least 500 KiB
CHUNK_BYTES = 64 * 1024

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Response:
    """A complete answer: status, final URL (after redirects), headers and body."""

    status: int
    url: str
    headers: Mapping[str, str]  # case-insensitive (httpx.Headers)
    body: bytes
    elapsed: float  # seconds spent on the network, waits for the source's turn excluded


class FetchError(HoldfastError):
    """No usable answer for a URL; the message names the URL and the cause.

    ``transient`` is True when the same request may succeed later (timeouts, refused
    connections, an unavailable robots.txt) and False when it cannot.
    """

    transient: bool = True

    def __init__(self, message: str, *, transient: bool | None = None) -> None:
        super().__init__(message)
        if transient is not None:
            self.transient = transient


class TooLarge(FetchError):
    """The body is longer than the cap: the transfer was abandoned."""

    transient = False


class RobotsDisallowed(FetchError):
    """The site's robots.txt does not allow Holdfast to fetch this URL."""

    transient = False


class TooManyRedirects(FetchError):
    """More than :data:`MAX_REDIRECTS` redirects in a row."""

    transient = False


class ForbiddenAddress(FetchError):
    """The host resolves to an internal address that is not one of the source's own host.

    A third-party listing (or a redirect) must not make workers fetch cloud metadata,
    localhost or the private network and turn the answers into searchable documents.
    """

    transient = False


def get(
    source: Source,
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    max_bytes: int | None = None,
) -> Response:
    """GET ``url`` on behalf of ``source``: robots-checked, spaced, capped, redirects bounded."""
    cap = settings.HOLDFAST_FETCH_MAX_BYTES if max_bytes is None else max_bytes
    elapsed = 0.0
    current = _checked_url(url)
    with _client() as client:
        for _hop in range(MAX_REDIRECTS + 1):
            check_address(source, current)
            _check_robots(client, source, current)
            answer = _exchange(client, source, current, headers, cap)
            elapsed += answer.elapsed
            target = _redirect_target(answer)
            if target is None:
                return Response(answer.status, current, answer.headers, answer.body, elapsed)
            current = target
    raise TooManyRedirects(f"GET {url}: more than {MAX_REDIRECTS} redirects (last to {current})")


# --- one request -----------------------------------------------------------------------


def _client() -> httpx.Client:
    return httpx.Client(
        timeout=httpx.Timeout(float(settings.HOLDFAST_FETCH_TIMEOUT_SECONDS)),
        headers={"User-Agent": settings.HOLDFAST_USER_AGENT},
        follow_redirects=False,
        event_hooks={"response": [_check_location]},
    )


def _check_location(response: httpx.Response) -> None:
    """Refuse a redirect whose Location httpx cannot parse, before httpx tries to.

    httpx parses the Location of every redirect, even one it will not follow, and reports
    a bad one as a transport error (transient); it is the server's mistake, for good.
    """
    location = response.headers.get("location")
    if response.status_code not in REDIRECT_STATUSES or not location:
        return
    try:
        response.url.join(location)
    except httpx.InvalidURL as exc:
        raise FetchError(
            f"GET {response.url}: malformed redirect Location {location!r}: {exc}",
            transient=False,
        ) from None


def _exchange(
    client: httpx.Client,
    source: Source,
    url: str,
    headers: Mapping[str, str] | None,
    cap: int,
    *,
    truncate: bool = False,
) -> Response:
    """One request in the source's turn; the body is read only while under ``cap``.

    Past ``cap`` the transfer is abandoned: with ``truncate`` the first ``cap`` bytes are
    the body, otherwise :class:`TooLarge` is raised.
    """
    wait_turn(source)
    started = time.monotonic()
    try:
        with client.stream("GET", url, headers=dict(headers or {})) as response:
            if response.status_code in REDIRECT_STATUSES and "location" in response.headers:
                body = b""  # a redirect's body is never needed
            elif truncate:
                body = _read_truncated(response, cap)
            else:
                body = _read_capped(response, url, cap)
    except httpx.UnsupportedProtocol as exc:
        raise FetchError(f"GET {url}: {exc}", transient=False) from exc
    except httpx.TimeoutException as exc:
        seconds = settings.HOLDFAST_FETCH_TIMEOUT_SECONDS
        raise FetchError(
            f"GET {url}: timed out after {seconds:g} s ({type(exc).__name__})"
        ) from exc
    except httpx.DecodingError as exc:
        raise FetchError(f"GET {url}: undecodable body: {exc}", transient=False) from exc
    except httpx.TransportError as exc:
        raise FetchError(f"GET {url}: {type(exc).__name__}: {exc or 'no detail'}") from exc
    except httpx.InvalidURL as exc:
        raise FetchError(f"GET {url}: invalid URL: {exc}", transient=False) from exc
    took = time.monotonic() - started
    log.debug("http_get", source=source.name, url=url, status=response.status_code, took=took)
    return Response(response.status_code, url, response.headers, body, took)


def _read_capped(response: httpx.Response, url: str, cap: int) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise TooLarge(f"GET {url}: body of {declared} bytes is over the {cap}-byte cap")
    body = bytearray()
    for chunk in response.iter_bytes(CHUNK_BYTES):
        body += chunk
        if len(body) > cap:
            raise TooLarge(f"GET {url}: body is over the {cap}-byte cap; transfer abandoned")
    return bytes(body)


def _read_truncated(response: httpx.Response, cap: int) -> bytes:
    body = bytearray()
    for chunk in response.iter_bytes(CHUNK_BYTES):
        body += chunk
        if len(body) >= cap:
            break  # the rest is never read: leaving the stream closes the connection
    return bytes(body[:cap])


def _checked_url(url: str) -> str:
    """``url`` without its fragment, if it is a well-formed http(s) URL with a host."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port that is not 0-65535
    except ValueError as exc:  # e.g. "Invalid IPv6 URL" for http://[::1/x
        raise FetchError(f"GET {url}: malformed URL: {exc}", transient=False) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"GET {url}: not an http(s) URL", transient=False)
    return urldefrag(url).url


def _redirect_target(answer: Response) -> str | None:
    location = answer.headers.get("location")
    if answer.status not in REDIRECT_STATUSES or not location:
        return None
    try:
        target = urljoin(answer.url, location)
    except ValueError as exc:  # a Location the server got wrong must not crash the fetch
        raise FetchError(
            f"GET {answer.url}: malformed redirect Location {location!r}: {exc}",
            transient=False,
        ) from None
    if urlsplit(target).scheme not in ("http", "https"):
        raise FetchError(
            f"GET {answer.url}: redirect to a non-http(s) URL {target!r}", transient=False
        )
    return _checked_url(target)


# --- spacing ---------------------------------------------------------------------------


def wait_turn(source: Source) -> float:
    """Reserve the source's next request slot, then sleep until it; returns the wait.

    The reservation is one short transaction on the source row (database clock); the
    sleep happens after it commits, so no lock is held while waiting.
    """
    with transaction.atomic():
        row = Source.objects.select_for_update().only("spacing_seconds", "next_request_at")
        locked = row.get(pk=source.pk)
        now = engine.db_now()
        slot = max(now, locked.next_request_at or now)
        Source.objects.filter(pk=source.pk).update(
            next_request_at=slot + _spacing(locked.spacing_seconds)
        )
    wait = (slot - now).total_seconds()
    if wait > 0:
        time.sleep(wait)
    return wait


def _spacing(seconds: float) -> timedelta:
    """The row's spacing, held to 0..MAX_SPACING_SECONDS.

    ``add_source`` refuses anything else, but a row written another way must not make
    every request overflow (``timedelta(seconds=1e308)``) or wait for ever.
    """
    if math.isnan(seconds):
        seconds = MAX_SPACING_SECONDS
    return timedelta(seconds=min(max(seconds, 0.0), MAX_SPACING_SECONDS))


# --- addresses -------------------------------------------------------------------------


def is_public(address: IPAddress) -> bool:
    """Whether ``address`` is on the public internet: not private, loopback, link-local,
    multicast, reserved, unspecified or otherwise special-purpose (``::ffff:10.0.0.1`` is
    judged as ``10.0.0.1``)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )


def address_allowed(address: IPAddress, trusted: Collection[IPAddress]) -> bool:
    """Whether a request for a source may connect to ``address``.

    ``trusted`` are the addresses the source's own host resolves to: an operator who adds
    a source on 127.0.0.1 or the office network trusts that host, and only that host.
    """
    return is_public(address) or address in trusted


def check_address(source: Source, url: str) -> None:
    """Raise :class:`ForbiddenAddress` unless every address of ``url``'s host is allowed.

    The host is resolved here and again by the connection, so a DNS answer that changes
    in between (rebinding) is not caught; a literal IP or a stable name is.
    """
    internal = sorted((address for address in _resolve(url) if not is_public(address)), key=str)
    if not internal:
        return
    trusted = _source_addresses(source)
    for address in internal:
        if not address_allowed(address, trusted):
            host = urlsplit(url).hostname
            log.warning("address_forbidden", source=source.name, url=url, address=str(address))
            raise ForbiddenAddress(
                f"GET {url}: {host} resolves to {address}, an internal address that is not"
                f" one of the source's own host ({urlsplit(source.url).hostname})"
            )


def _resolve(url: str) -> frozenset[IPAddress]:
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
        raise FetchError(f"GET {url}: cannot resolve {host}: {exc}") from exc
    return frozenset(ipaddress.ip_address(info[4][0]) for info in infos)


def _source_addresses(source: Source) -> frozenset[IPAddress]:
    try:
        return _resolve(source.url)
    except (FetchError, ValueError):  # an unresolvable source host trusts nothing
        return frozenset()


# --- robots.txt ------------------------------------------------------------------------

# robots.txt of hosts other than the source's own (a redirect elsewhere), per process.
_other_hosts: dict[tuple[int, str], tuple[datetime, str]] = {}
_other_hosts_lock = threading.Lock()


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _check_robots(client: httpx.Client, source: Source, url: str) -> None:
    origin = _origin(url)
    if origin == _origin(source.url):
        text = _source_robots(client, source, origin)
    else:
        text = _other_robots(client, source, origin)
    if not _parser(text).can_fetch(url, _product_token()):
        log.info("robots_disallowed", source=source.name, url=url)
        raise RobotsDisallowed(f"GET {url}: disallowed by {origin}/robots.txt")


def _fresh(fetched_at: datetime | None) -> bool:
    return fetched_at is not None and timezone.now() - fetched_at < ROBOTS_MAX_AGE


def _source_robots(client: httpx.Client, source: Source, origin: str) -> str:
    """The source's robots.txt, kept on its row and fetched again once a day."""
    if _fresh(source.robots_fetched_at):
        return source.robots_txt
    source.refresh_from_db(fields=["robots_txt", "robots_fetched_at"])  # another worker's?
    if _fresh(source.robots_fetched_at):
        return source.robots_txt
    text = _fetch_robots(client, source, origin)
    fetched_at = timezone.now()
    Source.objects.filter(pk=source.pk).update(robots_txt=text, robots_fetched_at=fetched_at)
    source.robots_txt, source.robots_fetched_at = text, fetched_at
    log.info("robots_fetched", source=source.name, url=f"{origin}/robots.txt", size=len(text))
    return text


def _other_robots(client: httpx.Client, source: Source, origin: str) -> str:
    key = (source.pk, origin)
    with _other_hosts_lock:
        cached = _other_hosts.get(key)
    if cached is not None and _fresh(cached[0]):
        return cached[1]
    text = _fetch_robots(client, source, origin)
    with _other_hosts_lock:
        _other_hosts[key] = (timezone.now(), text)
    return text


def _fetch_robots(client: httpx.Client, source: Source, origin: str) -> str:
    """robots.txt by RFC 9309: 2xx is the rules, 4xx allows everything, 5xx retries later.

    Only the first :data:`ROBOTS_MAX_BYTES` are read (RFC 9309 §2.5: at least 500 KiB,
    the rest ignored), up to the last complete line.
    """
    url = f"{origin}/robots.txt"
    for _hop in range(MAX_REDIRECTS + 1):
        check_address(source, url)
        answer = _exchange(client, source, url, None, ROBOTS_MAX_BYTES, truncate=True)
        target = _redirect_target(answer)
        if target is None:
            break
        url = target
    else:
        return ""  # RFC 9309 §2.3.1.2: too many redirects counts as unavailable (allow all)
    if 200 <= answer.status < 300:
        body = answer.body
        if len(body) >= ROBOTS_MAX_BYTES:
            body = body[: body.rfind(b"\n") + 1]  # a rule cut in half is no rule
            log.info("robots_truncated", source=source.name, url=url, size=len(body))
        return body.decode("utf-8", errors="replace")
    if 400 <= answer.status < 500:
        return ""
    raise FetchError(f"GET {url}: robots.txt answered {answer.status}; not crawling until it works")


@lru_cache(maxsize=128)
def _parser(text: str) -> Protego:
    """An RFC 9309 matcher: the longest matching rule wins, ``*`` and ``$`` are honoured."""
    return Protego.parse(text)


def _product_token() -> str:
    """``Holdfast`` from ``Holdfast/0.1 (+https://...; ingestion bot)``.

    Groups are matched on the product token alone: matched against the whole header, a
    group for ``bot`` or ``github`` would apply to Holdfast too.
    """
    return settings.HOLDFAST_USER_AGENT.split("/", 1)[0].split()[0]
