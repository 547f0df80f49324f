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


class Lab(models.Model):
    """A producer of spool submissions, named in each submission's ``lab`` field."""

    name = models.CharField(max_length=200, unique=True)
    created_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "labs"

    def __str__(self) -> str:
        return self.name


class Fact(models.Model):
    """One fact a lab reported about an entity; the newest ``submitted_at`` wins."""

    lab = models.ForeignKey(Lab, on_delete=models.PROTECT, related_name="facts")
    entity = models.CharField(max_length=200)
    key = models.CharField(max_length=500)
    attributes = models.JSONField(default=dict)
    submitted_at = models.DateTimeField()

    class Meta:
        db_table = "facts"
        constraints = [
            models.UniqueConstraint(fields=["lab", "entity", "key"], name="fact_identity")
        ]

    def __str__(self) -> str:
        return f"{self.lab_id}:{self.entity}:{self.key}"


class IngestedSubmission(models.Model):
    """The ack row of an applied spool submission (DESIGN §10), keyed by its bytes' sha256.

    It commits in the same transaction as the submission's facts: a row here means the
    submission was applied, and only then may its file be deleted (I6).
    """

    hash = models.CharField(max_length=64, primary_key=True)
    file_name = models.TextField()
    lab = models.ForeignKey(Lab, on_delete=models.PROTECT, related_name="submissions")
    submitted_at = models.DateTimeField()
    applied_at = models.DateTimeField(db_default=Now())
    fact_count = models.PositiveIntegerField(default=0)
    log_excerpt = models.CharField(
        max_length=64, blank=True, default="", help_text="sha256 of the excerpt in the blob store"
    )

    class Meta:
        db_table = "ingested_submissions"

    def __str__(self) -> str:
        return f"submission {self.hash[:12]} ({self.file_name})"
