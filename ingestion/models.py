"""What the ingestion side keeps. Reconciliation issues now; sources and artifacts follow."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


class IssueKind(models.TextChoices):
    QUARANTINED_SUBMISSION = "quarantined_submission"
    ARTIFACT_GONE = "artifact_gone"
    MISSING_FROM_DISCOVERY = "missing_from_discovery"
    CHANGED_WITHOUT_NOTICE = "changed_without_notice"
    PERMANENT_FETCH_FAILURE = "permanent_fetch_failure"


class IssueStatus(models.TextChoices):
    OPEN = "open"
    RESOLVED = "resolved"


class ReconciliationIssue(models.Model):
    """Something that does not add up, kept until an operator resolves it."""

    kind = models.CharField(max_length=50, choices=IssueKind.choices)
    source = models.CharField(max_length=200, blank=True, default="")
    subject = models.TextField(help_text="the URL for artifact issues, the file for submissions")
    details = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=10, choices=IssueStatus.choices, default="open")
    created_at = models.DateTimeField(db_default=Now())
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.CharField(max_length=200, blank=True, default="")
    comment = models.TextField(blank=True, default="")

    class Meta:
        indexes = [models.Index(fields=["status", "kind", "source"], name="issue_filter_idx")]

    def __str__(self) -> str:
        return f"{self.kind} issue {self.pk} ({self.status}): {self.subject}"
