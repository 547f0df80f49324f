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

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.middleware.common import CommonMiddleware

from .messages import not_found_message

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
