"""What the ingestion side keeps: reconciliation issues, spool acks, sources and artifacts."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


class IssueKind(models.TextChoices):
    QUARANTINED_SUBMISSION = "quarantined_submission"
    GONE_AT_SOURCE = "gone_at_source"
    MISSING_FROM_SOURCE = "missing_from_source"
    CONTENT_CHANGED_UNANNOUNCED = "content_changed_unannounced"
    PERMANENT_FETCH_FAILURE = "permanent_fetch_failure"
    FETCH_FAILING = "fetch_failing"  # transient errors outlasted a fetch's retries
    LISTING_FAILED = "listing_failed"  # a listing page could not be read (fully)


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
        indexes = [
            models.Index(fields=["status", "kind", "source"], name="issue_filter_idx"),
            # Retention's oldest resolved issues first (reconciliation.prune_resolved).
            models.Index(
                fields=["resolved_at"],
                condition=models.Q(status="resolved"),
                name="issue_resolved_idx",
            ),
        ]
        constraints = [
            # One open issue per condition (``record_unless_open``), also when two
            # processes record it at once. Not for quarantined submissions: the same file
            # name quarantined again (new bytes, or put back) is a new issue by design.
            models.UniqueConstraint(
                fields=["kind", "source", "subject"],
                condition=models.Q(status="open") & ~models.Q(kind="quarantined_submission"),
                name="issue_open_once",
            )
        ]

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
        indexes = [
            # gc_blobs's look-up of the excerpts in use (ingestion.blob_references); most
            # submissions have none, and the spool's inserts of those skip the index.
            models.Index(
                fields=["log_excerpt"],
                condition=~models.Q(log_excerpt=""),
                name="submission_excerpt_idx",
            )
        ]

    def __str__(self) -> str:
        return f"submission {self.hash[:12]} ({self.file_name})"


class SourceKind(models.TextChoices):
    SITEMAP = "sitemap"
    FEED = "feed"


class Source(models.Model):
    """A named place to discover documents (DESIGN §11).

    ``next_request_at`` is the politeness ledger: every request to the source first locks
    this row, waits until that time (database clock) and moves it ``spacing_seconds`` on,
    so the spacing holds across all workers and hosts, not per process.
    """

    name = models.SlugField(max_length=100, unique=True)
    kind = models.CharField(max_length=10, choices=SourceKind.choices)
    url = models.URLField(max_length=2000)
    schedule = models.CharField(max_length=200, help_text="cron for discovery (UTC)")
    spacing_seconds = models.FloatField(default=1.0)
    max_pages_per_run = models.PositiveIntegerField(default=10)
    refresh_days = models.PositiveIntegerField(default=28)
    enabled = models.BooleanField(default=True)
    allow_private = models.BooleanField(
        default=False,
        help_text="may reach loopback, private and link-local addresses (add_source flag)",
    )
    next_request_at = models.DateTimeField(null=True, blank=True)
    robots_txt = models.TextField(blank=True, default="")
    robots_fetched_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    disabled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "sources"

    def __str__(self) -> str:
        return f"{self.name} ({self.kind} {self.url})"


class RunState(models.TextChoices):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"


class DiscoveryRun(models.Model):
    """One discovery of a source, possibly spanning several bounded jobs.

    Its listing pages are :class:`DiscoveryPage` rows: the pending ones are the cursor (a
    sitemap index's children, a feed's ``next`` link), the read ones the visited set. A
    page's row changes in the same transaction as the items it lists, so a continuation
    resumes exactly where the last committed page left off, and reading a page writes one
    row, not the whole cursor (an index of 50,000 sitemaps stays linear).
    """

    source = models.ForeignKey(Source, on_delete=models.CASCADE, related_name="runs")
    state = models.CharField(max_length=10, choices=RunState.choices, default=RunState.RUNNING)
    pages = models.PositiveIntegerField(default=0, help_text="listing pages read")
    known_pages = models.PositiveIntegerField(default=0, help_text="page rows of this run")
    failed_pages = models.PositiveIntegerField(
        default=0, help_text="listing pages given up on: the run cannot tell what is missing"
    )
    exhaustive = models.BooleanField(
        default=False, help_text="feeds: a complete feed or a full archive was read"
    )
    items = models.PositiveIntegerField(default=0)
    jobs = models.PositiveIntegerField(default=0, help_text="bounded jobs this run took")
    started_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True, default="")

    class Meta:
        db_table = "discovery_runs"
        constraints = [
            models.UniqueConstraint(
                fields=["source"],
                condition=models.Q(state="running"),
                name="one_running_discovery_per_source",
            )
        ]

    def __str__(self) -> str:
        return f"discovery run {self.pk} of {self.source_id} ({self.state})"


class PageState(models.TextChoices):
    PENDING = "pending"
    READ = "read"
    FAILED = "failed"  # given up on (a defect of the page, or transient errors outlasting tries)


class DiscoveryPage(models.Model):
    """One listing page of a run: pending (the cursor, in ``id`` order), read, or failed."""

    run = models.ForeignKey(DiscoveryRun, on_delete=models.CASCADE, related_name="page_rows")
    url = models.TextField()
    state = models.CharField(max_length=10, choices=PageState.choices, default=PageState.PENDING)
    tries = models.PositiveSmallIntegerField(default=0, help_text="transient failures so far")
    starts = models.PositiveIntegerField(
        default=0, db_default=0, help_text="times a job began reading it (committed first)"
    )
    error = models.TextField(blank=True, default="")

    class Meta:
        db_table = "discovery_pages"
        constraints = [
            models.UniqueConstraint(fields=["run", "url"], name="discovery_page_identity")
        ]
        indexes = [models.Index(fields=["run", "state", "id"], name="discovery_page_cursor_idx")]

    def __str__(self) -> str:
        return f"page {self.url} of run {self.run_id} ({self.state})"


class ArtifactState(models.TextChoices):
    DISCOVERED = "discovered"  # known from the source, never fetched
    FETCHED = "fetched"
    GONE = "gone"  # 404/410 at the source
    FAILED = "failed"  # permanent fetch failure (other 4xx, oversized, refused)


class Artifact(models.Model):
    """One discovered document: where it is, what was fetched, when to refresh it."""

    source = models.ForeignKey(Source, on_delete=models.CASCADE, related_name="artifacts")
    url = models.URLField(max_length=2000)
    state = models.CharField(
        max_length=12, choices=ArtifactState.choices, default=ArtifactState.DISCOVERED
    )
    lastmod = models.CharField(max_length=64, blank=True, default="", help_text="as listed")
    title = models.TextField(blank=True, default="")
    discovered_at = models.DateTimeField(db_default=Now())
    last_seen_run = models.ForeignKey(
        DiscoveryRun, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    last_seen_at = models.DateTimeField(null=True, blank=True)
    # What the last fetch got.
    sha256 = models.CharField(max_length=64, blank=True, default="")
    size = models.PositiveBigIntegerField(null=True, blank=True)
    content_type = models.CharField(max_length=200, blank=True, default="")
    http_status = models.PositiveSmallIntegerField(null=True, blank=True)
    etag = models.CharField(max_length=500, blank=True, default="")
    last_modified = models.CharField(max_length=100, blank=True, default="")
    fetched_lastmod = models.CharField(
        max_length=64, blank=True, default="", help_text="the listed lastmod when last fetched"
    )
    fetched_at = models.DateTimeField(null=True, blank=True)
    refresh_after = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    failures = models.PositiveIntegerField(
        default=0, help_text="fetches in a row whose transient errors outlasted their retries"
    )
    indexed_sha256 = models.CharField(max_length=64, blank=True, default="")

    class Meta:
        db_table = "artifacts"
        constraints = [models.UniqueConstraint(fields=["source", "url"], name="artifact_identity")]
        indexes = [
            models.Index(
                fields=["refresh_after"],
                condition=models.Q(refresh_after__isnull=False),
                name="artifact_refresh_due_idx",
            ),
            models.Index(fields=["source", "state"], name="artifact_source_state_idx"),
            models.Index(fields=["sha256"], name="artifact_sha256_idx"),  # gc_blobs
        ]

    def __str__(self) -> str:
        return f"artifact {self.pk} ({self.url})"


class ArtifactText(models.Model):
    """The searchable text of a fetched artifact, one row per artifact (DESIGN §11).

    The vendor full-text index follows this table (``ingestion/search_sql.py``): on
    PostgreSQL a ``document tsvector`` column, written at index time with the configured
    text-search configuration, under a GIN index; on SQLite the FTS5 table
    ``artifact_search``, kept in step by triggers. Neither is a model field, so both are
    created by migration ``0005_search``.
    """

    artifact = models.OneToOneField(
        Artifact, on_delete=models.CASCADE, primary_key=True, related_name="search_text"
    )
    title = models.TextField(blank=True, default="")
    text = models.TextField(blank=True, default="")
    sha256 = models.CharField(max_length=64, help_text="the body this text was extracted from")
    indexed_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "artifact_texts"
        indexes = [models.Index(fields=["sha256"], name="artifact_text_sha256_idx")]  # gc_blobs

    def __str__(self) -> str:
        return f"text of artifact {self.artifact_id} ({self.sha256[:12]})"
