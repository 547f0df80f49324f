"""Middleware that keeps every answer of the API JSON, whatever ``DJANGO_DEBUG`` says.

In production Django's error pages are the JSON handlers of ``config/urls.py``. With
``DEBUG`` on, Django answers an unknown URL or a bad ``Host`` with its HTML debug pages
instead, and ``APPEND_SLASH`` turns a POST without its trailing slash into a
``RuntimeError`` (a 500): an ops script tested against a debug instance met HTML.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus

from django.db import DatabaseError, connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.middleware.common import CommonMiddleware

from .messages import not_found_message

API_PREFIX = "/internal/v1/"
# PostgreSQL waits of one API request: below gunicorn's 30 s timeout (deploy/), which
# kills the worker process and answers a 500. A lock wait (a row an operator action needs,
# held by a frozen session; a migration's table lock) ends first, then any statement.
API_LOCK_TIMEOUT_MS = 5_000
API_STATEMENT_TIMEOUT_MS = 20_000

JSON_TYPES = ("application/json", "application/problem+json")
CODES = {400: "bad_request", 403: "permission_denied", 404: "not_found", 500: "server_error"}


class JsonErrors:
    """Outermost: an error answer that is not JSON is answered as JSON, with the same
    status; a redirect's empty HTML body becomes ``{"location": …}``."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        content_type = response.get("Content-Type", "")
        if content_type.startswith(JSON_TYPES) or response.status_code < 300:
            return response
        if response.status_code < 400:
            if "Location" not in response:
                return response
            response.content = json.dumps({"location": response["Location"]}).encode()
            response["Content-Type"] = "application/json"
            # CommonMiddleware measured the empty body: a stale length would cut the body
            # short (gunicorn) or leave its bytes to be read as the next response.
            response["Content-Length"] = str(len(response.content))
            return response
        status = response.status_code
        if status == 404:
            message = not_found_message(request.path)
        else:
            message = HTTPStatus(status).phrase.lower() if status in HTTPStatus else "error"
        converted = JsonResponse(
            {"error": message, "code": CODES.get(status, "error")}, status=status
        )
        for header in ("Allow", "WWW-Authenticate", "Retry-After"):
            if header in response:
                converted[header] = response[header]
        return converted


class SlashRedirects(CommonMiddleware):
    """Django's ``CommonMiddleware``, redirecting to the trailing slash only for GET and
    HEAD. A redirected POST loses its body (and under ``DEBUG`` Django raises instead), so
    a POST without the slash is a 404 that names the right path."""

    def should_redirect_with_slash(self, request: HttpRequest) -> bool:
        return request.method in ("GET", "HEAD") and super().should_redirect_with_slash(request)


class HeadWithoutBody:
    """A HEAD answer has the headers of the GET, ``Content-Length`` included, and no body
    (RFC 9110 §9.3.2): Django's WSGI handler leaves the body in, and gunicorn sends it,
    which a keep-alive client or proxy would read as the start of the next answer."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if request.method == "HEAD" and not response.streaming:
            response["Content-Length"] = str(len(response.content))
            response.content = b""
            response["Content-Length"] = response["Content-Length"]
        return response


class BoundedDatabaseWaits:
    """PostgreSQL: each API request runs in one transaction whose lock waits and
    statements are bounded (``SET LOCAL``: safe behind a pooler in transaction mode, and
    no other session is touched). Without it a request waited on a row lock (a frozen
    session holding a dead job or an issue) or a migration's table lock until gunicorn
    killed its worker: a 500 after 30 s, and with every worker waiting the whole API,
    ``health/`` included, hung. A wait that ends is an ``OperationalError``: the API's 503
    ``database_unavailable``. What the request wrote commits at its end, as each write
    did on its own before (a refused token's count, say); the view's own ``atomic()``
    blocks are savepoints of it. SQLite's busy timeout (20 s) already ends its waits
    first."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith(API_PREFIX) or connection.vendor != "postgresql":
            return self.get_response(request)
        block = transaction.atomic()
        try:
            block.__enter__()
        except DatabaseError:  # cannot connect: the view meets it too, and says 503
            return self.get_response(request)
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT set_config('lock_timeout', %s, true),"
                    " set_config('statement_timeout', %s, true)",
                    [f"{API_LOCK_TIMEOUT_MS}ms", f"{API_STATEMENT_TIMEOUT_MS}ms"],
                )
        except DatabaseError as exc:
            block.__exit__(type(exc), exc, exc.__traceback__)  # rolled back
            return self.get_response(request)
        response = self.get_response(request)  # never raises: Django made it an answer
        if _aborted():  # a statement failed outside any block of the view's: nothing to keep
            transaction.set_rollback(True)
        try:
            block.__exit__(None, None, None)  # the commit
        except DatabaseError:
            from .exceptions import DATABASE_UNAVAILABLE  # imports the models (holdfast.E010)

            connection.close()
            return JsonResponse(
                {"error": DATABASE_UNAVAILABLE, "code": "database_unavailable"}, status=503
            )
        return response


def _aborted() -> bool:
    """Whether the request's PostgreSQL transaction is in error (its commit would fail)."""
    from psycopg.pq import TransactionStatus

    raw = connection.connection
    return raw is not None and raw.info.transaction_status == TransactionStatus.INERROR
