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
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Now
from django.utils import timezone

from jobs import sql
from jobs.exceptions import HoldfastError, InvalidJob
from jobs.log import get_logger
from jobs.serialization import timestamp

from .models import AuthRefusal, OpsToken, Scope

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


def create(name: str, scope: str, expires_in: timedelta | None = None) -> tuple[OpsToken, str]:
    """Issue a token; returns the row and the plain token, which is never shown again.

    With ``expires_in`` the token is refused (like a revoked one) once that time passed.
    """
    if expires_in is not None and expires_in <= timedelta(0):
        raise InvalidJob("--expires-in must be a positive duration")
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
                name=name,
                scope=scope,
                prefix=prefix,
                salt=salt,
                digest=_digest(salt, token),
                expires_at=None if expires_in is None else timezone.now() + expires_in,
            )
    except IntegrityError:
        raise InvalidJob(f"a live token named {name!r} exists; revoke it first") from None
    log.info(
        "ops_token_created",
        name=name,
        scope=scope,
        prefix=prefix,
        expires_at=row.expires_at.isoformat() if row.expires_at else None,
    )
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


@dataclass(frozen=True)
class Verdict:
    """What checking a token found: the caller, or why it was refused."""

    principal: Principal | None
    reason: str = ""  # malformed | unknown | revoked | expired | wrong secret
    prefix: str | None = None  # as parsed from a well-formed token; never the secret


def check(token: str) -> Verdict:
    """Check ``token``: its caller, or the reason it is refused (for the log, not the
    client: the client only learns that it was refused)."""
    match = TOKEN_PATTERN.fullmatch(token)
    if match is None:
        return Verdict(None, "malformed")
    prefix = match[1]
    row = OpsToken.objects.filter(prefix=prefix).first()
    if row is None:
        return Verdict(None, "unknown", prefix)
    if not hmac.compare_digest(row.digest, _digest(row.salt, token)):
        return Verdict(None, "wrong secret", prefix)
    if row.revoked_at is not None:
        return Verdict(None, "revoked", prefix)
    now = timezone.now()
    if row.expires_at is not None and row.expires_at <= now:
        return Verdict(None, "expired", prefix)
    if row.last_used_at is None or now - row.last_used_at >= LAST_USED_RESOLUTION:
        _touch(row.pk)
    return Verdict(Principal(name=row.name, scope=row.scope), prefix=prefix)


LAST_USED_LOCK_WAIT = 0.5  # seconds: a busy database costs a request no more for it


def _bookkeeping(write: Callable[[], object], event: str, **fields: Any) -> None:
    """Run ``write``, bookkeeping rather than the request's work: it waits at most
    ``LAST_USED_LOCK_WAIT`` for a lock (a held write lock on SQLite, a row lock), and any
    database error (busy, down, a table not migrated yet during an upgrade), from taking
    the lock to the commit, skips it, logged as ``event``. The request it rides on is
    answered all the same: a cancel must answer within seconds, and a refused token is a
    401, never a 500."""
    try:
        with sql.lock_waits_bounded(LAST_USED_LOCK_WAIT):
            write()
    except DatabaseError as exc:
        log.info(event, **fields, error=" ".join(str(exc).split()))


def _touch(pk: int) -> None:
    """Record the token's use (the next request records it if this one cannot)."""
    _bookkeeping(
        lambda: OpsToken.objects.filter(pk=pk).update(last_used_at=Now()),
        "token_last_used_not_recorded",
        token_pk=pk,
    )


def count_refusal(reason: str) -> None:
    """Add one to the refused requests' counter of ``reason`` (the refusal is logged
    whether or not it is counted)."""
    counter = AuthRefusal.objects.filter(reason=reason)

    def add_one() -> None:
        if counter.update(count=F("count") + 1):
            return
        try:
            with transaction.atomic():  # a savepoint: another process may insert first
                AuthRefusal.objects.create(reason=reason, count=1)
        except IntegrityError:
            counter.update(count=F("count") + 1)

    _bookkeeping(add_one, "auth_refusal_not_counted", reason=reason)


def authenticate(token: str) -> Principal | None:
    """The caller behind ``token``, or None for a malformed, unknown, revoked or expired
    token."""
    return check(token).principal


def status(row: OpsToken, now: datetime | None = None) -> str:
    """``live``, ``expired`` or ``revoked``."""
    if row.revoked_at is not None:
        return "revoked"
    if row.expires_at is not None and row.expires_at <= (now or timezone.now()):
        return "expired"
    return "live"


def listing() -> list[dict[str, Any]]:
    """Every token, newest first, as ``list_ops_tokens --json`` shows it: never a secret."""
    now = timezone.now()
    return [
        {
            "name": row.name,
            "scope": row.scope,
            "prefix": row.prefix,
            "status": status(row, now),
            "created_at": timestamp(row.created_at),
            "last_used_at": timestamp(row.last_used_at),
            "expires_at": timestamp(row.expires_at),
            "revoked_at": timestamp(row.revoked_at),
        }
        for row in OpsToken.objects.order_by("-created_at", "-pk")
    ]
