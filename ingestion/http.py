"""Polite HTTP for ingestion: every request a source causes goes through :func:`get`.

Politeness is kept in the database, so it holds across every worker and host, not per
process: before each request the source's row is locked for a moment, the request takes
the slot ``max(now, next_request_at)`` (database clock) and moves ``next_request_at``
``spacing_seconds`` past it; the row is unlocked before the wait, so a sleeping request
never blocks anyone. robots.txt is fetched through the same path, kept on the source row
for a day, parsed by RFC 9309 (longest match wins; ``*`` and ``$`` in paths) and checked
before every hop, redirects included (they are followed by hand, at most
:data:`MAX_REDIRECTS`). Every connection, robots.txt's and every redirect's included, is
made by IP to an address :mod:`ingestion.egress` allowed when it was resolved for that
connection (no rebinding window): public addresses only, unless the source was added
with ``--allow-private`` and the request is to its own host. Bodies are streamed,
decoded incrementally and abandoned past a byte cap counted on decoded bytes; a whole
call has a total deadline.

``get`` returns every HTTP status as a :class:`Response` (callers decide what a 304, 404
or 503 means for them) and raises :class:`FetchError` only when no usable answer came:
``transient`` says whether trying again later can help.

Call it outside any transaction: the spacing reservation must commit before the wait.
"""

from __future__ import annotations

import math
import socket
import ssl
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from functools import lru_cache
from typing import Any
from urllib.parse import urldefrag, urljoin, urlsplit

import httpcore
import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from protego import Protego

from jobs import engine
from jobs.exceptions import HoldfastError
from jobs.log import get_logger

from . import egress
from .egress import IPAddress, address_allowed, is_public
from .models import Source
from .sources import MAX_SPACING_SECONDS

log = get_logger("ingestion.http")

MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
ROBOTS_MAX_AGE = timedelta(days=1)
ROBOTS_MAX_BYTES = 512 * 1024  # RFC 9309 asks crawlers to read at least 500 KiB
CHUNK_BYTES = 64 * 1024
RETRY_AFTER_MAX = timedelta(days=1)  # the longest pause a site's Retry-After gets

ACCEPT_ENCODING = "gzip, deflate"  # what _Inflater undoes, with a bound

__all__ = ["address_allowed", "is_public"]  # the address policy lives in ingestion.egress


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
    """The host resolves to an address the source may not reach (``ingestion.egress``).

    A third-party listing (or a redirect, or a DNS answer) must not make workers fetch
    cloud metadata, localhost or the private network and turn the answers into
    searchable documents.
    """

    transient = False


def get(
    source: Source,
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    max_bytes: int | None = None,
) -> Response:
    """GET ``url`` on behalf of ``source``: robots-checked, spaced, capped, redirects bounded.

    The whole call, robots.txt and redirects included, has ``HOLDFAST_FETCH_DEADLINE_SECONDS``
    of network time (waits for the source's turn do not count); every read, write and
    connect also has ``HOLDFAST_FETCH_TIMEOUT_SECONDS``.
    """
    cap = settings.HOLDFAST_FETCH_MAX_BYTES if max_bytes is None else max_bytes
    elapsed = 0.0
    current = _checked_url(url)
    deadline = Deadline(float(settings.HOLDFAST_FETCH_DEADLINE_SECONDS), url)
    with _client(source, deadline) as client:
        for _hop in range(MAX_REDIRECTS + 1):
            check_address(source, current)
            _check_robots(client, source, current, deadline)
            answer = _exchange(client, source, current, headers, cap, deadline)
            elapsed += answer.elapsed
            target = _redirect_target(answer)
            if target is None:
                return Response(answer.status, current, answer.headers, answer.body, elapsed)
            current = target
    raise TooManyRedirects(f"GET {url}: more than {MAX_REDIRECTS} redirects (last to {current})")


# --- deadline and pinned connections ---------------------------------------------------


class DeadlinePassed(FetchError):
    """The fetch's total deadline passed (a server trickling bytes, or too many slow hops)."""


class Deadline:
    """A budget of network seconds for one :func:`get`; waits for a turn are added back."""

    def __init__(self, seconds: float, url: str) -> None:
        self.seconds = seconds
        self.url = url
        self._ends = time.monotonic() + seconds

    def extend(self, seconds: float) -> None:
        self._ends += max(seconds, 0.0)

    def bound(self, timeout: float | None) -> float:
        """``timeout`` shortened to what is left; raises once nothing is left."""
        left = self._ends - time.monotonic()
        if left <= 0:
            raise self.passed()
        return left if timeout is None else min(timeout, left)

    def passed(self) -> DeadlinePassed:
        return DeadlinePassed(f"GET {self.url}: the fetch deadline of {self.seconds:g} s passed")

    def timed_out(self, exc: TimeoutError, kind: type[Exception]) -> Exception:
        """What a socket timeout means: the deadline, if it has passed, or ``kind``."""
        if self._ends - time.monotonic() <= 0.05:
            return self.passed()
        return kind(str(exc))


class _PinnedBackend(httpcore.NetworkBackend):
    """Connects by IP to an address the egress policy allowed, at the moment of connecting.

    httpcore hands over the URL's host; it is resolved here (once), every address is
    judged, and the socket connects to an allowed address itself, so no second lookup
    can answer differently. TLS still uses the host name (httpcore passes it as
    ``server_hostname`` to ``start_tls``: SNI and the certificate check), and the
    ``Host`` header comes from the URL.
    """

    def __init__(self, source: Source, deadline: Deadline) -> None:
        self.source = source
        self.deadline = deadline
        self.connected: list[IPAddress] = []  # for tests and logs: where we really went

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        try:
            addresses = egress.resolve(host, port)
        except egress.ResolutionError as exc:
            raise FetchError(f"GET {self.deadline.url}: {exc}") from None
        private = egress.private_allowed(self.source.allow_private, self.source.url, host, port)
        bad = egress.refused(addresses, private)
        if bad is not None:
            raise _forbidden(self.source, self.deadline.url, host, bad, private)
        error: Exception | None = None
        for address in addresses:
            try:
                sock = socket.create_connection((str(address), port), self.deadline.bound(timeout))
            except TimeoutError as exc:
                error = self.deadline.timed_out(exc, httpcore.ConnectTimeout)
                if isinstance(error, DeadlinePassed):
                    raise error from exc
                continue  # the next address (a dead AAAA record is common), as browsers do
            except OSError as exc:
                error = httpcore.ConnectError(str(exc))
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.connected.append(address)
            return _BoundedStream(sock, self.deadline)
        raise error or httpcore.ConnectError("no address to connect to")

    def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.NetworkStream:
        raise FetchError("unix sockets are not used", transient=False)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class _BoundedStream(httpcore.NetworkStream):
    """A socket whose every read and write also ends at the fetch's deadline."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        self._sock = sock
        self._deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self._sock.settimeout(self._deadline.bound(timeout))
        try:
            return self._sock.recv(max_bytes)
        except TimeoutError as exc:
            raise self._deadline.timed_out(exc, httpcore.ReadTimeout) from exc
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        while buffer:
            self._sock.settimeout(self._deadline.bound(timeout))
            try:
                sent = self._sock.send(buffer)
            except TimeoutError as exc:
                raise self._deadline.timed_out(exc, httpcore.WriteTimeout) from exc
            except OSError as exc:
                raise httpcore.WriteError(str(exc)) from exc
            buffer = buffer[sent:]

    def close(self) -> None:
        self._sock.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        self._sock.settimeout(self._deadline.bound(timeout))
        try:
            wrapped = ssl_context.wrap_socket(self._sock, server_hostname=server_hostname)
        except TimeoutError as exc:
            self.close()
            raise self._deadline.timed_out(exc, httpcore.ConnectTimeout) from exc
        except ssl.SSLCertVerificationError as exc:
            # The site's certificate (expired, self-signed, another name): not fixed by
            # retrying in a minute, so not transient; it names the certificate's fault.
            self.close()
            raise FetchError(
                f"GET {self._deadline.url}: TLS certificate refused: {exc.verify_message or exc}",
                transient=False,
            ) from exc
        except OSError as exc:  # ssl.SSLError is an OSError
            self.close()
            raise httpcore.ConnectError(str(exc)) from exc
        return _BoundedStream(wrapped, self._deadline)

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object" and isinstance(self._sock, ssl.SSLSocket):
            return self._sock._sslobj  # type: ignore[attr-defined]
        if info == "client_addr":
            return self._sock.getsockname()
        if info == "server_addr":
            return self._sock.getpeername()
        if info == "socket":
            return self._sock
        if info == "is_readable":
            return httpcore._utils.is_socket_readable(self._sock)
        return None


# --- one request -----------------------------------------------------------------------


def _client(source: Source, deadline: Deadline) -> httpx.Client:
    """A client whose every connection goes through the pinned, deadline-bound backend.

    ``trust_env=False``: a proxy from the environment would make the address actually
    connected to the proxy's, out of this policy's sight.
    """
    timeout = float(settings.HOLDFAST_FETCH_TIMEOUT_SECONDS)
    transport = httpx.HTTPTransport(retries=0, trust_env=False)
    transport._pool = httpcore.ConnectionPool(  # the one hook httpx offers for a backend
        ssl_context=httpx.create_ssl_context(trust_env=False),
        network_backend=_PinnedBackend(source, deadline),
        retries=0,
    )
    return httpx.Client(
        transport=transport,
        timeout=httpx.Timeout(timeout),
        headers={"User-Agent": settings.HOLDFAST_USER_AGENT, "Accept-Encoding": ACCEPT_ENCODING},
        follow_redirects=False,
        trust_env=False,
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
    deadline: Deadline,
    *,
    truncate: bool = False,
) -> Response:
    """One request in the source's turn; the body is decoded only while under ``cap``.

    Past ``cap`` (decoded bytes, across every stacked Content-Encoding) the transfer is
    abandoned: with ``truncate`` the first ``cap`` bytes are the body, otherwise
    :class:`TooLarge` is raised.
    """
    deadline.extend(wait_turn(source))
    started = time.monotonic()
    try:
        with client.stream("GET", url, headers=dict(headers or {})) as response:
            if response.status_code in REDIRECT_STATUSES and "location" in response.headers:
                body = b""  # a redirect's body is never needed
            else:
                body = _read_body(response, url, cap, truncate)
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
    except (httpx.LocalProtocolError, UnicodeEncodeError) as exc:
        # A request that cannot be written (a header value that is not ASCII, say).
        raise FetchError(f"GET {url}: the request cannot be sent: {exc}", transient=False) from exc
    took = time.monotonic() - started
    log.debug("http_get", source=source.name, url=url, status=response.status_code, took=took)
    return Response(response.status_code, url, response.headers, body, took)


def _read_body(response: httpx.Response, url: str, cap: int, truncate: bool) -> bytes:
    """The decoded body, counted as it is decoded: never more than ``cap`` bytes in memory.

    Content-Encodings are undone here, incrementally and in the reverse of the order they
    were applied, each stage producing at most :data:`CHUNK_BYTES` at a time, so a small
    response that inflates to gigabytes (``gzip, gzip``) stops at the cap after at most
    that much work. Every stage's output counts against the cap, not just the last.
    """
    declared = response.headers.get("content-length", "")
    encodings = _encodings(response, url)
    if not truncate and not encodings and declared.isdigit() and int(declared) > cap:
        raise TooLarge(f"GET {url}: body of {declared} bytes is over the {cap}-byte cap")
    stages = [_Inflater(name, url) for name in reversed(encodings)]
    produced = [0] * len(stages)
    body = bytearray()

    def feed(data: bytes, level: int) -> bool:
        """Push ``data`` through stages ``level``…; False once the body is full."""
        if level == len(stages):
            body.extend(data)
            if len(body) > cap:
                if truncate:
                    return False
                raise TooLarge(f"GET {url}: body is over the {cap}-byte cap; transfer abandoned")
            return True
        for piece in stages[level].decode(data):
            produced[level] += len(piece)
            if produced[level] > cap and not (truncate and level == len(stages) - 1):
                raise TooLarge(
                    f"GET {url}: decoding {encodings[len(stages) - 1 - level]} yields more"
                    f" than the {cap}-byte cap; transfer abandoned"
                )
            if not feed(piece, level + 1):
                return False
        return True

    wire = 0
    for chunk in response.iter_raw(CHUNK_BYTES):
        wire += len(chunk)
        if stages and wire > cap + cap // 8 + CHUNK_BYTES:
            # More on the wire than any body under the cap needs, even incompressible
            # data; what decodes to little or nothing (a stream of empty gzip members)
            # must not hold the worker until the deadline.
            if truncate:
                return bytes(body[:cap])
            raise TooLarge(f"GET {url}: encoded body is over the {cap}-byte cap; abandoned")
        if not feed(chunk, 0):
            return bytes(body[:cap])
    for level, stage in enumerate(stages):
        if not feed(stage.flush(), level + 1):
            return bytes(body[:cap])
    for stage in stages:
        if not stage.ended:
            # The connection closed inside the compressed stream (a body whose length is
            # the connection's): what decoded so far is a part, never the document.
            raise FetchError(f"GET {url}: the {stage.name} body was cut before its end")
    return bytes(body[:cap]) if truncate else bytes(body)


def _encodings(response: httpx.Response, url: str) -> list[str]:
    """The Content-Encodings applied to the body, in the order they were applied."""
    names = []
    for value in response.headers.get_list("content-encoding"):
        for name in value.split(","):
            name = name.strip().lower()
            if name and name != "identity":
                if name not in _Inflater.KINDS:
                    raise FetchError(
                        f"GET {url}: unsupported Content-Encoding {name!r}", transient=False
                    )
                names.append(name)
    return names


class _Inflater:
    """One Content-Encoding undone incrementally, at most :data:`CHUNK_BYTES` per step."""

    KINDS = frozenset({"gzip", "x-gzip", "deflate"})

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.url = url
        self.raw_deflate = False
        self._decoder = self._new()
        self._first = True
        self._fed = False

    def _new(self) -> Any:
        if self.name in ("gzip", "x-gzip"):
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        return zlib.decompressobj(-zlib.MAX_WBITS if self.raw_deflate else zlib.MAX_WBITS)

    @property
    def ended(self) -> bool:
        """Whether the stream reached its end marker (or never began: an empty body)."""
        return self._decoder.eof or not self._fed

    def decode(self, data: bytes) -> Iterator[bytes]:
        self._fed = self._fed or bool(data)
        while data:
            try:
                piece = self._decoder.decompress(data, CHUNK_BYTES)
            except zlib.error as exc:
                if self.name == "deflate" and self._first and not self.raw_deflate:
                    self.raw_deflate = True  # servers that send raw deflate, as httpx allows
                    self._decoder = self._new()
                    continue
                raise FetchError(
                    f"GET {self.url}: undecodable {self.name} body: {exc}", transient=False
                ) from None
            self._first = False
            if piece:
                yield piece
            data = self._decoder.unconsumed_tail
            if self._decoder.eof:
                rest = self._decoder.unused_data
                if self.name in ("gzip", "x-gzip") and rest.lstrip(b"\x00"):
                    self._decoder = self._new()  # another gzip member follows
                    data = rest + data
                else:
                    return

    def flush(self) -> bytes:
        try:
            return self._decoder.flush(CHUNK_BYTES) if not self._decoder.eof else b""
        except zlib.error as exc:
            raise FetchError(
                f"GET {self.url}: undecodable {self.name} body: {exc}", transient=False
            ) from None


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


def retry_after(response: Response) -> float | None:
    """The seconds a 429 or 503 asks us to wait (``Retry-After``: seconds, or an HTTP
    date), at most :data:`RETRY_AFTER_MAX`; None when absent, past, or not understood."""
    value = response.headers.get("retry-after", "").strip()
    if value.isascii() and value.isdigit():  # isdigit alone also takes other scripts' digits
        seconds = float(int(value[:12]))  # twelve digits are already past any cap
    else:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - timezone.now()).total_seconds()
    if not seconds > 0:
        return None
    return min(seconds, RETRY_AFTER_MAX.total_seconds())


def hold_off(source: Source, seconds: float) -> None:
    """The site asked for a pause: no request of ``source`` before ``seconds`` from now
    (its next turn, :func:`wait_turn`, moves there; it never moves back)."""
    with transaction.atomic():
        locked = Source.objects.select_for_update().only("next_request_at").get(pk=source.pk)
        until = engine.db_now() + timedelta(seconds=seconds)
        if locked.next_request_at is None or locked.next_request_at < until:
            Source.objects.filter(pk=source.pk).update(next_request_at=until)


def _spacing(seconds: float) -> timedelta:
    """The row's spacing, held to 0..MAX_SPACING_SECONDS.

    ``add_source`` refuses anything else, but a row written another way must not make
    every request overflow (``timedelta(seconds=1e308)``) or wait for ever.
    """
    if math.isnan(seconds):
        seconds = MAX_SPACING_SECONDS
    return timedelta(seconds=min(max(seconds, 0.0), MAX_SPACING_SECONDS))


# --- addresses -------------------------------------------------------------------------


def check_address(source: Source, url: str) -> None:
    """Raise :class:`ForbiddenAddress` early if ``url``'s host resolves where the source may
    not go, before its turn is taken or robots.txt is read.

    This is only the early, friendly answer: the connection itself resolves once more and
    connects by IP to an address it judged (see :class:`_PinnedBackend`), which is what
    closes the rebinding window. A name that does not resolve is left to the connection
    (a transient error there).
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = egress.resolve(host, port)
    except egress.ResolutionError:
        return
    private = egress.private_allowed(source.allow_private, source.url, host, port)
    bad = egress.refused(addresses, private)
    if bad is not None:
        raise _forbidden(source, url, host, bad, private)


def _forbidden(
    source: Source, url: str, host: str, address: IPAddress, private: bool
) -> ForbiddenAddress:
    log.warning("address_forbidden", source=source.name, url=url, address=str(address))
    if private or egress.never_allowed(address):
        why = "an address no source may reach (metadata, this network, multicast or reserved)"
    elif source.allow_private:
        why = "an internal address, and --allow-private covers the source's own host only"
    else:
        why = "an internal address (the source was not added with --allow-private)"
    return ForbiddenAddress(f"GET {url}: {host} resolves to {address}, {why}")


# --- robots.txt ------------------------------------------------------------------------

# robots.txt of hosts other than the source's own (a redirect elsewhere, a feed entry on
# another host), per process, the most recently used :data:`OTHER_HOSTS_KEPT` only: a feed
# naming a new host per entry, each with 512 KiB of robots.txt, must not grow a worker
# without bound.
OTHER_HOSTS_KEPT = 256
_other_hosts: OrderedDict[tuple[int, str], tuple[datetime, str]] = OrderedDict()
_other_hosts_lock = threading.Lock()


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.lower()}"  # host names have no case


def _check_robots(client: httpx.Client, source: Source, url: str, deadline: Deadline) -> None:
    origin = _origin(url)
    if origin == _origin(source.url):
        text = _source_robots(client, source, origin, deadline)
    else:
        text = _other_robots(client, source, origin, deadline)
    if not _parser(text).can_fetch(url, _product_token()):
        log.info("robots_disallowed", source=source.name, url=url)
        raise RobotsDisallowed(f"GET {url}: disallowed by {origin}/robots.txt")


def _fresh(fetched_at: datetime | None) -> bool:
    return fetched_at is not None and timezone.now() - fetched_at < ROBOTS_MAX_AGE


def _source_robots(client: httpx.Client, source: Source, origin: str, deadline: Deadline) -> str:
    """The source's robots.txt, kept on its row and fetched again once a day."""
    if _fresh(source.robots_fetched_at):
        return source.robots_txt
    source.refresh_from_db(fields=["robots_txt", "robots_fetched_at"])  # another worker's?
    if _fresh(source.robots_fetched_at):
        return source.robots_txt
    text = _fetch_robots(client, source, origin, deadline)
    fetched_at = timezone.now()
    Source.objects.filter(pk=source.pk).update(robots_txt=text, robots_fetched_at=fetched_at)
    source.robots_txt, source.robots_fetched_at = text, fetched_at
    log.info("robots_fetched", source=source.name, url=f"{origin}/robots.txt", size=len(text))
    return text


def _other_robots(client: httpx.Client, source: Source, origin: str, deadline: Deadline) -> str:
    key = (source.pk, origin)
    with _other_hosts_lock:
        cached = _other_hosts.get(key)
        if cached is not None:
            _other_hosts.move_to_end(key)
    if cached is not None and _fresh(cached[0]):
        return cached[1]
    text = _fetch_robots(client, source, origin, deadline)
    with _other_hosts_lock:
        _other_hosts[key] = (timezone.now(), text)
        _other_hosts.move_to_end(key)
        while len(_other_hosts) > OTHER_HOSTS_KEPT:
            _other_hosts.popitem(last=False)
    return text


def _fetch_robots(client: httpx.Client, source: Source, origin: str, deadline: Deadline) -> str:
    """robots.txt by RFC 9309: 2xx is the rules, 4xx allows everything, 5xx retries later
    (and 408 and 429, which say "later", not "there is none").

    Only the first :data:`ROBOTS_MAX_BYTES` are read (RFC 9309 §2.5: at least 500 KiB,
    the rest ignored), up to the last complete line.
    """
    url = f"{origin}/robots.txt"
    for _hop in range(MAX_REDIRECTS + 1):
        check_address(source, url)
        answer = _exchange(client, source, url, None, ROBOTS_MAX_BYTES, deadline, truncate=True)
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
    if 400 <= answer.status < 500 and answer.status not in (408, 429):
        return ""  # unavailable: allow all; but "too many requests" is no answer to that
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
