"""OpenAPI pieces drf-spectacular cannot infer: the bearer token scheme, shared responses."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse

from .serializers import ErrorResponse


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "ops.authentication.BearerTokenAuthentication"
    name = "bearerToken"

    def get_security_definition(self, auto_schema: AutoSchema) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "a token from `manage.py create_ops_token NAME --scope read|write`",
        }


def error(description: str) -> OpenApiResponse:
    return OpenApiResponse(ErrorResponse, description=description)


BAD_INPUT = error("bad input: `fields` names each offending field")
UNAUTHENTICATED = error("no token, or an unknown, malformed or revoked one")
FORBIDDEN = error("the token's scope is read: it may not POST")
NOT_FOUND = error("no such id")
UNKNOWN_FILTER = "nothing knows the `kind` or `lane` given (no handler, task, declared lane or job)"
CONFLICT = error("the job's or issue's state does not allow this action")
UNSUPPORTED = error("the body is not JSON (send Content-Type: application/json)")
DATABASE_DOWN = error("the database is unreachable; retry later")
NOT_ALLOWED = error("this method is not allowed here (the `Allow` header lists those that are)")
NOT_ACCEPTABLE = error("the `Accept` header excludes JSON, the only format")
TOO_LARGE = error("the body is larger than the API accepts (DATA_UPLOAD_MAX_MEMORY_SIZE)")

# Every endpoint refuses unknown query parameters (400), other methods (405) and an
# Accept header without JSON (406); every POST parses its body first (413, 415).
READ_ERRORS = {
    400: BAD_INPUT,
    401: UNAUTHENTICATED,
    405: NOT_ALLOWED,
    406: NOT_ACCEPTABLE,
    503: DATABASE_DOWN,
}
WRITE_ERRORS = {
    **READ_ERRORS,
    403: FORBIDDEN,
    404: NOT_FOUND,
    413: TOO_LARGE,
    415: UNSUPPORTED,
}


def id_parameter(name: str, what: str) -> OpenApiParameter:
    return OpenApiParameter(
        name,
        type={"type": "integer", "format": "int64", "minimum": 1},
        location=OpenApiParameter.PATH,
        description=f"the {what}'s id",
    )


def closed_request_bodies(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """Postprocessing hook: every request body refuses a field it does not take
    (``ops.serializers.Body``), so the schema says so (``additionalProperties: false``)
    and a generated client or a fuzzer sends none."""
    for name, component in result.get("components", {}).get("schemas", {}).items():
        if name.endswith("Request") and component.get("type") == "object":
            component["additionalProperties"] = False
    return result
