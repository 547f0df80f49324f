"""The spool: read submissions from ``incoming/``, apply them exactly once, quarantine poison.

The rules (invariant I6, issue 5, ``docs/ingestion.md``):

* A file is **applied** when its ack row (``ingested_submissions``, keyed by the sha256 of
  its raw bytes) commits in the same ``transaction.atomic()`` as its facts and its lab.
  Its file is deleted only after that commit, and only if it is still the same file
  (same device and inode) that was read.
* A file moves to ``failed/`` only for an error of the submission itself
  (:class:`~ingestion.submissions.InvalidSubmission`); its reconciliation issue commits
  in the batch's transaction, and the move follows the commit.
* A database error leaves every file in place and unacked; the writer keeps its batch and
  retries with backoff. A file that cannot be read (permissions, the blob store failing)
  stays too. Neither is ever quarantined.
* A file whose hash is already acked (a crash between commit and unlink, or the same
  bytes submitted again) is deleted without being applied again.

Readers (:func:`read_entry`) need no database; the :class:`Writer` owns the database
work. :func:`drain` runs both in one process (the job handler, ``--workers 1``);
:mod:`ingestion.ingester` runs readers in parallel processes feeding one writer process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    close_old_connections,
    connections,
    transaction,
)

from jobs.log import get_logger
from jobs.retry import RetryPolicy

from . import blobs
from .grants import ingester_database
from .models import IngestedSubmission, IssueKind, IssueStatus, Lab, ReconciliationIssue
from .reconciliation import record
from .sql import AckWrite, FactWrite, insert_acks, upsert_facts
from .submissions import InvalidSubmission, Limits, Submission, parse

log = get_logger("ingestion.spool")

#: Fault points of the writer (``db_error``, ``pause_in_flush``, ``exit_after_commit``) and
#: what to do there. Empty in production; the test app installs faults for the process
#: tests (tests/testapp/apps.py), so crash behaviour is tested on this exact code path.
FAULTS: dict[str, Callable[[], None]] = {}

#: A failed flush is retried after this backoff (the stuck timeout bounds the total wait).
FLUSH_RETRY = RetryPolicy(base=0.2, cap=10.0, jitter=0.25)
#: A file that could not be read (not the submission's fault) is retried after this.
READ_RETRY_SECONDS = 1.0

# Outcomes reported for each file.
APPLIED = "applied"
DUPLICATE = "duplicate"  # already acked: deleted without applying again
QUARANTINED = "quarantined"
TERMINAL = (APPLIED, DUPLICATE, QUARANTINED)
SKIPPED = "skipped"  # not finished after all (replaced, or the move failed): read it again


class Stuck(Exception):
    """Work is pending and nothing reached a terminal state for ``stuck_after`` seconds."""


class Overdue(Exception):
    """A file has waited in ``incoming/`` longer than the grace period: an operator must look."""


#: How long a file may wait in ``incoming/`` before the ingester alerts and stops.
DEFAULT_GRACE_SECONDS = 3600.0


def grace_seconds() -> float:
    """``HOLDFAST_SPOOL_GRACE_SECONDS`` (default 3600); 0 turns the grace check off."""
    return float(getattr(settings, "HOLDFAST_SPOOL_GRACE_SECONDS", DEFAULT_GRACE_SECONDS))


# --- the spool's directories ----------------------------------------------------------


@dataclass(frozen=True)
class Spool:
    root: Path

    @classmethod
    def from_settings(cls, root: str | Path | None = None) -> Spool:
        return cls(Path(root) if root else Path(settings.HOLDFAST_SPOOL_DIR))

    @property
    def incoming(self) -> Path:
        return self.root / "incoming"

    @property
    def failed(self) -> Path:
        return self.root / "failed"

    def ensure(self) -> None:
        self.incoming.mkdir(parents=True, exist_ok=True)
        self.failed.mkdir(parents=True, exist_ok=True)

    def pending(self) -> list[str]:
        """Names of submissions waiting in ``incoming/`` (``*.json``, no dot-files), oldest
        first. Anything else there (a producer's temporary file) is ignored."""
        found: list[tuple[int, str]] = []
        try:
            with os.scandir(self.incoming) as entries:
                for entry in entries:
                    name = entry.name
                    if not name.endswith(".json") or name.startswith("."):
                        continue
                    try:
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        found.append((entry.stat(follow_symlinks=False).st_mtime_ns, name))
                    except FileNotFoundError:
                        continue
        except FileNotFoundError:
            return []
        return [name for _, name in sorted(found)]

    def age(self, name: str) -> float | None:
        """Seconds since ``incoming/<name>`` was last modified (None if it is gone)."""
        try:
            mtime = (self.incoming / name).stat().st_mtime
        except FileNotFoundError:
            return None
        return max(0.0, time.time() - mtime)

    def backlog(self, grace: float | None = None) -> dict[str, Any]:
        """What waits in ``incoming/``: count, the oldest file and its age, and whether it
        is past the grace period (``queue_status``'s ``spool`` section)."""
        grace = grace_seconds() if grace is None else grace
        try:
            pending = self.pending()
        except OSError as exc:
            return {
                "pending": None,
                "oldest_file": None,
                "oldest_age_s": None,
                "grace_s": grace,
                "stale": None,
                "error": f"cannot read the spool: {exc}",
            }
        oldest = next(((n, a) for n in pending if (a := self.age(n)) is not None), None)
        age = round(oldest[1], 3) if oldest else None
        return {
            "pending": len(pending),
            "oldest_file": oldest[0] if oldest else None,
            "oldest_age_s": age,
            "grace_s": grace,
            "stale": bool(grace) and age is not None and age > grace,
        }

    def overdue(self, pending: list[str], grace: float) -> str | None:
        """The grace rule: the one-line reason when the oldest of ``pending`` (oldest first,
        as :meth:`pending` lists them) has waited longer than ``grace`` seconds; else None.
        A grace of 0 turns the check off."""
        if grace <= 0:
            return None
        for name in pending:
            age = self.age(name)
            if age is None:
                continue  # taken meanwhile: the next one is the oldest
            if age <= grace:
                return None
            log.error("spool_overdue", file=name, age_s=round(age, 1), grace_s=grace)
            return (
                f"overdue: incoming/{name} has waited {age:.0f} s, longer than the grace "
                f"period of {grace:g} s; it and every other file left in place (investigate, "
                "then run with a larger --grace, or --grace 0, to drain)"
            )
        return None


# --- reading (no database) ------------------------------------------------------------


@dataclass
class Entry:
    """One file as a reader found it: valid (``submission``) or not (``stage``/``error``)."""

    name: str
    hash: str
    identity: tuple[int, int]  # (st_dev, st_ino): unlink or move only the file we read
    submission: Submission | None = None
    stage: str = ""
    error: str = ""  # one line: the first error, and how many more
    errors: list[str] = field(default_factory=list)  # every error, up to a bound
    error_count: int = 0

    @property
    def reasons(self) -> dict[str, Any]:
        """Why the file is quarantined, for its ``.reason.json`` and its issue."""
        errors = self.errors or [self.error]
        return {"errors": errors, "error_count": max(self.error_count, len(errors))}

    @property
    def fact_count(self) -> int:
        return len(self.submission.facts) if self.submission else 0


def read_entry(spool: Spool, name: str, limits: Limits) -> Entry | None:
    """Read, hash, parse and validate ``incoming/<name>``; store its excerpt in the blob
    store. None if the file is gone. An ``OSError`` (unreadable file, blob store failing)
    propagates: it is not the submission's fault, so the caller retries later."""
    path = spool.incoming / name
    try:
        with path.open("rb") as handle:
            info = os.fstat(handle.fileno())
            identity = (info.st_dev, info.st_ino)
            if info.st_size > limits.max_file_bytes:
                digest = hashlib.file_digest(handle, "sha256").hexdigest()
                return Entry(
                    name,
                    digest,
                    identity,
                    stage="limits",
                    error=f"file is {info.st_size} bytes, more than the limit of "
                    f"{limits.max_file_bytes}",
                )
            raw = handle.read()
    except FileNotFoundError:
        return None
    digest = hashlib.sha256(raw).hexdigest()
    try:
        submission = parse(raw, limits, digest)
    except InvalidSubmission as exc:
        return Entry(
            name,
            digest,
            identity,
            stage=exc.stage,
            error=exc.message,
            errors=exc.errors,
            error_count=exc.count,
        )
    if submission.excerpt is not None:
        submission.excerpt_hash = blobs.store(submission.excerpt)
        submission.excerpt = None  # stored: no need to carry it to the writer
    return Entry(name, digest, identity, submission=submission)


# --- applying (the writer's database work) --------------------------------------------


@dataclass
class BatchResult:
    applied: set[str] = field(default_factory=set)  # hashes acked by this commit
    already: set[str] = field(default_factory=set)  # hashes acked before it
    issues: dict[str, int] = field(default_factory=dict)  # rejected file name -> issue id


def _fault(point: str) -> None:
    action = FAULTS.get(point)
    if action is not None:
        action()


def apply_batch(entries: list[Entry], using: str = DEFAULT_DB_ALIAS) -> BatchResult:
    """Apply a batch in ONE transaction on the database ``using``: labs, facts, ack rows and
    the reconciliation issues of rejected files. Raises ``DatabaseError`` with nothing
    committed."""
    result = BatchResult()
    with transaction.atomic(using=using):
        _fault("db_error")
        hashes = sorted({entry.hash for entry in entries})
        result.already = set(
            IngestedSubmission.objects.using(using)
            .filter(hash__in=hashes)
            .values_list("hash", flat=True)
        )
        fresh: dict[str, Entry] = {}
        rejected: list[Entry] = []
        for entry in entries:
            if entry.hash in result.already:
                continue
            if entry.submission is None:
                rejected.append(entry)
            else:
                fresh.setdefault(entry.hash, entry)
        submissions = [entry.submission for entry in fresh.values() if entry.submission]

        labs = sorted({submission.lab for submission in submissions})
        Lab.objects.using(using).bulk_create(
            [Lab(name=name) for name in labs], ignore_conflicts=True
        )
        lab_ids = dict(Lab.objects.using(using).filter(name__in=labs).values_list("name", "id"))

        # One row per (lab, entity, key): the newest submission's fact (a later file wins
        # a tie, as it would in separate batches).
        newest: dict[tuple[int, str, str], FactWrite] = {}
        for submission in submissions:
            lab_id = lab_ids[submission.lab]
            for fact in submission.facts:
                identity = (lab_id, fact.entity, fact.key)
                known = newest.get(identity)
                if known is None or submission.submitted_at >= known.submitted_at:
                    newest[identity] = FactWrite(
                        lab_id, fact.entity, fact.key, fact.attributes, submission.submitted_at
                    )
        upsert_facts(list(newest.values()), using)
        insert_acks(
            [
                AckWrite(
                    hash=entry.hash,
                    file_name=entry.name,
                    lab_id=lab_ids[entry.submission.lab],
                    submitted_at=entry.submission.submitted_at,
                    fact_count=len(entry.submission.facts),
                    log_excerpt=entry.submission.excerpt_hash,
                )
                for entry in fresh.values()
                if entry.submission is not None
            ],
            using,
        )
        result.applied = set(fresh)
        for entry in rejected:
            result.issues[entry.name] = _quarantine_issue(entry, using)
        _fault("pause_in_flush")
    _fault("exit_after_commit")
    return result


def _quarantine_issue(entry: Entry, using: str) -> int:
    """The file's open reconciliation issue, recorded once even if the move is retried.

    It commits on the ingester's own connection, in the batch's transaction.
    """
    kind = IssueKind.QUARANTINED_SUBMISSION
    same = ReconciliationIssue.objects.using(using).filter(
        kind=kind, subject=entry.name, details__hash=entry.hash
    )
    existing = same.filter(status=IssueStatus.OPEN).values_list("pk", flat=True).first()
    if existing is not None:
        return existing
    details = {"hash": entry.hash, "stage": entry.stage, "error": entry.error, **entry.reasons}
    # The same bytes again after their issue was resolved: a new open issue (record() logs
    # it), pointing at the one resolved before.
    earlier = same.order_by("-pk").values_list("pk", flat=True).first()
    if earlier is not None:
        details["earlier_issue"] = earlier
    issue = record(kind, entry.name, details=details, using=using)
    if earlier is not None:
        log.warning(
            "submission_quarantined_again",
            file=entry.name,
            hash=entry.hash,
            issue_id=issue.pk,
            earlier_issue=earlier,
        )
    return issue.pk


# --- finishing files after the commit -------------------------------------------------


def _same_file(path: Path, identity: tuple[int, int]) -> bool:
    try:
        info = path.stat()
    except FileNotFoundError:
        return False
    return (info.st_dev, info.st_ino) == identity


def remove(incoming: int, entry: Entry) -> bool:
    """Delete an acked file, unless it is gone or was replaced since it was read.

    ``incoming`` is an open descriptor of ``incoming/``: a batch's stats and unlinks are
    relative to it, without building and resolving a path for each file.
    """
    try:
        info = os.stat(entry.name, dir_fd=incoming)
    except FileNotFoundError:
        return False
    if (info.st_dev, info.st_ino) != entry.identity:
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(entry.name, dir_fd=incoming)
    return True


def quarantine(spool: Spool, entry: Entry, issue_id: int | None) -> Path | None:
    """Move a rejected file to ``failed/`` with a ``.reason.json`` beside it."""
    source = spool.incoming / entry.name
    if not _same_file(source, entry.identity):
        return None
    target = spool.failed / entry.name
    if target.exists():  # an earlier file of the same name is still there: keep both
        target = spool.failed / f"{entry.name.removesuffix('.json')}.{entry.hash[:12]}.json"
    reason = {
        "file": entry.name,
        "error": entry.error,
        **entry.reasons,
        "stage": entry.stage,
        "hash": entry.hash,
        "quarantined_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "issue_id": issue_id,
    }
    reason_path = target.with_name(target.name + ".reason.json")
    fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", dir=spool.failed)
    try:
        with os.fdopen(fd, "w") as tmp:
            json.dump(reason, tmp, indent=2)
            tmp.write("\n")
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, reason_path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    os.rename(source, target)
    blobs.fsync_dir(spool.failed)
    return target


# --- the writer -----------------------------------------------------------------------

Report = Callable[[str, str], None]  # (file name, outcome)


def _ignore(name: str, outcome: str) -> None:
    return None


class Writer:
    """Buffers entries and flushes them in batches, by size and by time.

    ``flush`` commits the whole buffer in one transaction, then finishes exactly the files
    of that batch (delete acked ones, move rejected ones). On a database error it keeps the
    buffer, nothing moves, and the next try waits for a growing backoff. ``database`` is
    the alias it writes through (default: :func:`ingestion.grants.ingester_database`);
    ``log_batches=False`` logs each batch at debug level (an operator's progress line
    already shows it).
    """

    def __init__(
        self,
        spool: Spool,
        *,
        report: Report = _ignore,
        report_error: Callable[[str], None] | None = None,
        max_files: int = 500,
        max_facts: int = 20_000,
        flush_seconds: float = 0.25,
        database: str | None = None,
        log_batches: bool = True,
    ) -> None:
        self.spool = spool
        self.database = database or ingester_database()
        self.log_batches = log_batches
        self.report = report
        self.report_error = report_error
        self.max_files = max_files
        self.max_facts = max_facts
        self.flush_seconds = flush_seconds
        self.buffer: list[Entry] = []
        self.facts = 0
        self.first_at = 0.0
        self.failures = 0
        self.next_try = 0.0
        self.last_error = ""

    def __len__(self) -> int:
        return len(self.buffer)

    def names(self) -> set[str]:
        return {entry.name for entry in self.buffer}

    @property
    def full(self) -> bool:
        return len(self.buffer) >= self.max_files or self.facts >= self.max_facts

    def add(self, entry: Entry) -> None:
        if not self.buffer:
            self.first_at = time.monotonic()
        self.buffer.append(entry)
        self.facts += entry.fact_count

    def due(self, now: float | None = None, idle: bool = False) -> bool:
        """True when the buffer should be flushed now: full, old enough, or ``idle`` (no
        more entries are coming for now, so waiting would only delay the commit); never
        while backing off."""
        now = time.monotonic() if now is None else now
        if not self.buffer or now < self.next_try:
            return False
        return idle or self.full or now - self.first_at >= self.flush_seconds

    def wait_seconds(self, now: float | None = None) -> float:
        """How long until :meth:`due` may become true without new entries."""
        if not self.buffer:
            return 1.0
        now = time.monotonic() if now is None else now
        if self.full:
            return max(0.0, self.next_try - now)
        return max(0.0, max(self.next_try, self.first_at + self.flush_seconds) - now)

    def flush(self) -> bool:
        """Commit the buffer; True once it is applied (or was empty)."""
        if not self.buffer:
            return True
        batch = self.buffer
        try:
            result = apply_batch(batch, self.database)
        except DatabaseError as exc:
            self._failed(exc)
            return False
        self.failures = 0
        self.next_try = 0.0
        self.buffer, self.facts = [], 0
        self._finish(batch, result)
        return True

    def _failed(self, exc: DatabaseError) -> None:
        self.failures += 1
        delay = FLUSH_RETRY.delay(self.failures)
        self.next_try = time.monotonic() + delay
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        self.last_error = f"{type(exc).__name__}: {message}"
        log.warning(
            "spool_flush_failed",
            files=len(self.buffer),
            error=self.last_error,
            failures=self.failures,
            retry_in=round(delay, 2),
        )
        if self.report_error is not None:
            self.report_error(self.last_error)
        # A broken connection is replaced on the next try; a healthy one is kept.
        if not connections[self.database].in_atomic_block:
            close_old_connections()

    def _finish(self, batch: list[Entry], result: BatchResult) -> None:
        incoming = os.open(self.spool.incoming, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._finish_files(incoming, batch, result)
            os.fsync(incoming)  # one fsync makes all of the batch's unlinks durable
        finally:
            os.close(incoming)
        (log.info if self.log_batches else log.debug)(
            "spool_batch_applied",
            files=len(batch),
            applied=len(result.applied),
            duplicates=len(result.already),
            quarantined=len(result.issues),
        )

    def _finish_files(self, incoming: int, batch: list[Entry], result: BatchResult) -> None:
        acked = result.applied | result.already
        counted: set[str] = set()  # the first file of each applied hash counts as applied
        for entry in batch:
            outcome = SKIPPED
            try:
                if entry.hash in acked:
                    if remove(incoming, entry):
                        first = entry.hash in result.applied and entry.hash not in counted
                        outcome = APPLIED if first else DUPLICATE
                        counted.add(entry.hash)
                elif entry.name in result.issues:
                    target = quarantine(self.spool, entry, result.issues[entry.name])
                    if target is not None:
                        outcome = QUARANTINED
                        log.warning(
                            "submission_quarantined",
                            file=entry.name,
                            moved_to=str(target),
                            stage=entry.stage,
                            error=entry.error,
                            hash=entry.hash,
                        )
            except OSError as exc:  # committed already: the next scan finishes the file
                log.error("spool_finish_failed", file=entry.name, error=str(exc))
            self.report(entry.name, outcome)


# --- progress and the stuck rule ------------------------------------------------------


@dataclass
class Progress:
    """Counts and the last time anything reached a terminal state (monotonic clock)."""

    started: float = field(default_factory=time.monotonic)
    seen: int = 0
    applied: int = 0
    duplicates: int = 0
    quarantined: int = 0
    last_terminal: float = field(default_factory=time.monotonic)
    pending_since: float | None = None
    last_error: str = ""

    def terminal(self, name: str, outcome: str) -> None:
        if outcome not in TERMINAL:
            return
        if outcome == APPLIED:
            self.applied += 1
        elif outcome == DUPLICATE:
            self.duplicates += 1
        elif outcome == QUARANTINED:
            self.quarantined += 1
        self.last_terminal = time.monotonic()

    def error(self, message: str) -> None:
        self.last_error = message

    def as_dict(self, pending: int = 0) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        done = self.applied + self.duplicates + self.quarantined
        return {
            "seen": self.seen,
            "applied": self.applied,
            "duplicates": self.duplicates,
            "quarantined": self.quarantined,
            "pending": pending,
            "elapsed_s": round(elapsed, 3),
            "files_per_s": round(done / elapsed, 1),
        }


def stuck_check(
    pending: int, last_terminal: float, pending_since: float | None, stuck_after: float
) -> str | None:
    """The stuck rule: with work pending, nothing terminal for ``stuck_after`` seconds.

    The clock starts at the later of the last terminal outcome and the moment work became
    pending, so a spool that was idle for an hour is not stuck the moment a file arrives.
    Returns the reason, or None.
    """
    if not pending or pending_since is None:
        return None
    quiet = time.monotonic() - max(last_terminal, pending_since)
    if quiet <= stuck_after:
        return None
    return (
        f"stuck: {pending} file(s) pending and none applied or quarantined "
        f"for {quiet:.0f} s (--stuck-after {stuck_after:g}); every file left in place"
    )


# --- one process: the job handler and --workers 1 -------------------------------------


def drain(
    spool: Spool,
    *,
    limits: Limits | None = None,
    stuck_after: float = 60.0,
    writer: Writer | None = None,
    should_stop: Callable[[], bool] | None = None,
    poll_seconds: float = 0.05,
    grace: float | None = None,
) -> Progress:
    """Apply or quarantine everything in ``incoming/`` in this process, then return.

    Raises :class:`Stuck` (files untouched) when nothing reaches a terminal state for
    ``stuck_after`` seconds while work is pending, and :class:`Overdue` (files untouched)
    when a file has waited longer than ``grace`` seconds (default: the setting).
    """
    limits = limits or Limits.from_settings()
    grace = grace_seconds() if grace is None else grace
    spool.ensure()
    progress = Progress()
    writer = writer or Writer(spool)
    writer.report, writer.report_error = progress.terminal, progress.error
    retry_at: dict[str, float] = {}  # unreadable files: not before this time
    seen: set[str] = set()
    while True:
        if should_stop is not None and should_stop():
            writer.flush()
            return progress
        now = time.monotonic()
        names = spool.pending()
        overdue = spool.overdue(names, grace)
        if overdue:
            raise Overdue(overdue)
        buffered = writer.names()
        for name in names:
            if writer.full:
                break
            if name in buffered or retry_at.get(name, 0.0) > now:
                continue
            try:
                entry = read_entry(spool, name, limits)
            except OSError as exc:
                retry_at[name] = time.monotonic() + READ_RETRY_SECONDS
                progress.error(f"cannot read {name}: {exc}")
                log.warning("submission_unreadable", file=name, error=str(exc))
                continue
            if entry is None:
                continue
            if name not in seen:
                seen.add(name)
                progress.seen += 1
            writer.add(entry)
        # Nothing more to read now: flush what is buffered without waiting for the timer.
        if writer.buffer and (writer.full or time.monotonic() >= writer.next_try):
            writer.flush()
        remaining = spool.pending()
        if not remaining:
            return progress
        now = time.monotonic()
        if progress.pending_since is None:
            progress.pending_since = now
        reason = stuck_check(
            len(remaining), progress.last_terminal, progress.pending_since, stuck_after
        )
        if reason:
            if progress.last_error:
                reason += f"; last error: {progress.last_error}"
            log.error("spool_stuck", pending=len(remaining), reason=reason)
            raise Stuck(reason)
        time.sleep(min(max(writer.wait_seconds(), poll_seconds), 1.0) if writer.buffer else 0.05)
