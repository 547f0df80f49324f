"""API tokens: stored as salted hashes, looked up by a short public prefix."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now


class Scope(models.TextChoices):
    READ = "read"  # GET only
    WRITE = "write"  # GET and POST


class OpsToken(models.Model):
    name = models.CharField(max_length=100)
    scope = models.CharField(max_length=5, choices=Scope.choices)
    prefix = models.CharField(max_length=16, unique=True)
    salt = models.CharField(max_length=64)
    digest = models.CharField(max_length=64)
    created_at = models.DateTimeField(db_default=Now())
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)  # None: never

    class Meta:
        constraints = [
            # A name belongs to one live token; a revoked name may be issued again.
            models.UniqueConstraint(
                fields=["name"], condition=Q(revoked_at__isnull=True), name="ops_token_live_name"
            )
        ]

    def __str__(self) -> str:
        return f"token {self.name} ({self.scope}{', revoked' if self.revoked_at else ''})"


class AuthRefusal(models.Model):
    """How many requests the API refused for their token, by reason (``malformed``,
    ``unknown``, ``wrong secret``, ``revoked``, ``expired``, ``not a bearer token``, ``no
    token``): ``holdfast_api_auth_refusals_total``. In the database, as every counter of
    the metrics, so any API process reports the same figures and they outlive restarts."""

    reason = models.CharField(max_length=32, unique=True)
    count = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.count} refused: {self.reason}"
