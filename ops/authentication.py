"""DRF authentication and permissions for the internal API: bearer tokens and scopes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rest_framework import exceptions, permissions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.request import Request

from . import tokens

if TYPE_CHECKING:
    # Not at run time: DRF imports this module while rest_framework.views is still being
    # imported (its DEFAULT_AUTHENTICATION_CLASSES), and importing it back is circular.
    from rest_framework.views import APIView


class BearerTokenAuthentication(BaseAuthentication):
    """``Authorization: Bearer hf_…``. Missing, unknown or revoked: 401 with
    ``WWW-Authenticate: Bearer``. No session or basic auth, so no CSRF exposure."""

    keyword = b"bearer"

    def authenticate(self, request: Request) -> tuple[tokens.Principal, str] | None:
        header = get_authorization_header(request).split()
        if not header:
            return None
        if header[0].lower() != self.keyword or len(header) != 2:
            raise exceptions.AuthenticationFailed("use the header 'Authorization: Bearer <token>'")
        try:
            token = header[1].decode("ascii")
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("the token is not valid") from None
        principal = tokens.authenticate(token)
        if principal is None:
            raise exceptions.AuthenticationFailed("the token is unknown or revoked")
        return principal, token

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="holdfast"'


class TokenScope(permissions.BasePermission):
    """Read tokens may GET (and HEAD, OPTIONS); write tokens may also POST."""

    message = "this token's scope is read: it may not change anything"

    def has_permission(self, request: Request, view: APIView) -> bool:
        principal: Any = request.user
        if not isinstance(principal, tokens.Principal):
            return False
        return request.method in permissions.SAFE_METHODS or principal.can_write
