"""Reconciliation issues: recording what does not add up, listing and resolving it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.db.models.functions import Now

from jobs.exceptions import HoldfastError, InvalidJob, StateConflict
from jobs.log import get_logger
from jobs.retention import kept_for, pruner
from jobs.serialization import timestamp

from .models import IssueKind, IssueStatus, ReconciliationIssue, Source

log = get_logger("ingestion.reconciliation")


class IssueNotFound(HoldfastError, LookupError):
    """No reconciliation issue has this id."""


def record(
    kind: str,
    subject: str,
    source: str = "",
    details: dict[str, Any] | None = None,
    using: str = "default",
) -> ReconciliationIssue:
    """Open an issue (inside the caller's transaction, like the event it describes).

    ``using`` names the connection of that transaction (the spool ingester has its own).
    """
    if kind not in IssueKind.values:
        raise InvalidJob(f"unknown reconciliation issue kind {kind!r}")
    issue = ReconciliationIssue.objects.using(using).create(
        kind=kind, subject=subject, source=source, details=details or {}
    )
    log.warning(
        "reconciliation_issue_opened", issue_id=issue.pk, kind=kind, source=source, subject=subject
    )
    return issue


AUTO_RESOLVER = "holdfast"


def record_unless_open(
    kind: str, subject: str, source: str = "", details: dict[str, Any] | None = None
) -> ReconciliationIssue | None:
    """Open an issue unless one of this kind is already open for this subject.

    A condition that persists (an item missing from every daily run, a page that stays
    404) is one issue, not one a day. Returns the new issue, or None when one was open.
    Two processes recording it at once open one: the partial unique index
    ``issue_open_once`` refuses the second insert (in a savepoint, so the caller's
    transaction goes on).
    """
    already = ReconciliationIssue.objects.filter(
        kind=kind, source=source, subject=subject, status=IssueStatus.OPEN
    )
    if already.exists():
        return None
    try:
        with transaction.atomic():
            return record(kind, subject, source, details)
    except IntegrityError:
        return None


def resolve_cleared(
    kind: str, source: str, subjects: Iterable[str] | QuerySet[Any], condition: str
) -> list[int]:
    """Resolve the open issues of ``kind`` about ``subjects``: their condition cleared.

    Inside the caller's transaction, like the event that cleared it. The issue records
    that Holdfast resolved it (``resolved_by="holdfast"``) and, as its comment, which
    condition cleared, so an operator can tell these from their own resolutions.
    ``subjects`` may be a list or a queryset of values (used as a subquery).
    """
    found = ReconciliationIssue.objects.filter(
        kind=kind, source=source, status=IssueStatus.OPEN, subject__in=subjects
    )
    ids = list(found.values_list("pk", flat=True))
    if ids:
        ReconciliationIssue.objects.filter(pk__in=ids, status=IssueStatus.OPEN).update(
            status=IssueStatus.RESOLVED,
            resolved_at=Now(),
            resolved_by=AUTO_RESOLVER,
            comment=condition,
        )
    for issue_id in ids:
        log.info(
            "reconciliation_issue_resolved",
            issue_id=issue_id,
            kind=kind,
            source=source,
            by=AUTO_RESOLVER,
            condition=condition,
        )
    return ids


def issues(
    status: str | None = None, kind: str | None = None, source: str | None = None
) -> QuerySet[ReconciliationIssue]:
    """Issues matching the filters, newest first. Unknown filter values are bad input.

    A source is known if a source row has that name or an issue names it: issues may
    outlive a source's row, and ``record`` accepts any name. Only a name that matches
    neither is a typo to refuse (filtering on it could only ever answer nothing).
    """
    if status is not None and status not in IssueStatus.values:
        raise InvalidJob(f"status must be one of {', '.join(IssueStatus.values)}, not {status!r}")
    if kind is not None and kind not in IssueKind.values:
        raise InvalidJob(f"kind must be one of {', '.join(IssueKind.values)}, not {kind!r}")
    found = ReconciliationIssue.objects.order_by("-created_at", "-pk")
    if status:
        found = found.filter(status=status)
    if kind:
        found = found.filter(kind=kind)
    if source:
        known = Source.objects.filter(name=source).exists()
        if not known and not ReconciliationIssue.objects.filter(source=source).exists():
            raise InvalidJob(f"no source named {source!r}")
        found = found.filter(source=source)
    return found


def resolve(issue_id: int, by: str, comment: str = "") -> ReconciliationIssue:
    """Mark an open issue resolved, saying who and why; resolving twice is a conflict."""
    with transaction.atomic():
        matched = ReconciliationIssue.objects.filter(pk=issue_id, status=IssueStatus.OPEN).update(
            status=IssueStatus.RESOLVED, resolved_at=Now(), resolved_by=by, comment=comment
        )
        try:
            issue = ReconciliationIssue.objects.get(pk=issue_id)
        except ReconciliationIssue.DoesNotExist:
            raise IssueNotFound(f"no reconciliation issue with id {issue_id}") from None
        if not matched:
            raise StateConflict(
                f"issue {issue_id} was already resolved by {issue.resolved_by or 'someone'}"
            )
    log.info("reconciliation_issue_resolved", issue_id=issue_id, kind=issue.kind, by=by)
    return issue


def issue_dict(issue: ReconciliationIssue) -> dict[str, Any]:
    return {
        "id": issue.pk,
        "kind": issue.kind,
        "source": issue.source or None,
        "subject": issue.subject,
        "details": issue.details,
        "status": issue.status,
        "created_at": timestamp(issue.created_at),
        "resolved_at": timestamp(issue.resolved_at),
        "resolved_by": issue.resolved_by or None,
        "comment": issue.comment or None,
    }


@pruner("resolved_issues", setting="HOLDFAST_RETAIN_RESOLVED_ISSUES")
def prune_resolved(batch: int) -> int:
    """One batch of the issues resolved longer ago than ``HOLDFAST_RETAIN_RESOLVED_ISSUES``
    (``None``: kept forever), oldest first, through ``issue_resolved_idx``; open issues are
    never touched. Run by every scheduler's retention pass (``jobs.retention``): resolved
    issues piled up for ever, and every metrics scrape counted them all."""
    kept = kept_for("HOLDFAST_RETAIN_RESOLVED_ISSUES")
    if kept is None:
        return 0
    with transaction.atomic():
        ids = list(
            ReconciliationIssue.objects.filter(
                status=IssueStatus.RESOLVED, resolved_at__lt=Now() - kept
            )
            .select_for_update(skip_locked=True)
            .order_by("resolved_at")
            .values_list("pk", flat=True)[:batch]
        )
        if not ids:
            return 0
        deleted, _ = ReconciliationIssue.objects.filter(
            pk__in=ids, status=IssueStatus.RESOLVED
        ).delete()
    return deleted
