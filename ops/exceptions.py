"""Every error of the internal API as JSON: ``{"error": "<one line>", "code": "<reason>"}``.

DRF's own errors (401, 403, 404, 405, 406, 415, parse errors) keep their status; bad input
(400) adds ``fields``, naming each offending field and what is wrong with it. The engine's
errors map to HTTP as DESIGN §8 says: an unknown id is 404, an action that the job's state
does not allow is 409. A database that cannot be reached is 503. Django's 404 and 500
pages for URLs outside any view are JSON too (``not_found`` and ``server_error``, wired
in ``config/urls.py``).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import (
    RequestDataTooBig,
    SuspiciousOperation,
    TooManyFieldsSent,
)
from django.db import DatabaseError, connection
from django.http import Http404, HttpRequest, JsonResponse, UnreadablePostError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import set_rollback

from jobs import sql
from jobs.exceptions import HoldfastError, InvalidJob, StateConflict
from jobs.log import get_logger

from . import tokens
from .authentication import client_address
from .messages import not_found_message, one_line

log = get_logger("ops.api")

DATABASE_UNAVAILABLE = "the database is unavailable; try again shortly"


def database_down(exc: BaseException) -> bool:
    """The database cannot serve the request now (down, unreachable, restarting, refusing
    writes on a standby; SQLite locked past the busy timeout): a 503 to retry, never a
    500. The connection is closed then, so the next request opens a new one: the API keeps
    its connections, and one left on a standby after a failover (whose ``SELECT 1``
    health check passes) answered 503 until the process restarted."""
    if not (isinstance(exc, DatabaseError) and sql.unavailable(exc)):
        return False
    connection.close()
    return True


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "conflict"
    default_detail = "the resource's state does not allow this"


class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "too_large"
    default_detail = "the request body is larger than this API accepts"


class DatabaseUnavailable(exceptions.APIException):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_code = "database_unavailable"
    default_detail = DATABASE_UNAVAILABLE


def field_errors(detail: Any) -> dict[str, list[str]]:
    """DRF's validation detail as ``{field: [message, …]}``; errors of the whole body go
    under ``body``."""
    if isinstance(detail, dict):
        return {
            ("body" if key == "non_field_errors" else one_line(str(key), 200)): messages_of(value)
            for key, value in detail.items()
        }
    return {"body": messages_of(detail)}


def messages_of(detail: Any) -> list[str]:
    """A field's error detail as plain messages. A list field's detail is a dict of item
    errors (``{0: [...]}``): each becomes ``item 0: …``, never a Python repr."""
    if isinstance(detail, dict):
        return [
            f"item {index}: {message}"
            for index, value in detail.items()
            for message in messages_of(value)
        ]
    if isinstance(detail, list):
        return [message for value in detail for message in messages_of(value)]
    return [one_line(str(detail))]


def summary(fields: dict[str, list[str]]) -> str:
    return "; ".join(f"{field}: {' '.join(messages)}" for field, messages in fields.items())


def as_api_exception(exc: Exception) -> exceptions.APIException | None:
    """The API error an exception stands for, or None for a bug (left to Django: a 500)."""
    if isinstance(exc, exceptions.APIException):
        return exc
    if isinstance(exc, RequestDataTooBig):
        return PayloadTooLarge(
            f"the request body is larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes"
        )
    if isinstance(exc, UnreadablePostError):  # the client stopped sending: timed out, or gone
        return exceptions.ParseError(
            "the request body could not be read: the client stopped sending it "
            "(timed out or cut short)"
        )
    if isinstance(exc, TooManyFieldsSent):
        return exceptions.ParseError(
            f"more than {settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} parameters", code="invalid"
        )
    if isinstance(exc, SuspiciousOperation):
        return exceptions.ParseError(str(exc) or "bad request", code="bad_request")
    if isinstance(exc, Http404):
        return exceptions.NotFound(str(exc) or None)
    if isinstance(exc, DjangoPermissionDenied):
        return exceptions.PermissionDenied(str(exc) or None)
    # JobNotFound, IssueNotFound, ... (not any LookupError: a stray KeyError is a bug).
    if isinstance(exc, HoldfastError) and isinstance(exc, LookupError):
        return exceptions.NotFound(str(exc))
    if isinstance(exc, StateConflict):
        return Conflict(str(exc))
    if isinstance(exc, InvalidJob):
        return exceptions.ValidationError({"body": [str(exc)]})
    if database_down(exc):
        return DatabaseUnavailable()
    return None


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's ``EXCEPTION_HANDLER`` for the internal API."""
    api_exc = as_api_exception(exc)
    if api_exc is None:
        return None
    request = context.get("request")
    where = {
        "method": getattr(request, "method", None),
        "path": getattr(request, "path", None),
    }
    headers: dict[str, str] = {}
    # As DRF's own handler: APIView.handle_exception sets auth_header on 401s; throttles
    # set wait.
    auth_header = getattr(api_exc, "auth_header", None)
    if auth_header:
        headers["WWW-Authenticate"] = str(auth_header)
    wait = getattr(api_exc, "wait", None)
    if wait:
        headers["Retry-After"] = f"{wait:.0f}"
    data: dict[str, Any]
    if isinstance(api_exc, exceptions.ValidationError):
        fields = field_errors(api_exc.detail)
        data = {"error": one_line(summary(fields)), "code": "invalid", "fields": fields}
    elif isinstance(api_exc, exceptions.NotAuthenticated):
        data = {
            "error": "no token: send the header 'Authorization: Bearer <token>'",
            "code": "not_authenticated",
        }
    else:
        codes = api_exc.get_codes()
        data = {
            "error": one_line(str(api_exc.detail)),
            "code": codes if isinstance(codes, str) else api_exc.default_code,
        }
    if isinstance(api_exc, DatabaseUnavailable):
        log.warning("api_database_unavailable", error=f"{type(exc).__name__}: {exc}", **where)
    elif isinstance(api_exc, exceptions.NotAuthenticated):
        tokens.count_refusal("no token")
        log.info(
            "api_auth_failed",
            reason="no token",
            token_prefix=None,
            client=client_address(request),
            **where,
        )
    elif isinstance(api_exc, exceptions.PermissionDenied):
        principal = getattr(request, "user", None)
        tokens.count_refusal("insufficient scope")
        log.warning(
            "api_forbidden",
            token=getattr(principal, "name", None),
            client=client_address(request),
            **where,
        )
    set_rollback()
    return Response(data, status=api_exc.status_code, headers=headers)


# --- Django's handlers, for URLs that reach no API view ---------------------------------


def bad_request(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    """Django's 400 (a bad ``Host`` header, a body or query string over Django's limits,
    raised before any view runs), as JSON; an oversized body is a 413."""
    if isinstance(exception, RequestDataTooBig):
        message = f"the request body is larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes"
        return JsonResponse({"error": message, "code": "too_large"}, status=413)
    if isinstance(exception, TooManyFieldsSent):
        message = f"more than {settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} parameters"
        return JsonResponse({"error": message, "code": "invalid"}, status=400)
    message = one_line(str(exception)) if exception is not None and str(exception) else ""
    return JsonResponse({"error": message or "bad request", "code": "bad_request"}, status=400)


def forbidden(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return JsonResponse({"error": "forbidden", "code": "permission_denied"}, status=403)


def not_found(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return JsonResponse({"error": not_found_message(request.path), "code": "not_found"}, status=404)


def server_error(request: HttpRequest) -> JsonResponse:
    # Django has logged the exception (logger django.request) before calling this.
    return JsonResponse({"error": "internal server error", "code": "server_error"}, status=500)
