"""Creating, checking and revoking operator API tokens.

A token reads ``hf_<prefix>_<secret>``. The prefix (public, unique) finds the row; the
whole token, salted, is hashed with SHA-256 and compared with the stored digest in
constant time. The secret has 256 bits of entropy, so a fast salted hash is enough: there
is nothing to brute-force. The plain token is shown once, at creation, and never stored.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta

from django.db import IntegrityError, transaction
from django.db.models.functions import Now
from django.utils import timezone

from jobs.exceptions import HoldfastError, InvalidJob
from jobs.log import get_logger

from .models import OpsToken, Scope

log = get_logger("ops.tokens")

# Matched with fullmatch: "$" would also accept a trailing newline.
TOKEN_PATTERN = re.compile(r"hf_([A-Za-z0-9]{8})_([A-Za-z0-9_-]{43})")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,99}")
LAST_USED_RESOLUTION = timedelta(minutes=1)  # at most one write per token per minute


class TokenNotFound(HoldfastError, LookupError):
    """No live token has this name."""


@dataclass(frozen=True)
class Principal:
    """Who is calling the API: a token's name and scope (DRF's ``request.user``)."""

    name: str
    scope: str
    is_authenticated: bool = True

    @property
    def can_write(self) -> bool:
        return self.scope == Scope.WRITE


def _digest(salt: str, token: str) -> str:
    return hashlib.sha256(f"{salt}:{token}".encode()).hexdigest()


def create(name: str, scope: str) -> tuple[OpsToken, str]:
    """Issue a token; returns the row and the plain token, which is never shown again."""
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidJob(
            f"token name {name!r} must be 1-100 letters, digits or _ . @ - "
            "and start with a letter or digit"
        )
    if scope not in Scope.values:
        raise InvalidJob(f"scope must be read or write, not {scope!r}")
    prefix = "".join(secrets.choice("abcdefghijkmnopqrstuvwxyz23456789") for _ in range(8))
    token = f"hf_{prefix}_{secrets.token_urlsafe(32)}"
    salt = secrets.token_hex(16)
    try:
        with transaction.atomic():
            row = OpsToken.objects.create(
                name=name, scope=scope, prefix=prefix, salt=salt, digest=_digest(salt, token)
            )
    except IntegrityError:
        raise InvalidJob(f"a live token named {name!r} exists; revoke it first") from None
    log.info("ops_token_created", name=name, scope=scope, prefix=prefix)
    return row, token


def revoke(name: str) -> OpsToken:
    with transaction.atomic():
        row = OpsToken.objects.filter(name=name, revoked_at__isnull=True).first()
        if row is None:
            raise TokenNotFound(f"no live token named {name!r}")
        OpsToken.objects.filter(pk=row.pk).update(revoked_at=Now())
    log.info("ops_token_revoked", name=name, prefix=row.prefix)
    row.refresh_from_db()
    return row


def authenticate(token: str) -> Principal | None:
    """The caller behind ``token``, or None for a malformed, unknown or revoked token."""
    match = TOKEN_PATTERN.fullmatch(token)
    if match is None:
        return None
    row = OpsToken.objects.filter(prefix=match[1], revoked_at__isnull=True).first()
    if row is None or not hmac.compare_digest(row.digest, _digest(row.salt, token)):
        return None
    now = timezone.now()
    if row.last_used_at is None or now - row.last_used_at >= LAST_USED_RESOLUTION:
        OpsToken.objects.filter(pk=row.pk).update(last_used_at=Now())
    return Principal(name=row.name, scope=row.scope)
