"""The WSGI side of the internal API: request bodies sent without a ``Content-Length``.

Django reads a request body only as far as ``CONTENT_LENGTH`` says. A body sent with
``Transfer-Encoding: chunked`` (what ``requests`` does for a generator body) has none, so
Django read it as empty and the API answered a request that said something else: a
``dry_run: true`` requeue ran as ``dry_run: false`` over no jobs, a comment went missing.
``ChunkedBodies`` reads such a body first, bounded by ``DATA_UPLOAD_MAX_MEMORY_SIZE``, and
hands Django a body of known length; past the bound Django refuses it as usual (413). A
server that passes the chunks on undecoded (``wsgi.input_terminated`` unset, as
``runserver``) cannot be read safely: 411, asking for a ``Content-Length``.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable
from typing import Any

from django.conf import settings

from jobs.log import get_logger

log = get_logger("ops.api")

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

READ_CHUNK = 64 * 1024


class ChunkedBodies:
    """WSGI middleware: a chunked request body becomes one of known length (see above)."""

    def __init__(self, app: WSGIApp) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        chunked = "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        if not chunked or environ.get("CONTENT_LENGTH"):
            return self.app(environ, start_response)
        if not environ.get("wsgi.input_terminated"):
            return refuse(
                start_response,
                411,
                "length_required",
                "this server cannot read a chunked body: send Content-Length",
            )
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        try:
            body = read_at_most(environ["wsgi.input"], None if limit is None else limit + 1)
        except OSError as exc:  # the client stalled past the server's timeout, or hung up
            log.warning("api_body_unreadable", error=f"{type(exc).__name__}: {exc}")
            return refuse(
                start_response,
                400,
                "bad_request",
                "the request body could not be read (timed out or cut short)",
            )
        # One byte past the limit is enough for Django to refuse it by its length (413).
        environ["CONTENT_LENGTH"] = str(len(body))
        environ["wsgi.input"] = io.BytesIO(body)
        return self.app(environ, start_response)


def read_at_most(stream: Any, limit: int | None) -> bytes:
    """Up to ``limit`` bytes of ``stream`` (all of it when None), a chunk at a time."""
    parts: list[bytes] = []
    size = 0
    while limit is None or size < limit:
        part = stream.read(READ_CHUNK if limit is None else min(READ_CHUNK, limit - size))
        if not part:
            break
        parts.append(part)
        size += len(part)
    return b"".join(parts)


def refuse(start_response: StartResponse, status: int, code: str, message: str) -> list[bytes]:
    """An error answered before Django sees the request, in the API's JSON shape."""
    reasons = {400: "Bad Request", 411: "Length Required"}
    body = json.dumps({"error": message, "code": code}).encode()
    start_response(
        f"{status} {reasons[status]}",
        [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
    )
    return [body]
