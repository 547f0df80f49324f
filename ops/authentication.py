"""DRF authentication and permissions for the internal API: bearer tokens and scopes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rest_framework import exceptions, permissions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.request import Request

from jobs.log import get_logger

from . import tokens

if TYPE_CHECKING:
    # Not at run time: DRF imports this module while rest_framework.views is still being
    # imported (its DEFAULT_AUTHENTICATION_CLASSES), and importing it back is circular.
    from rest_framework.views import APIView

log = get_logger("ops.api")


class BearerTokenAuthentication(BaseAuthentication):
    """``Authorization: Bearer hf_…``. Missing, unknown, revoked or expired: 401 with
    ``WWW-Authenticate: Bearer``. No session or basic auth, so no CSRF exposure.

    Every refused token is logged (``api_auth_failed``, warning) with the reason, the
    token's public prefix when it parses, and the client's address; never the secret.
    """

    keyword = b"bearer"

    def authenticate(self, request: Request) -> tuple[tokens.Principal, str] | None:
        header = get_authorization_header(request).split()
        if not header:
            return None
        if header[0].lower() != self.keyword or len(header) != 2:
            refused(request, "not a bearer token")
            raise exceptions.AuthenticationFailed("use the header 'Authorization: Bearer <token>'")
        try:
            token = header[1].decode("ascii")
        except UnicodeDecodeError:
            refused(request, "malformed")
            raise exceptions.AuthenticationFailed("the token is not valid") from None
        verdict = tokens.check(token)
        if verdict.principal is None:
            refused(request, verdict.reason, verdict.prefix)
            raise exceptions.AuthenticationFailed("the token is unknown, revoked or expired")
        return verdict.principal, token

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="holdfast"'


def client_address(request: Any) -> str | None:
    """The peer's address (behind a proxy: the proxy's), and what it forwarded, if any."""
    meta = getattr(request, "META", {})
    address = meta.get("REMOTE_ADDR")
    forwarded = meta.get("HTTP_X_FORWARDED_FOR")
    return f"{address} (for {forwarded})" if forwarded else address


def refused(request: Request, reason: str, prefix: str | None = None) -> None:
    tokens.count_refusal(reason)
    log.warning(
        "api_auth_failed",
        reason=reason,
        token_prefix=prefix,
        client=client_address(request),
        method=request.method,
        path=request.path,
    )


class TokenScope(permissions.BasePermission):
    """Read tokens may GET (and HEAD, OPTIONS); write tokens may also POST."""

    message = "this token's scope is read: it may not change anything"

    def has_permission(self, request: Request, view: APIView) -> bool:
        principal: Any = request.user
        if not isinstance(principal, tokens.Principal):
            return False
        if not hasattr(view, (request.method or "").lower()):
            return True  # a method the endpoint does not take: a 405 for every token
        return request.method in permissions.SAFE_METHODS or principal.can_write
