"""The internal API's inputs (validated here) and outputs (described here for the schema).

Inputs: the query parameters of the list endpoints and the body of ``resolve``. Each is a
DRF serializer, so a bad value becomes a 400 that names the field.

Outputs are built by the same functions the commands use (``jobs.serialization``,
``jobs.status``, ``ingestion.reconciliation.issue_dict``); the serializers below only
describe those shapes for the OpenAPI schema, and ``tests/integration/test_api.py`` checks
that they name the same fields, so the schema cannot drift from what is served.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import ProhibitNullCharactersValidator, RegexValidator
from rest_framework import serializers

from ingestion.models import IssueKind, IssueStatus
from ingestion.search import DEFAULT_LIMIT, MAX_LIMIT, MAX_QUERY_CHARS
from jobs import timestamps
from jobs.models import Outcome, State

PAGE_SIZE_DEFAULT = 50
PAGE_SIZE_MAX = 200
PAGE_MAX = 1_000_000_000  # keeps the offset far inside a 64-bit integer


# --- input fields ------------------------------------------------------------------------


class StorableText(RegexValidator):
    """Text the database can store: no NUL characters (PostgreSQL refuses them) and no lone
    surrogates (not encodable as UTF-8). The schema shows the NUL rule as a ``pattern``."""

    regex = r"\A[^\x00]*\Z"
    message = "must not contain NUL characters"

    def __call__(self, value: Any) -> None:
        super().__call__(value)
        try:
            str(value).encode("utf-8")
        except UnicodeEncodeError:
            raise DjangoValidationError("must be valid Unicode text") from None


#: What ``str.strip()`` removes (every character for which ``isspace()`` is true), as the
#: inside of a regular expression's character class.
SPACE = r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


class NonBlankStorableText(StorableText):
    """``StorableText`` for a field that may not be blank once trimmed: its schema
    ``pattern`` also asks for one character that is not white space. It said only "no
    NUL", so clients generated from the schema sent "\u3000" and met a 400 (h26 #5).
    The server's own blank check runs first; this pattern never refuses what it takes."""

    regex = rf"\A[^\x00]*[^\x00{SPACE}][^\x00]*\Z"


class StrictCharField(serializers.CharField):
    """A string, and only a string: DRF's CharField would turn ``5`` into ``"5"``."""

    default_error_messages = {"invalid": "must be a string"}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # StorableText says what DRF's own NUL check says, and shows it in the schema.
        self.validators = [
            validator
            for validator in self.validators
            if not isinstance(validator, ProhibitNullCharactersValidator)
        ]
        self.validators.append(
            NonBlankStorableText()
            if not self.allow_blank and self.trim_whitespace
            else StorableText()
        )

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictIntegerField(serializers.IntegerField):
    """Decimal digits only: DRF's IntegerField would also take ``2.0`` and `` 2``. With
    ``text=False`` (a JSON body, where a number has a type of its own), not ``"2"`` either."""

    default_error_messages = {"invalid": "must be a whole number, e.g. 2"}

    def __init__(self, *, text: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.text = text

    def to_internal_value(self, data: Any) -> int:
        # A sign and any number of digits are a whole number: the bounds then say what is
        # wrong with -1 or 10**20 ("greater than or equal to 1"), not "a whole number".
        digits = self.text and isinstance(data, str) and re.fullmatch(r"-?[0-9]{1,100}", data)
        if isinstance(data, bool) or not (isinstance(data, int) or digits):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """``true`` or ``false``, and only those: DRF's BooleanField also takes ``"yes"``,
    ``1`` and ``"on"``."""

    default_error_messages = {"invalid": "must be true or false"}

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class AwareDateTimeField(serializers.DateTimeField):
    """An ISO 8601 timestamp that names its UTC offset (``Z`` or ``+02:00``)."""

    default_error_messages = {
        "invalid": "must be an ISO 8601 timestamp with a UTC offset, e.g. 2026-11-30T10:00:00Z",
        "naive": "must name its UTC offset, e.g. 2026-11-30T10:00:00Z or +02:00",
    }

    def to_internal_value(self, value: Any) -> datetime:
        try:
            return timestamps.parse(value)
        except timestamps.NaiveTime:
            self.fail("naive")
        except timestamps.InvalidTime:
            self.fail("invalid")


def choice_field(choices: list[str], help_text: str) -> serializers.ChoiceField:
    return serializers.ChoiceField(
        choices=choices,
        required=False,
        help_text=help_text,
        error_messages={"invalid_choice": f'"{{input}}" is not one of {", ".join(choices)}'},
    )


# --- query parameters --------------------------------------------------------------------


class PageQuery(serializers.Serializer):
    page = StrictIntegerField(
        required=False, min_value=1, max_value=PAGE_MAX, help_text="page number, from 1"
    )
    page_size = StrictIntegerField(
        required=False,
        min_value=1,
        max_value=PAGE_SIZE_MAX,
        help_text=f"items per page (default {PAGE_SIZE_DEFAULT}, at most {PAGE_SIZE_MAX})",
    )


class DeadJobsQuery(PageQuery):
    lane = StrictCharField(required=False, max_length=100, help_text="only jobs of this lane")
    kind = StrictCharField(
        required=False,
        max_length=200,
        help_text="only jobs of this kind, or of this Django task (its function path)",
    )
    since = AwareDateTimeField(
        required=False,
        help_text="only jobs that died at or after this time (ISO 8601 with a UTC offset)",
    )


class IssuesQuery(PageQuery):
    status = choice_field(IssueStatus.values, "open or resolved")
    kind = choice_field(IssueKind.values, "the kind of issue")
    # The metaclass takes declared fields off the class, so these names shadow nothing.
    source = StrictCharField(  # type: ignore[assignment]
        required=False, max_length=200, help_text="the source's name"
    )


class SearchQuery(serializers.Serializer):
    q = StrictCharField(
        max_length=MAX_QUERY_CHARS,
        help_text="words to find (required, not blank); any text is a valid query: on "
        'PostgreSQL "quoted phrases", or, and -word work as in a web search',
    )
    source = StrictCharField(  # type: ignore[assignment]  # see IssuesQuery
        required=False, max_length=200, help_text="only this source's artifacts (404 if unknown)"
    )
    limit = StrictIntegerField(
        required=False,
        min_value=1,
        max_value=MAX_LIMIT,
        help_text=f"at most this many hits (default {DEFAULT_LIMIT}, at most {MAX_LIMIT})",
    )


# --- request bodies ----------------------------------------------------------------------


class Body(serializers.Serializer):
    """A request body: a field the endpoint does not take is bad input, as an unknown query
    parameter is. A typo (``dryrun`` for ``dry_run``) must not be ignored and the action
    done as if it had not been asked."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping):
            why = f"unknown field for this endpoint (it takes {', '.join(self.fields)})"
            unknown = {name: [why] for name in data if name not in self.fields}
            if unknown:
                raise serializers.ValidationError(unknown)
        return super().to_internal_value(data)


class Resolve(Body):
    """The body of ``POST reconciliation-issues/{id}/resolve/``."""

    comment = StrictCharField(
        max_length=10_000,
        help_text="why the issue is resolved (required, not blank; at most 10,000 characters)",
    )


REQUEUE_BATCH = 1000  # dead jobs one request requeues by default: well inside a timeout
MAX_REQUEUE_BATCH = 5000


class RequeueDead(Body):
    """The body of ``POST dead-jobs/requeue/``: which dead jobs (``requeue_dead``'s choice)."""

    ids = serializers.ListField(
        child=StrictIntegerField(text=False, min_value=1, max_value=2**63 - 1),
        required=False,
        max_length=10_000,
        help_text="these jobs (one that is not dead is reported as a conflict)",
    )
    kind = StrictCharField(
        required=False, max_length=200, help_text="a job kind, or a Django task's function path"
    )
    lane = StrictCharField(required=False, max_length=100)
    all = StrictBooleanField(
        required=False, default=False, help_text="every dead job (a body naming none: no job)"
    )
    dry_run = StrictBooleanField(required=False, default=False)
    limit = StrictIntegerField(
        text=False,
        required=False,
        default=REQUEUE_BATCH,
        min_value=1,
        max_value=MAX_REQUEUE_BATCH,
        help_text="with `kind`, `lane` or `all`: at most this many of the chosen jobs, oldest "
        "first (one request stays short); the answer's `more` says whether others are left",
    )
    after = StrictIntegerField(
        text=False,
        required=False,
        min_value=0,
        max_value=2**63 - 1,
        help_text="with `kind`, `lane` or `all`: only jobs with a higher id (the previous "
        "answer's `last_id`, to go on where it stopped)",
    )


# --- responses (schema only) -------------------------------------------------------------


class ErrorResponse(serializers.Serializer):
    error = serializers.CharField(help_text="what went wrong, in one line")
    code = serializers.CharField(
        help_text="machine-readable reason, e.g. not_authenticated, invalid, conflict"
    )
    fields = serializers.DictField(  # type: ignore[assignment]  # a field, see IssuesQuery
        child=serializers.ListField(child=serializers.CharField()),
        required=False,
        help_text="bad input only: each offending field (or 'body') and what is wrong with it",
    )


class JobResponse(serializers.Serializer):
    id = serializers.IntegerField()
    kind = serializers.CharField()
    task = serializers.CharField(
        allow_null=True, help_text="a Django task's function path (kind django.task), else null"
    )
    lane = serializers.CharField()
    state = serializers.ChoiceField(choices=State.values)
    args = serializers.JSONField()
    priority = serializers.IntegerField()
    attempts = serializers.IntegerField()
    max_attempts = serializers.IntegerField()
    lease_token = serializers.IntegerField()
    leased_by = serializers.CharField(allow_null=True)
    lease_expires_at = serializers.DateTimeField(allow_null=True)
    run_at = serializers.DateTimeField()
    unique_key = serializers.CharField(allow_null=True)
    declared_locks = serializers.ListField(
        child=serializers.CharField(), help_text="resources the job must hold to run, sorted"
    )
    cancel_requested = serializers.BooleanField()
    progress = serializers.JSONField(allow_null=True)
    result = serializers.JSONField(allow_null=True)
    created_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    last_error = serializers.CharField(allow_null=True)


class RequeueConflict(serializers.Serializer):
    id = serializers.IntegerField()
    reason = serializers.CharField(help_text="why this job was not requeued")


class RequeueResponse(serializers.Serializer):
    requeued = serializers.ListField(child=serializers.IntegerField())
    dry_run = serializers.BooleanField()
    conflicts = serializers.ListField(child=RequeueConflict())
    more = serializers.BooleanField(
        help_text="a filter chose more dead jobs than `limit`: ask again with `after`"
    )
    last_id = serializers.IntegerField(
        allow_null=True, help_text="the highest id this request looked at (for `after`)"
    )


class RequeueRefusedResponse(RequeueResponse):
    error = serializers.CharField()
    code = serializers.CharField(help_text="conflict")


class LeaseResponse(serializers.Serializer):
    attempt = serializers.IntegerField()
    lease_token = serializers.IntegerField()
    worker_id = serializers.CharField()
    acquired_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()
    released_at = serializers.DateTimeField(allow_null=True)
    outcome = serializers.ChoiceField(choices=Outcome.values)
    error_class = serializers.CharField(allow_null=True)
    error_message = serializers.CharField(allow_null=True)
    traceback = serializers.CharField(allow_null=True)
    context = serializers.DictField(  # type: ignore[assignment]  # a field, see IssuesQuery
        help_text="the log context bound during the attempt"
    )


class EventResponse(serializers.Serializer):
    at = serializers.DateTimeField()
    event = serializers.CharField(help_text="claimed, settled, progress, reclaimed, …")
    lease_token = serializers.IntegerField(allow_null=True)
    worker_id = serializers.CharField(allow_null=True)
    data = serializers.DictField()  # type: ignore[assignment]  # a field, see IssuesQuery


class JobDetailResponse(JobResponse):
    leases = LeaseResponse(many=True, help_text="every attempt, oldest first")
    locks = serializers.ListField(
        child=serializers.CharField(), help_text="resource locks the job holds now"
    )
    waiting_for = serializers.CharField(
        allow_null=True,
        help_text="a queued job a claim found blocked: the held resource lock it waits for "
        "(PostgreSQL; null otherwise)",
    )
    events = EventResponse(many=True, help_text="the job's event log, oldest first")


class PageResponse(serializers.Serializer):
    count = serializers.IntegerField(help_text="how many items match, on all pages")
    page = serializers.IntegerField()
    page_size = serializers.IntegerField()
    next = serializers.URLField(allow_null=True, help_text="the next page, or null")
    previous = serializers.URLField(allow_null=True, help_text="the previous page, or null")


class DeadJobsResponse(PageResponse):
    jobs = JobResponse(many=True)


class IssueResponse(serializers.Serializer):
    id = serializers.IntegerField()
    kind = serializers.ChoiceField(choices=IssueKind.values)
    source = serializers.CharField(allow_null=True)  # type: ignore[assignment]  # see IssuesQuery
    subject = serializers.CharField()
    details = serializers.DictField()
    status = serializers.ChoiceField(choices=IssueStatus.values)
    created_at = serializers.DateTimeField()
    resolved_at = serializers.DateTimeField(allow_null=True)
    resolved_by = serializers.CharField(allow_null=True)
    comment = serializers.CharField(allow_null=True)


class IssuesResponse(PageResponse):
    issues = IssueResponse(many=True)


class SearchHit(serializers.Serializer):
    url = serializers.URLField()
    source = serializers.CharField()  # type: ignore[assignment]  # see IssuesQuery
    title = serializers.CharField(allow_blank=True, help_text="the document's title, or empty")
    snippet = serializers.CharField(
        allow_blank=True, help_text="plain text around the matches, each marked [like this]"
    )
    rank = serializers.FloatField(
        help_text="higher is better; comparable within one answer, not across databases"
    )
    fetched_at = serializers.DateTimeField(allow_null=True)
    artifact_id = serializers.IntegerField()


class SearchResponse(serializers.Serializer):
    count = serializers.IntegerField(help_text="how many hits follow (at most limit)")
    hits = SearchHit(many=True, help_text="best match first")


class LaneFigures(serializers.Serializer):
    queued = serializers.IntegerField()
    running = serializers.IntegerField()
    succeeded = serializers.IntegerField()
    dead = serializers.IntegerField()
    cancelled = serializers.IntegerField()
    oldest_queued_age_s = serializers.FloatField(
        allow_null=True, help_text="age of the oldest runnable queued job, in seconds"
    )


class LiveLease(serializers.Serializer):
    job_id = serializers.IntegerField()
    kind = serializers.CharField()
    lane = serializers.CharField()
    worker_id = serializers.CharField(allow_null=True)
    lease_token = serializers.IntegerField()
    expires_at = serializers.DateTimeField(allow_null=True)
    expired = serializers.BooleanField()


class WorkerFigures(serializers.Serializer):
    id = serializers.CharField()
    host = serializers.CharField()
    pid = serializers.IntegerField()
    lanes = serializers.ListField(
        child=serializers.CharField(), allow_null=True, help_text="the lanes it serves; null: all"
    )
    kinds = serializers.ListField(
        child=serializers.CharField(),
        allow_null=True,
        help_text="the job kinds it has handlers for (all it claims); null: not recorded",
    )
    current_job = serializers.IntegerField(allow_null=True)
    heartbeat_at = serializers.DateTimeField()
    status = serializers.ChoiceField(
        choices=["live", "gone"],
        help_text="gone: no heartbeat for stale_after (the lease, at least 30 s); the row is "
        "pruned after HOLDFAST_WORKER_RETENTION_SECONDS",
    )
    stale = serializers.BooleanField(help_text="status is not live (the older field)")


class UnservedKind(serializers.Serializer):
    kind = serializers.CharField()
    lane = serializers.CharField()
    queued = serializers.IntegerField()
    oldest_enqueued_at = serializers.DateTimeField()
    reason = serializers.CharField(
        help_text="what is missing: a live worker, a handler for the kind, or one serving the lane"
    )


class SpoolBacklog(serializers.Serializer):
    pending = serializers.IntegerField(
        allow_null=True, help_text="submissions waiting in incoming/; null if unreadable"
    )
    oldest_file = serializers.CharField(allow_null=True, help_text="null if none waits")
    oldest_age_s = serializers.FloatField(allow_null=True, help_text="null if none waits")
    grace_s = serializers.FloatField(help_text="HOLDFAST_SPOOL_GRACE_SECONDS; 0: check off")
    stale = serializers.BooleanField(
        allow_null=True, help_text="the oldest file is past the grace period (ingester stops)"
    )
    error = serializers.CharField(required=False, help_text="why the spool could not be read")


class QueueResponse(serializers.Serializer):
    now = serializers.DateTimeField(help_text="the database clock")
    totals = serializers.DictField(child=serializers.IntegerField(), help_text="jobs per state")
    dead = serializers.IntegerField()
    lanes = serializers.DictField(child=LaneFigures(), help_text="figures per lane")
    live_leases = LiveLease(many=True)
    workers = WorkerFigures(many=True)
    schedules_overdue = serializers.ListField(child=serializers.JSONField())
    delayed = serializers.IntegerField(help_text="queued jobs whose run_at is in the future")
    locks_held = serializers.IntegerField(help_text="resource locks held by running jobs")
    unserved_kinds = UnservedKind(
        many=True,
        help_text="kinds with queued jobs that no live worker serves (they wait, uncharged)",
    )
    spool = SpoolBacklog(help_text="the spool's backlog (docs/ingestion.md)")


class HealthWorkers(serializers.Serializer):
    live = serializers.IntegerField()
    gone = serializers.IntegerField(help_text="workers whose heartbeat stopped (not pruned yet)")
    stale = serializers.IntegerField(help_text="= gone (the older field)")
    stale_after_s = serializers.FloatField()


class HealthSpool(serializers.Serializer):
    pending = serializers.IntegerField(
        allow_null=True, help_text="*.json files waiting in incoming/; null if unreadable"
    )
    oldest_age_s = serializers.FloatField(
        allow_null=True, help_text="age of the oldest waiting file, in seconds; null if none"
    )
    error = serializers.CharField(required=False, help_text="why the spool could not be read")
    stale = serializers.BooleanField(
        required=False, help_text="only when true: the oldest file is past the grace period"
    )
    grace_s = serializers.FloatField(required=False, help_text="with stale: the grace period")


class HealthReason(serializers.Serializer):
    code = serializers.ChoiceField(
        choices=["no_live_worker", "spool_overdue", "ingester_stuck", "spool_unreadable"]
    )
    detail = serializers.CharField(help_text="one line for the operator")


class HealthResponse(serializers.Serializer):
    status = serializers.ChoiceField(choices=["ok", "failing", "down"])
    reasons = HealthReason(many=True, required=False, help_text="with a token only")
    database = serializers.ChoiceField(
        choices=["ok"], required=False, help_text="with a token only"
    )
    workers = HealthWorkers(required=False, help_text="with a token only")
    spool = HealthSpool(required=False, help_text="with a token only")
