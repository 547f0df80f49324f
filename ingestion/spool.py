"""The spool: read submissions from ``incoming/``, apply them exactly once, quarantine poison.

ONE pipeline, two ways to start it (docs/ingestion.md, "What happens to a file"):

* :class:`Monitor` lists ``incoming/``, hands names out, collects each file's outcome
  and applies the stuck and grace rules;
* :func:`read_entry` reads, hashes, parses and validates one file (no database);
* :class:`Writer` batches entries, commits them, splits a batch the database refuses,
  and finishes the files of each commit (delete, or move to ``failed/``).

:func:`drain` runs all three in this process (the job ``ingestion.ingest_spool``);
:mod:`ingestion.ingester` runs readers in parallel processes feeding one writer process,
with the monitor in the parent (``manage.py ingest_submissions``). Every rule below is
implemented once, here.

Each file gets one of three outcomes, decided for it alone:

* **applied**: its ack row (``ingested_submissions``, keyed by the sha256 of its bytes)
  commits in the same transaction as its facts and lab; then its file is deleted, if it
  is still the file that was read (same size, mtime, ctime, inode and device).
* **quarantined** (its own fault): anything raised while reading its bytes, decoding,
  parsing or validating them (:mod:`ingestion.submissions`), a file that is not a regular
  file, or a database refusal of its data (a data exception, a constraint or a trigger
  refusing it, a program limit: SQLSTATE classes 22, 23, 44, 54 and P0) that reproduces
  with the file alone, while the rest of its batch commits without it. Its reconciliation
  issue commits first; the move follows.
* **left in place** (nothing to do with the file): every other database error, a file
  that cannot be opened (permissions), the blob store failing, a file that changed
  while or after it was read, a malformed file that changed less than the settle time
  ago. It is retried later; it is never quarantined on that attempt.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import json
import os
import sqlite3
import stat
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, transaction

from jobs.log import get_logger
from jobs.retry import RetryPolicy

from . import blobs
from .grants import ingester_database
from .models import IssueKind
from .sql import (
    AckWrite,
    FactWrite,
    acked,
    ensure_labs,
    execute,
    find_issues,
    insert_acks,
    open_issue,
    serialize_issue,
    upsert_facts,
)
from .submissions import MAX_ERROR_CHARS, InvalidSubmission, Limits, Submission, parse

log = get_logger("ingestion.spool")

#: Fault points of the writer (``db_error``, ``pause_in_flush``, ``exit_after_commit``) and
#: what to do there. Empty in production; the test app installs faults for the process
#: tests (tests/testapp/apps.py), so crash behaviour is tested on this exact code path.
FAULTS: dict[str, Callable[[], None]] = {}

#: A failed flush is retried after this backoff (the stuck timeout bounds the total wait).
FLUSH_RETRY = RetryPolicy(base=0.2, cap=10.0, jitter=0.25)
#: A file that could not be read (not the submission's fault) is retried after this.
READ_RETRY_SECONDS = 1.0
#: A file that changed while it was read is read again after this.
CHANGED_RETRY_SECONDS = 0.1

#: How long a file may wait in ``incoming/`` before the ingester alerts and stops.
DEFAULT_GRACE_SECONDS = 3600.0
#: A malformed file is quarantined only once it has not changed for this long.
DEFAULT_SETTLE_SECONDS = 2.0
#: A batch holds at most this many bytes of submissions (besides files and facts).
DEFAULT_MAX_BATCH_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_BATCH_FILES = 500
DEFAULT_MAX_BATCH_FACTS = 20_000

# Outcomes reported for each file.
APPLIED = "applied"
DUPLICATE = "duplicate"  # already acked: deleted without applying again
QUARANTINED = "quarantined"
TERMINAL = (APPLIED, DUPLICATE, QUARANTINED)
RETRY = "retry"  # left in place: try again after a delay (not the file's fault, or not yet)
SKIPPED = "skipped"  # changed since it was read (or the move failed): read it again
GONE = "gone"  # disappeared before it was read

#: SQLSTATE classes of a database refusal that may be one file's own (with the other two
#: conditions: it reproduces alone, and the rest commits without it): data exceptions,
#: integrity constraints (a CHECK, NOT NULL, unique or foreign key), WITH CHECK OPTION,
#: program limits, and PL/pgSQL's RAISE (a trigger refusing a row). Never a transient class
#: (connections 08, transaction rollbacks 40, resources 53, lock and statement timeouts
#: 55 and 57) nor ours (42, a schema the code does not match; XX).
FILE_DATA_CLASSES = ("22", "23", "44", "54", "P0")

#: SQLite's extended constraint codes, as the SQLSTATE PostgreSQL gives the same refusal.
SQLITE_CONSTRAINTS = {
    sqlite3.SQLITE_CONSTRAINT_NOTNULL: "23502",
    sqlite3.SQLITE_CONSTRAINT_FOREIGNKEY: "23503",
    sqlite3.SQLITE_CONSTRAINT_UNIQUE: "23505",
    sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY: "23505",
    sqlite3.SQLITE_CONSTRAINT_CHECK: "23514",
    sqlite3.SQLITE_CONSTRAINT_TRIGGER: "P0001",  # RAISE(ABORT, …) in a trigger
}


class Stuck(Exception):
    """Work is pending and nothing reached a terminal state for ``stuck_after`` seconds."""


class Overdue(Exception):
    """A file has waited in ``incoming/`` longer than the grace period: an operator must look."""


def grace_seconds() -> float:
    """``HOLDFAST_SPOOL_GRACE_SECONDS`` (default 3600); 0 turns the grace check off."""
    return float(getattr(settings, "HOLDFAST_SPOOL_GRACE_SECONDS", DEFAULT_GRACE_SECONDS))


def settle_seconds() -> float:
    """``HOLDFAST_SPOOL_SETTLE_SECONDS`` (default 2)."""
    return float(getattr(settings, "HOLDFAST_SPOOL_SETTLE_SECONDS", DEFAULT_SETTLE_SECONDS))


def max_batch_bytes() -> int:
    """``HOLDFAST_SPOOL_MAX_BATCH_BYTES`` (default 32 MiB)."""
    return int(getattr(settings, "HOLDFAST_SPOOL_MAX_BATCH_BYTES", DEFAULT_MAX_BATCH_BYTES))


def wall_clock() -> float:
    """Seconds since the epoch: what file times (ctime, mtime) are compared with."""
    return time.time()


def is_submission_name(name: str) -> bool:
    return name.endswith(".json") and not name.startswith(".")


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
        finish_claims(self)
        finish_removals(self)

    def listing(self) -> Iterator[os.DirEntry[str]]:
        """The entries of ``incoming/`` the ingester handles: ``*.json`` (no dot-files),
        anything but a directory. One ``getdents`` pass, no ``stat``: the file type comes
        from the directory entry. Symlinks, FIFOs and devices are listed (and quarantined)."""
        try:
            with os.scandir(self.incoming) as entries:
                for entry in entries:
                    if not is_submission_name(entry.name):
                        continue
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            continue
                    except OSError:
                        continue
                    yield entry
        except FileNotFoundError:
            return

    def pending(self) -> list[str]:
        """Names of submissions waiting in ``incoming/``, oldest arrival first."""
        found: list[tuple[int, str]] = []
        for entry in self.listing():
            try:
                found.append((entry.stat(follow_symlinks=False).st_ctime_ns, entry.name))
            except FileNotFoundError:
                continue
        return [name for _, name in sorted(found)]

    def age(self, name: str) -> float | None:
        """Seconds since ``incoming/<name>`` arrived: its ctime (a rename, a write or a
        chmod sets it; ``cp -p`` and ``rsync -a`` cannot set it back), None if it is gone."""
        try:
            info = os.stat(self.incoming / name, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return max(0.0, wall_clock() - info.st_ctime)

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


def open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def current_dir(path: Path, fd: int) -> int:
    """``fd`` if it is still the directory at ``path``, else a descriptor of the one there
    now (``fd`` closed): ``incoming/`` moved aside and made again while the ingester runs
    must not leave a reader looking for the names the monitor lists in the new one, in
    the old one, for ever."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return fd  # gone: the monitor's scan says so
    held = os.fstat(fd)
    if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
        return fd
    os.close(fd)
    log.warning("spool_incoming_replaced", directory=str(path))
    return open_dir(path)


# --- reading (no database) ------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """What identifies the content that was read: any write, truncation, replacement or
    rename over it changes one of these. Compared before a file is deleted or moved."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int
    mode: int

    @classmethod
    def of(cls, info: os.stat_result) -> Identity:
        return cls(
            info.st_size,
            info.st_mtime_ns,
            info.st_ctime_ns,
            info.st_ino,
            info.st_dev,
            stat.S_IFMT(info.st_mode),
        )

    @property
    def changed_at(self) -> float:
        """The last change (wall clock seconds): the later of mtime and ctime."""
        return max(self.mtime_ns, self.ctime_ns) / 1e9


@dataclass
class Entry:
    """One file as a reader found it: valid (``submission``) or not (``stage``/``error``).

    ``hash`` is empty for files never hashed (not regular, or over the size limit).
    """

    name: str
    hash: str
    identity: Identity
    submission: Submission | None = None
    stage: str = ""
    error: str = ""
    errors: list[str] = field(default_factory=list)
    error_count: int = 0
    size: int = 0

    @property
    def fact_count(self) -> int:
        return len(self.submission.facts) if self.submission else 0

    @classmethod
    def rejected(
        cls, name: str, digest: str, identity: Identity, invalid: InvalidSubmission, size: int
    ) -> Entry:
        return cls(
            name,
            digest,
            identity,
            stage=invalid.stage,
            error=invalid.message,
            errors=list(invalid.errors),
            error_count=invalid.error_count,
            size=size,
        )


class NotYet(Exception):
    """Leave the file in place and read it again after ``delay`` seconds (not its fault)."""

    def __init__(self, reason: str, delay: float) -> None:
        super().__init__(reason)
        self.delay = delay


_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

_KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _not_regular(name: str, info: os.stat_result) -> Entry:
    kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
    error = f"{kind}, not a regular file: the ingester reads only regular files"
    return Entry(
        name,
        "",
        Identity.of(info),
        stage="file",
        error=error,
        errors=[error],
        error_count=1,
    )


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes of the name, as surrogate escapes
        return False
    return True


def printable(name: str) -> str:
    """``name`` as text any database stores (undecodable bytes as U+FFFD)."""
    return os.fsencode(name).decode("utf-8", "replace")


def read_entry(
    spool: Spool,
    name: str,
    limits: Limits,
    *,
    dir_fd: int | None = None,
    settle: float | None = None,
) -> Entry | None:
    """Read, hash, parse and validate ``incoming/<name>``; store its excerpt in the blob
    store. None if the file is gone (or became a directory).

    Reads are bounded and safe: the name is never followed if it is a symlink, a FIFO or
    device is never opened for reading in blocking mode, at most ``max_file_bytes + 1``
    bytes are read, and a file over the limit is rejected from its size alone, unhashed.

    Raises :class:`NotYet` for a file that changed while it was read, or a malformed one
    that changed less than ``settle`` seconds ago (it may still be being written), and
    ``OSError`` when the file cannot be read or the blob store fails: neither is the
    submission's fault, so the caller retries later.
    """
    settle = settle_seconds() if settle is None else settle
    own_fd = dir_fd is None
    directory = open_dir(spool.incoming) if dir_fd is None else dir_fd
    try:
        return _read(name, limits, directory, settle)
    finally:
        if own_fd:
            os.close(directory)


def _read(name: str, limits: Limits, directory: int, settle: float) -> Entry | None:
    try:
        info = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(info.st_mode):
        return None
    if not stat.S_ISREG(info.st_mode):
        return _not_regular(name, info)  # never opened: opening a device can act
    if not _utf8(name):
        error = "the file name is not valid UTF-8: no database can store it"
        identity = Identity.of(info)
        return Entry(name, "", identity, stage="file", error=error, errors=[error], error_count=1)
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        # Replaced by a symlink (ELOOP) or a socket (ENXIO) since the stat: judge what is there.
        try:
            now_info = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(now_info.st_mode) and not stat.S_ISDIR(now_info.st_mode):
            return _not_regular(name, now_info)
        raise exc
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):  # swapped in after the stat: never read it
            return _not_regular(name, before)
        identity = Identity.of(before)
        limit = limits.max_file_bytes
        if before.st_size > limit:
            invalid = InvalidSubmission(
                "limits", f"file is {before.st_size} bytes, more than the limit of {limit}"
            )
            return Entry.rejected(name, "", identity, invalid, before.st_size)
        chunks: list[bytes] = []
        wanted = limit + 1
        while wanted > 0:
            chunk = os.read(fd, min(wanted, 1024 * 1024))
            if not chunk:
                break
            chunks.append(chunk)
            wanted -= len(chunk)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if Identity.of(after) != identity or len(raw) != before.st_size:
        raise NotYet(f"{name} changed while it was read", CHANGED_RETRY_SECONDS)
    digest = hashlib.sha256(raw).hexdigest()
    try:
        submission = parse(raw, limits, digest)
    except InvalidSubmission as invalid:
        quiet = wall_clock() - identity.changed_at
        if quiet < settle:
            raise NotYet(
                f"{name} is malformed ({invalid.stage}) but changed {quiet:.1f} s ago: "
                f"waiting {settle:g} s for it to settle",
                max(0.05, settle - quiet),
            ) from None
        return Entry.rejected(name, digest, identity, invalid, len(raw))
    if submission.excerpt is not None:
        try:
            submission.excerpt_hash = blobs.store(submission.excerpt)
        except OSError as exc:  # the blob store's fault, not the file's: say so
            raise BlobStoreError(f"cannot store the log excerpt of {name}: {exc}") from exc
        submission.excerpt = None  # stored: no need to carry it to the writer
    return Entry(name, digest, identity, submission=submission, size=len(raw))


class BlobStoreError(OSError):
    """Storing a submission's log excerpt failed (a full disk, HOLDFAST_BLOB_DIR not
    writable): the store's fault, retried like any transient error."""


# --- database refusals: whose fault? --------------------------------------------------


def refusal_sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a database error when it refuses data (its class is one of
    ``FILE_DATA_CLASSES``), else None. SQLite has no SQLSTATE: its codes that mean the same
    are mapped (``SQLITE_TOOBIG`` → 54000; ``SQLITE_MISMATCH`` → 22000; a JSON column's
    ``json_valid`` CHECK, SQLite's form of PostgreSQL's invalid JSON → 22032; the other
    constraints as ``SQLITE_CONSTRAINTS`` says, 23000 for the rest of that family)."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    sqlstate = getattr(cause, "sqlstate", None)
    if isinstance(sqlstate, str):
        return sqlstate if sqlstate[:2] in FILE_DATA_CLASSES else None
    code = getattr(cause, "sqlite_errorcode", None)
    if not isinstance(code, int):
        return None
    if code == sqlite3.SQLITE_TOOBIG:
        return "54000"
    if code == sqlite3.SQLITE_MISMATCH:
        return "22000"
    if code == sqlite3.SQLITE_CONSTRAINT_CHECK and "json_valid(" in str(cause).lower():
        return "22032"
    if code & 0xFF == sqlite3.SQLITE_CONSTRAINT:
        return SQLITE_CONSTRAINTS.get(code, "23000")
    return None


def describe(exc: BaseException) -> str:
    """One line naming a database error: class, SQLSTATE when known, first line."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else repr(exc)
    cause = exc.__cause__
    sqlstate = getattr(cause, "sqlstate", None) or refusal_sqlstate(exc)
    code = f" [{sqlstate}]" if sqlstate else ""
    return f"{type(exc).__name__}{code}: {first}"[:MAX_ERROR_CHARS]


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


@contextlib.contextmanager
def _bound_waits(using: str, deadline: float | None) -> Iterator[None]:
    """Make the transaction inside give up by ``deadline`` (monotonic) instead of waiting on
    a lock past it: SQLite's busy timeout, set before its BEGIN IMMEDIATE and restored
    after; on PostgreSQL the statement timeout inside the transaction
    (:func:`_bound_statements`)."""
    connection = connections[using]
    if deadline is None or connection.vendor != "sqlite":
        yield
        return
    connection.ensure_connection()
    raw = connection.connection
    (usual,) = raw.execute("PRAGMA busy_timeout").fetchone()
    raw.execute(f"PRAGMA busy_timeout = {_remaining_ms(deadline)}")
    try:
        yield
    finally:
        if connection.connection is raw:
            raw.execute(f"PRAGMA busy_timeout = {int(usual)}")


#: PostgreSQL: a batch's transaction idle this long (its process frozen: SIGSTOP, a paused
#: VM or container) is ended by the server, its row locks freed for other ingesters. A batch
#: runs its statements back to back, with no wait between them.
BATCH_IDLE_LIMIT = 10.0


def _bound_statements(using: str, deadline: float | None) -> None:
    if connections[using].vendor != "postgresql":
        return
    statement = None if deadline is None else f"{_remaining_ms(deadline)}ms"
    execute(  # one round trip, both LOCAL to the batch; no deadline: the session's own
        using,
        "SELECT set_config('idle_in_transaction_session_timeout', %s, true),"
        " set_config('statement_timeout',"
        " COALESCE(%s::text, current_setting('statement_timeout')), true)",
        [f"{int(BATCH_IDLE_LIMIT * 1000)}ms", statement],
    )


def _remaining_ms(deadline: float) -> int:
    return max(100, int((deadline - time.monotonic()) * 1000))


def apply_batch(
    entries: list[Entry], using: str = DEFAULT_DB_ALIAS, deadline: float | None = None
) -> BatchResult:
    """Apply a batch in ONE transaction on the database ``using``: labs, facts, ack rows and
    the reconciliation issues of rejected files. Raises ``DatabaseError`` with nothing
    committed. ``deadline`` (monotonic) bounds how long it may wait on locks."""
    result = BatchResult()
    with _bound_waits(using, deadline), transaction.atomic(using=using):
        _bound_statements(using, deadline)
        _fault("db_error")
        result.already = acked(sorted({entry.hash for entry in entries if entry.hash}), using)
        fresh: dict[str, Entry] = {}
        rejected: list[Entry] = []
        for entry in entries:
            if entry.hash and entry.hash in result.already:
                continue
            if entry.submission is None:
                rejected.append(entry)
            else:
                fresh.setdefault(entry.hash, entry)
        submissions = [entry.submission for entry in fresh.values() if entry.submission]
        lab_ids = ensure_labs(sorted({submission.lab for submission in submissions}), using)

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
            result.issues[entry.name] = quarantine_issue(entry, using)
        _fault("pause_in_flush")
    _fault("exit_after_commit")
    return result


def quarantine_issue(entry: Entry, using: str) -> int:
    """The file's open reconciliation issue, inside the caller's transaction.

    An open issue of the very same file is reused: the move is being retried (after a
    crash, or a move that failed). "The very same file" is the same name, bytes, inode and
    change time (``details.read_as``): a file put back into ``incoming/`` after its
    quarantine was renamed twice since (each rename changes its ctime), so it is a new
    quarantine even while the earlier issue is still open. Otherwise a new issue opens;
    if the same bytes were quarantined before (the earlier issue open or resolved, or
    under another name) the new issue names the earlier ones in
    ``details.previous_issues`` and ``submission_quarantined_again`` is logged, so a file
    put back unchanged is seen again, not silently dropped. It commits on the ingester's
    own connection.
    """
    kind = IssueKind.QUARANTINED_SUBMISSION
    serialize_issue(f"{kind}:{entry.hash or printable(entry.name)}", using)
    earlier = find_issues(kind, entry.hash, using)
    issue_id = _open_one(earlier, entry)
    if issue_id is not None:
        return issue_id
    details: dict[str, Any] = {
        "hash": entry.hash,
        "read_as": _read_as(entry),
        "stage": entry.stage,
        "error": entry.error,
        "errors": entry.errors,
        "error_count": entry.error_count,
        "size": entry.size or entry.identity.size,
    }
    previous = [issue_id for issue_id, _, _, _ in earlier] if entry.hash else []
    if previous:
        details["previous_issues"] = previous
    subject = printable(entry.name)
    issue_id = open_issue(kind, subject, details, using)
    log.warning(
        "reconciliation_issue_opened", issue_id=issue_id, kind=kind, source="", subject=subject
    )
    if previous:
        log.warning(
            "submission_quarantined_again",
            file=entry.name,
            hash=entry.hash,
            issue_id=issue_id,
            previous_issues=previous,
        )
    return issue_id


def its_open_issue(entry: Entry, using: str) -> int | None:
    """The open quarantine issue of the very same file, if one was committed: its
    quarantine was decided and only the move is left (see :func:`quarantine_issue`)."""
    return _open_one(find_issues(IssueKind.QUARANTINED_SUBMISSION, entry.hash, using), entry)


def _read_as(entry: Entry) -> str:
    identity = entry.identity
    return f"{identity.dev}:{identity.ino}:{identity.ctime_ns}"


def _open_one(issues: list[tuple[int, str, str, str | None]], entry: Entry) -> int | None:
    read_as = _read_as(entry)
    for issue_id, subject, status, seen_as in issues:
        if subject == printable(entry.name) and status == "open" and seen_as in (read_as, None):
            return issue_id  # (None: an issue opened before read_as was recorded)
    return None


# --- finishing files after the commit -------------------------------------------------


def same_file(directory: int, entry: Entry) -> bool:
    """Is ``entry.name`` still exactly the file that was read? (Compared just before the
    file is deleted or moved: a file rewritten or replaced since is left for a new read.)"""
    try:
        info = os.stat(entry.name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return Identity.of(info) == entry.identity


def remove(incoming: int, entry: Entry) -> bool:
    """Delete an acked file, unless it changed since it was read (False: read it again).
    True when the file that was read is gone: deleted here, or replaced under its name
    by another, which stays for the next scan.

    ``incoming`` is an open descriptor of ``incoming/``: a batch's stats and unlinks are
    relative to it, without building and resolving a path for each file.
    """
    if not same_file(incoming, entry):
        return False
    # Taken aside by a rename (atomic) and compared again before the unlink: a file
    # renamed over the name after the look above (new data under a reused name) is put
    # back, never deleted on the strength of the old file's ack.
    taken = acked_name(entry)
    try:
        os.rename(entry.name, taken, src_dir_fd=incoming, dst_dir_fd=incoming)
    except FileNotFoundError:
        return True  # gone meanwhile (deleted by its producer): nothing left to delete
    info = os.stat(taken, dir_fd=incoming, follow_symlinks=False)
    if same_content(info, entry.identity):
        os.unlink(taken, dir_fd=incoming)
        return True
    put_back(taken, incoming, entry.name, src_dir_fd=incoming)
    return True  # the acked file is gone (replaced); the next scan finds the new one


ACKED_SUFFIX = ".acked"


def acked_name(entry: Entry) -> str:
    """The dot-file (never listed) an acked file is renamed to before it is deleted: its
    name kept, or its hash where that would pass the file system's limit on a name."""
    name = f".{entry.name}{ACKED_SUFFIX}"
    if len(os.fsencode(name)) <= 255:
        return name
    return f".{entry.hash[:32]}.json{ACKED_SUFFIX}"


def finish_removals(spool: Spool) -> None:
    """At start-up: an ``incoming/.<name>.acked`` left by a crash between the rename and
    the unlink (or the comparison) goes back to ``incoming/<name>``, to be read again: a
    duplicate of an acked file is then deleted, anything else applied."""
    directory = open_dir(spool.incoming)
    try:
        for entry in os.scandir(spool.incoming):
            if entry.name.startswith(".") and entry.name.endswith(ACKED_SUFFIX):
                put_back(entry.name, directory, entry.name[1 : -len(ACKED_SUFFIX)], directory)
                log.warning("spool_removal_finished", file=entry.name)
    finally:
        os.close(directory)


def reason_of(entry: Entry, issue_id: int | None) -> dict[str, Any]:
    return {
        "file": printable(entry.name),
        "error": entry.error,
        "stage": entry.stage,
        "errors": entry.errors,
        "error_count": entry.error_count,
        "hash": entry.hash or None,
        "size": entry.size or entry.identity.size,
        "quarantined_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "issue_id": issue_id,
    }


REASON_SUFFIX = ".reason.json"


def quarantine_target(failed: Path, entry: Entry, issue_id: int | None) -> Path:
    """Where in ``failed/`` a rejected file goes: under its own name unless that name, or
    its reason's, is taken (an earlier file of the same name, or a submission that was
    itself named ``<name>.json.reason.json``: never written over), or the reason's name
    would pass the file system's limit on a name (a 250-byte name is a valid one); then
    ``<stem>.<hash or time>[.<n>].json``, the stem shortened as needed. The reason file
    keeps the original name. A reason left by this same quarantine (written, then a crash
    before the move) does not count as taken: it is written again, not orphaned."""
    limit = name_limit(failed)
    stem = entry.name.removesuffix(".json")
    tag = entry.hash[:12] if entry.hash else f"{time.time_ns():x}"
    for n in itertools.count():
        if n == 0:
            name = entry.name
        else:
            suffix = f".{tag}.json" if n == 1 else f".{tag}.{n}.json"
            room = limit - len(os.fsencode(suffix + REASON_SUFFIX))
            name = shortened(stem, room) + suffix
        if len(os.fsencode(name + REASON_SUFFIX)) > limit:
            continue
        target = failed / name
        reason = Path(str(target) + REASON_SUFFIX)
        if not os.path.lexists(target) and (
            not os.path.lexists(reason) or own_reason(reason, entry, issue_id)
        ):
            return target
    raise AssertionError("unreachable")  # itertools.count() never ends


# The largest reason file this ingester writes is a few hundred KB (its errors quoted,
# non-ASCII escaped); a larger file beside a quarantine is not one of its reasons.
MAX_REASON_BYTES = 4 * 1024 * 1024


def _read_all(fd: int, size: int) -> bytes:
    chunks = []
    while size > 0 and (chunk := os.read(fd, size)):
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def own_reason(path: Path, entry: Entry, issue_id: int | None) -> bool:
    """Is ``path`` the reason this quarantine wrote before (same file, same issue)?"""
    try:
        # Never blocks, never follows: a submission moved here may be a FIFO or a link.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        size = os.fstat(fd).st_size
        if size > MAX_REASON_BYTES:  # a reason quotes at most MAX_ERRORS errors; not this
            return False
        found = json.loads(_read_all(fd, size))
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)
    return (
        isinstance(found, dict)
        and found.get("file") == printable(entry.name)
        and found.get("issue_id") == issue_id
        and found.get("hash") == (entry.hash or None)
    )


def name_limit(directory: Path) -> int:
    """The longest file name ``directory``'s file system takes, in bytes (255 on Linux)."""
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def shortened(stem: str, size: int) -> str:
    """``stem`` cut to at most ``size`` bytes of its file-system encoding, never inside a
    character."""
    encoded = os.fsencode(stem)
    while len(encoded) > size:
        stem = stem[:-1]
        encoded = os.fsencode(stem)
    return stem


def quarantine(
    spool: Spool, entry: Entry, issue_id: int | None, incoming: int | None = None
) -> Path | None:
    """Move a rejected file to ``failed/`` with a ``.reason.json`` beside it; None (and
    nothing moved) when the file is gone or changed since it was read."""
    directory = open_dir(spool.incoming) if incoming is None else incoming
    try:
        if not same_file(directory, entry):
            return None
        target = quarantine_target(spool.failed, entry, issue_id)
        reason_path = target.with_name(target.name + REASON_SUFFIX)
        reason = json.dumps(reason_of(entry, issue_id), indent=2) + "\n"
        blobs.write_durably(reason_path, reason.encode())
        # Taken out of incoming/ by a rename (atomic) before its identity is compared
        # again: a file renamed over the name since the first look (a corrected
        # submission) is put back, never quarantined under the old file's reason.
        claim = claim_path(target)
        try:
            os.rename(entry.name, claim, src_dir_fd=directory)
        except FileNotFoundError:
            _gone_meanwhile(target, reason_path)
            return None
        if not same_content(os.lstat(claim), entry.identity):
            put_back(claim, directory, entry.name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(reason_path)
            return None
        os.rename(claim, target)
        blobs.fsync_dir(spool.failed)
        return target
    finally:
        if incoming is None:
            os.close(directory)


def _gone_meanwhile(target: Path, reason_path: Path) -> None:
    """The file left ``incoming/`` between the look and the move: taken by another
    ingester of this spool (its claim or its move is there, with this same reason) or
    deleted by its producer (then the reason just written is nobody's)."""
    if not os.path.lexists(claim_path(target)) and not os.path.lexists(target):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(reason_path)


CLAIM_SUFFIX = ".claim"  # shorter than REASON_SUFFIX: a claim's name is never too long


def claim_path(target: Path) -> Path:
    """Where a file being quarantined to ``target`` waits while it is checked: a dot-file
    of ``failed/``. A crash there leaves it so; ``finish_claims`` completes the move."""
    return target.with_name(f".{target.name}{CLAIM_SUFFIX}")


def same_content(info: os.stat_result, identity: Identity) -> bool:
    """The file that was read, after a rename of it (which changed its ctime only)."""
    now = Identity.of(info)
    return replace(now, ctime_ns=identity.ctime_ns) == identity


def put_back(taken: Path | str, incoming: int, name: str, src_dir_fd: int | None = None) -> None:
    """Return a file taken by mistake to ``incoming/``: under its name unless another file
    took that name meanwhile (``link`` never replaces), then under a new one."""
    for candidate in itertools.chain([name], (f"{name}.{time.time_ns():x}.json" for _ in range(3))):
        try:
            os.link(
                taken, candidate, src_dir_fd=src_dir_fd, dst_dir_fd=incoming, follow_symlinks=False
            )
        except FileExistsError:
            continue
        os.unlink(taken, dir_fd=src_dir_fd)
        return
    raise OSError(f"cannot put {taken} back into incoming/")


def finish_claims(spool: Spool) -> None:
    """Complete the quarantines a crash interrupted between their two renames: each
    ``failed/.<name>.claim`` becomes ``failed/<name>``, beside its reason (at start-up)."""
    for entry in os.scandir(spool.failed):
        if not (entry.name.startswith(".") and entry.name.endswith(CLAIM_SUFFIX)):
            continue
        target = spool.failed / entry.name[1 : -len(CLAIM_SUFFIX)]
        if not os.path.lexists(target):
            os.rename(entry.path, target)
            log.warning("submission_quarantine_finished", file=target.name)
    blobs.fsync_dir(spool.failed)


# --- the writer -----------------------------------------------------------------------

#: (file name, outcome, detail, delay): how the writer reports each file it finished.
Report = Callable[[str, str, str, float], None]


def _ignore(name: str, outcome: str, detail: str = "", delay: float = 0.0) -> None:
    return None


@dataclass
class _Split:
    """What a flush found out: commits made, and files the database refused alone."""

    committed: list[tuple[list[Entry], BatchResult]] = field(default_factory=list)
    suspects: list[tuple[Entry, DatabaseError]] = field(default_factory=list)


MAX_FINISH_FAILURES = 10_000  # names whose delete or move failed, remembered for backoff


class Writer:
    """Buffers entries and flushes them in batches, by size (files, facts, bytes) and by time.

    ``flush`` commits the whole buffer in one transaction, then finishes exactly the files
    of that batch (delete acked ones, move rejected ones). When the database refuses the
    batch with a data exception or a program limit, the batch is split in halves, and each
    half applied, down to single files: the files that commit are finished, and a file
    refused alone while others committed is quarantined with the database's reason. Any
    other error keeps the (rest of the) buffer, nothing moves, and the next try waits for
    a growing backoff; meanwhile the buffer does not grow (:attr:`accepting` is False).

    ``database`` is the alias it writes through (default:
    :func:`ingestion.grants.ingester_database`); ``log_batches=False`` logs each batch at
    debug level (an operator's progress line already shows it); ``deadline`` returns the
    monotonic time by which a flush must give up waiting on locks (the stuck rule).
    """

    def __init__(
        self,
        spool: Spool,
        *,
        report: Report = _ignore,
        report_error: Callable[[str], None] | None = None,
        max_files: int = DEFAULT_MAX_BATCH_FILES,
        max_facts: int = DEFAULT_MAX_BATCH_FACTS,
        max_bytes: int | None = None,
        flush_seconds: float = 0.25,
        database: str | None = None,
        log_batches: bool = True,
        deadline: Callable[[], float | None] | None = None,
    ) -> None:
        self.spool = spool
        self.database = database or ingester_database()
        self.log_batches = log_batches
        self.report = report
        self.report_error = report_error
        self.max_files = max_files
        self.max_facts = max_facts
        self.max_bytes = max_batch_bytes() if max_bytes is None else max_bytes
        self.flush_seconds = flush_seconds
        self.deadline = deadline or (lambda: None)
        self.buffer: list[Entry] = []
        self.facts = 0
        self.bytes = 0
        self.first_at = 0.0
        self.failures = 0
        self.next_try = 0.0
        self.last_error = ""
        self.finish_failures: dict[str, int] = {}  # name -> failed deletes or moves in a row

    def __len__(self) -> int:
        return len(self.buffer)

    def names(self) -> set[str]:
        return {entry.name for entry in self.buffer}

    @property
    def full(self) -> bool:
        return (
            len(self.buffer) >= self.max_files
            or self.facts >= self.max_facts
            or self.bytes >= self.max_bytes
        )

    @property
    def retrying(self) -> bool:
        return self.failures > 0 and bool(self.buffer)

    @property
    def accepting(self) -> bool:
        """May more entries join the buffer? Not when full, nor while a failed batch is
        being retried (a batch that grows while it retries may never fit again)."""
        return not self.full and not self.retrying

    def room(self, size: int) -> bool:
        """Would an entry of ``size`` bytes fit? (An empty buffer takes anything.)"""
        return not self.buffer or self.bytes + size <= self.max_bytes

    def add(self, entry: Entry) -> None:
        if not self.buffer:
            self.first_at = time.monotonic()
        self.buffer.append(entry)
        self.facts += entry.fact_count
        self.bytes += entry.size

    def due(self, now: float | None = None, idle: bool = False) -> bool:
        """True when the buffer should be flushed now: full, old enough, or ``idle`` (no
        more entries are coming for now, so waiting would only delay the commit); never
        while backing off."""
        now = time.monotonic() if now is None else now
        if not self.buffer or now < self.next_try:
            return False
        return idle or self.full or self.retrying or now - self.first_at >= self.flush_seconds

    def wait_seconds(self, now: float | None = None) -> float:
        """How long until :meth:`due` may become true without new entries."""
        if not self.buffer:
            return 1.0
        now = time.monotonic() if now is None else now
        if self.full or self.retrying:
            return max(0.0, self.next_try - now)
        return max(0.0, max(self.next_try, self.first_at + self.flush_seconds) - now)

    def drop(self) -> list[Entry]:
        """Empty the buffer without applying it (shutting down): its files stay."""
        dropped, self.buffer, self.facts, self.bytes = self.buffer, [], 0, 0
        return dropped

    def flush(self) -> bool:
        """Commit the buffer; True once it is applied (or was empty)."""
        if not self.buffer:
            return True
        batch = list(self.buffer)
        split = _Split()
        try:
            self._apply(batch, split)
        except DatabaseError as exc:  # not the files' fault: keep what did not commit
            for entries, result in split.committed:
                self._finish(entries, result)
            done = {id(entry) for entries, _ in split.committed for entry in entries}
            self._keep([entry for entry in batch if id(entry) not in done])
            self._failed(exc)
            return False
        self.failures = 0
        self.next_try = 0.0
        self._keep([])
        self._finish_split(split)
        return True

    def _keep(self, entries: list[Entry]) -> None:
        self.buffer = entries
        self.facts = sum(entry.fact_count for entry in entries)
        self.bytes = sum(entry.size for entry in entries)

    def _apply(self, entries: list[Entry], split: _Split) -> None:
        """Apply ``entries``; on a refusal that may be one file's own, split them in halves
        and apply each, down to single files (recorded in ``split.suspects``). Any other
        database error propagates, with what committed so far in ``split.committed``."""
        try:
            result = apply_batch(entries, self.database, self.deadline())
        except DatabaseError as exc:
            self._rolled_back()
            if refusal_sqlstate(exc) is None:
                raise
            if len(entries) == 1:
                split.suspects.append((entries[0], exc))
                return
            log.info(
                "spool_batch_split",
                files=len(entries),
                error=describe(exc),
            )
            middle = len(entries) // 2
            self._apply(entries[:middle], split)
            self._apply(entries[middle:], split)
            return
        split.committed.append((entries, result))

    def _rolled_back(self) -> None:
        # A broken connection is replaced on the next try; a healthy one is kept.
        connection = connections[self.database]
        if connection.in_atomic_block or connection.connection is None:
            return
        if not connection.is_usable():
            connection.close()

    def _finish_split(self, split: _Split) -> None:
        for entries, result in split.committed:
            self._finish(entries, result)
        if not split.suspects:
            return
        suspects = split.suspects
        if not any(result.applied for _, result in split.committed):
            # The file failed alone, but no other submission committed: the database may
            # refuse every file (a trigger, a constraint, a changed column). Not its fault
            # yet: it is tried again with the next files. Unless its quarantine was
            # decided before (its issue is open) and only the move failed: then it waits,
            # backing off, for failed/ to take it, and says why, across restarts too.
            decided = self._decided([entry for entry, _ in suspects])
            for entry, exc in suspects:
                if entry.name in decided:
                    continue
                self.last_error = describe(exc)
                log.warning(
                    "spool_refused_alone_unconfirmed",
                    file=entry.name,
                    error=self.last_error,
                )
                self.report(entry.name, RETRY, self.last_error, FLUSH_RETRY.delay(1))
            suspects = [(e, exc) for e, exc in suspects if e.name in decided]
            if not suspects:
                return
        refused = [
            Entry(
                entry.name,
                entry.hash,
                entry.identity,
                stage="database",
                error=f"the database refused this submission alone: {describe(exc)}",
                errors=[describe(exc)],
                error_count=1,
                size=entry.size,
            )
            for entry, exc in suspects
        ]
        try:
            result = apply_batch(refused, self.database, self.deadline())
        except DatabaseError as exc:  # the issues could not be recorded: leave the files
            self._rolled_back()
            for entry in refused:
                self.report(entry.name, RETRY, describe(exc), FLUSH_RETRY.delay(1))
            return
        self._finish(refused, result)

    def _decided(self, entries: list[Entry]) -> set[str]:
        """The names among ``entries`` whose quarantine issue is open (none when the
        database cannot say: they are tried again like any unconfirmed refusal)."""
        try:
            return {entry.name for entry in entries if its_open_issue(entry, self.database)}
        except DatabaseError:
            self._rolled_back()
            return set()

    def _failed(self, exc: DatabaseError) -> None:
        self.failures += 1
        delay = FLUSH_RETRY.delay(self.failures)
        self.next_try = time.monotonic() + delay
        self.last_error = describe(exc)
        log.warning(
            "spool_flush_failed",
            files=len(self.buffer),
            error=self.last_error,
            failures=self.failures,
            retry_in=round(delay, 2),
        )
        if self.report_error is not None:
            self.report_error(self.last_error)

    def _finish(self, batch: list[Entry], result: BatchResult) -> None:
        incoming = open_dir(self.spool.incoming)
        try:
            self._finish_files(incoming, batch, result)
            os.fsync(incoming)  # one fsync makes all of the batch's unlinks durable
        finally:
            os.close(incoming)
        (log.info if self.log_batches else log.debug)(
            "spool_batch_applied",
            files=len(batch),
            bytes=sum(entry.size for entry in batch),
            applied=len(result.applied),
            duplicates=len(result.already),
            quarantined=len(result.issues),
        )

    def _finish_files(self, incoming: int, batch: list[Entry], result: BatchResult) -> None:
        acked_now = result.applied | result.already
        counted: set[str] = set()  # the first file of each applied hash counts as applied
        for entry in batch:
            outcome = SKIPPED
            try:
                if entry.hash and entry.hash in acked_now:
                    if remove(incoming, entry):
                        first = entry.hash in result.applied and entry.hash not in counted
                        outcome = APPLIED if first else DUPLICATE
                        counted.add(entry.hash)
                elif entry.name in result.issues:
                    target = quarantine(self.spool, entry, result.issues[entry.name], incoming)
                    if target is not None:
                        outcome = QUARANTINED
                        log.warning(
                            "submission_quarantined",
                            file=entry.name,
                            moved_to=str(target),
                            stage=entry.stage,
                            error=entry.error,
                            error_count=entry.error_count,
                            hash=entry.hash,
                        )
            except OSError as exc:
                # Committed already (the ack, or the issue): the file is finished by a later
                # try, after a growing delay, and the stuck rule names why it waits (a name
                # the file system refuses, failed/ not writable) instead of re-reading it
                # at once, again and again.
                failures = self.finish_failures.pop(entry.name, 0) + 1
                self.finish_failures[entry.name] = failures  # now the newest entry
                if len(self.finish_failures) > MAX_FINISH_FAILURES:  # names gone since
                    del self.finish_failures[next(iter(self.finish_failures))]
                verb = "move it to failed/" if entry.name in result.issues else "delete it"
                detail = f"{printable(entry.name)}: cannot {verb}: {exc}"
                log.error("spool_finish_failed", file=entry.name, error=str(exc), tries=failures)
                self.report(entry.name, RETRY, detail, FLUSH_RETRY.delay(failures))
                continue
            self.finish_failures.pop(entry.name, None)
            self.report(entry.name, outcome, "", 0.0)


# --- the monitor: listing, hand-out, outcomes, the stuck and grace rules --------------


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
    flushing: tuple[float, int] | None = None  # (since, files): a commit not yet returned

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


class Rate:
    """Files finished per second over the last ``window`` seconds (a watcher that ran for
    hours still shows what it does now, not its lifetime average)."""

    def __init__(self, window: float = 5.0) -> None:
        self.window = window
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, done: int) -> float:
        self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window:
            self.samples.popleft()
        first_at, first_done = self.samples[0]
        return round((done - first_done) / (now - first_at), 1) if now > first_at else 0.0


class _Tracked:
    __slots__ = ("arrived", "handed", "in_flight", "queued")

    def __init__(self, arrived: float) -> None:
        self.arrived = arrived  # wall clock: the file's ctime when first listed
        self.handed = False  # handed out at least once (counted as seen)
        self.in_flight = False
        self.queued = True


class Monitor:
    """What is in ``incoming/``, what was handed out, and whether the work is stuck.

    Memory and time stay linear in what ``incoming/`` holds: a listing costs one
    ``getdents`` pass plus one ``stat`` per *new* name (its arrival time); names are handed
    out from a queue in listing order, and files that vanished are forgotten at the next
    listing, so a watcher that runs for months keeps state only for files still there.
    """

    def __init__(
        self,
        spool: Spool,
        *,
        stuck_after: float,
        grace: float,
        scan_seconds: float = 1.0,
    ) -> None:
        self.spool = spool
        self.stuck_after = stuck_after
        self.grace = grace
        self.scan_seconds = scan_seconds
        self.progress = Progress()
        self.files: dict[str, _Tracked] = {}
        self.todo: deque[str] = deque()
        self.retries: list[tuple[float, str]] = []  # (monotonic time, name), a heap
        self.in_flight = 0
        self.scanned_at = -float("inf")
        self.scan_cost = 0.0
        self.rate = Rate()

    # -- listing

    def scan_due(self, now: float) -> bool:
        """List again when nothing is left to hand out, else at most every
        ``scan_seconds`` (and never more than a fiftieth of the time: listing 100,000
        names must not slow their draining)."""
        if not self.todo and not self.in_flight:
            return True
        return now - self.scanned_at >= max(self.scan_seconds, 50 * self.scan_cost)

    def scan(self, now: float | None = None) -> None:
        """List ``incoming/``: track new names, forget vanished ones, apply the grace rule
        (raises :class:`Overdue`, before any file of this listing is handed out)."""
        started = time.monotonic()
        listed: set[str] = set()
        new: list[tuple[int, str]] = []
        for entry in self.spool.listing():
            name = entry.name
            listed.add(name)
            if name in self.files:
                continue
            try:
                arrived = entry.stat(follow_symlinks=False).st_ctime
            except FileNotFoundError:
                listed.discard(name)
                continue
            self.files[name] = _Tracked(arrived)
            new.append((entry.inode(), name))
        # In inode order, not the directory's hash order: reading and unlinking a large
        # directory's files touch the inode table in sequence (about twice as fast).
        new.sort()
        self.todo.extend(name for _, name in new)
        for name in [n for n, t in self.files.items() if n not in listed and not t.in_flight]:
            del self.files[name]
        self.scanned_at = now if now is not None else time.monotonic()
        self.scan_cost = time.monotonic() - started
        self._grace_rule()

    def _grace_rule(self) -> None:
        if self.grace <= 0 or not self.files:
            return
        name, tracked = min(self.files.items(), key=lambda item: item[1].arrived)
        age = wall_clock() - tracked.arrived
        if age <= self.grace:
            return
        log.error("spool_overdue", file=name, age_s=round(age, 1), grace_s=self.grace)
        raise Overdue(
            f"overdue: incoming/{name} has waited {age:.0f} s, longer than the grace "
            f"period of {self.grace:g} s; it and every other file left in place (investigate, "
            "then run with a larger --grace, or --grace 0, to drain)"
        )

    # -- hand-out

    def take(self, limit: int, now: float | None = None) -> list[str]:
        """Up to ``limit`` names to read now (retries whose time has come first)."""
        now = time.monotonic() if now is None else now
        while self.retries and self.retries[0][0] <= now:
            _, name = heapq.heappop(self.retries)
            tracked = self.files.get(name)
            if tracked is not None and not tracked.in_flight and not tracked.queued:
                tracked.queued = True
                self.todo.appendleft(name)
        names: list[str] = []
        while self.todo and len(names) < limit:
            name = self.todo.popleft()
            tracked = self.files.get(name)
            if tracked is None or tracked.in_flight or not tracked.queued:
                continue
            tracked.queued = False
            tracked.in_flight = True
            if not tracked.handed:
                tracked.handed = True
                self.progress.seen += 1
            names.append(name)
        self.in_flight += len(names)
        return names

    def outcome(self, name: str, outcome: str, detail: str = "", delay: float = 0.0) -> None:
        """A file's outcome from a reader or the writer."""
        tracked = self.files.get(name)
        if tracked is not None and tracked.in_flight:
            tracked.in_flight = False
            self.in_flight -= 1
        if outcome in TERMINAL:
            progress = self.progress
            if outcome == APPLIED:
                progress.applied += 1
            elif outcome == DUPLICATE:
                progress.duplicates += 1
            else:
                progress.quarantined += 1
            progress.last_terminal = time.monotonic()
            self.files.pop(name, None)
            return
        if outcome == GONE:
            self.files.pop(name, None)
            return
        if tracked is None:
            return
        if outcome == RETRY:
            if detail:
                self.progress.last_error = detail
            heapq.heappush(self.retries, (time.monotonic() + max(delay, 0.0), name))
        else:  # SKIPPED: changed since it was read; read it again at once
            tracked.queued = True
            self.todo.append(name)

    def error(self, message: str) -> None:
        self.progress.last_error = message

    def flushing(self, since: float | None, files: int = 0) -> None:
        """The writer began a commit of ``files`` at ``since`` (monotonic; the clock is
        the machine's, the same in every process), or (None) it returned: while one waits
        on the database, the stuck rule's reason says so."""
        self.progress.flushing = None if since is None else (since, files)

    def next_retry_in(self, now: float | None = None) -> float | None:
        """Seconds until the next file waiting for a retry may be read again (None: none)."""
        if not self.retries:
            return None
        now = time.monotonic() if now is None else now
        return max(0.0, self.retries[0][0] - now)

    # -- state and rules

    @property
    def pending(self) -> int:
        return len(self.files)

    @property
    def drained(self) -> bool:
        """Nothing left in ``incoming/`` as of the last listing, and nothing in flight."""
        return not self.files and not self.in_flight

    def deadline(self) -> float | None:
        """When the stuck rule fires if nothing reaches a terminal state before (monotonic)."""
        progress = self.progress
        if progress.pending_since is None:
            return time.monotonic() + self.stuck_after
        return max(progress.last_terminal, progress.pending_since) + self.stuck_after

    def check(self, now: float | None = None) -> None:
        """The stuck rule (raises :class:`Stuck`, files untouched)."""
        now = time.monotonic() if now is None else now
        progress = self.progress
        if not self.files:
            progress.pending_since = None
            return
        if progress.pending_since is None:
            progress.pending_since = now
        reason = stuck_check(
            len(self.files), progress.last_terminal, progress.pending_since, self.stuck_after
        )
        if reason:
            if progress.flushing is not None:
                since, files = progress.flushing
                reason += (
                    f"; the writer has waited {now - since:.0f} s for the database to commit a "
                    f"batch of {files} file(s) (a lock held by another transaction, or a "
                    "server that does not answer)"
                )
            if progress.last_error:
                reason += f"; last error: {progress.last_error}"
            log.error("spool_stuck", **self.figures(), reason=reason)
            raise Stuck(reason)

    def figures(self) -> dict[str, Any]:
        figures = self.progress.as_dict(pending=len(self.files))
        done = figures["applied"] + figures["duplicates"] + figures["quarantined"]
        figures["rate_files_per_s"] = self.rate.add(time.monotonic(), done)
        return figures


def read_outcome(
    spool: Spool, name: str, limits: Limits, dir_fd: int, settle: float
) -> tuple[Entry | None, str, str, float]:
    """One file through the reader stage: (entry, "", "", 0) for the writer, or (None,
    outcome, detail, delay) to report at once. The same for both entry points."""
    try:
        entry = read_entry(spool, name, limits, dir_fd=dir_fd, settle=settle)
    except NotYet as wait:
        return None, RETRY, str(wait), wait.delay
    except BlobStoreError as exc:
        log.warning("blob_store_failed", file=name, error=str(exc.__cause__))
        return None, RETRY, f"{exc} (HOLDFAST_BLOB_DIR)", READ_RETRY_SECONDS
    except OSError as exc:
        log.warning("submission_unreadable", file=name, error=str(exc))
        return None, RETRY, f"cannot read {name}: {exc}", READ_RETRY_SECONDS
    if entry is None:
        return None, GONE, "", 0.0
    return entry, "", "", 0.0


# --- one process: the job handler ----------------------------------------------------


def drain(
    spool: Spool,
    *,
    limits: Limits | None = None,
    stuck_after: float = 60.0,
    writer: Writer | None = None,
    should_stop: Callable[[], bool] | None = None,
    poll_seconds: float = 0.05,
    grace: float | None = None,
    settle: float | None = None,
) -> Progress:
    """Apply or quarantine everything in ``incoming/`` in this process, then return.

    Raises :class:`Stuck` (files untouched) when nothing reaches a terminal state for
    ``stuck_after`` seconds while work is pending, on time even while the database blocks
    the writer (its lock waits end at the stuck deadline), and :class:`Overdue` (files
    untouched) when a file has waited longer than ``grace`` seconds (default: the setting).
    """
    limits = limits or Limits.from_settings()
    grace = grace_seconds() if grace is None else grace
    settle = settle_seconds() if settle is None else settle
    spool.ensure()
    monitor = Monitor(spool, stuck_after=stuck_after, grace=grace)
    writer = Writer(spool) if writer is None else writer
    writer.report, writer.report_error = monitor.outcome, monitor.error
    writer.deadline = monitor.deadline
    directory = open_dir(spool.incoming)
    held: Entry | None = None  # read, but it did not fit in the writer's batch
    try:
        while True:
            if should_stop is not None and should_stop():
                if writer.buffer and not writer.retrying:
                    writer.flush()
                for entry in [*writer.drop(), *([held] if held else [])]:
                    monitor.outcome(entry.name, RETRY, "", 0.0)
                return monitor.progress
            now = time.monotonic()
            if monitor.scan_due(now):
                monitor.scan(now)
                directory = current_dir(spool.incoming, directory)
            while writer.accepting:
                if held is None:
                    taken = monitor.take(1)
                    if not taken:
                        break
                    found, outcome, detail, delay = read_outcome(
                        spool, taken[0], limits, directory, settle
                    )
                    if found is None:
                        monitor.outcome(taken[0], outcome, detail, delay)
                        continue
                    held = found
                if not writer.room(held.size):
                    break
                writer.add(held)
                held = None
            if writer.due(idle=True):
                writer.flush()
            if monitor.drained:
                monitor.scan()
                if monitor.drained:
                    return monitor.progress
            monitor.check()
            if writer.buffer or held is not None or not monitor.todo:
                wait = writer.wait_seconds()
                retry = monitor.next_retry_in()
                if retry is not None:
                    wait = min(wait, retry)
                time.sleep(min(max(wait, poll_seconds), 1.0))
    finally:
        os.close(directory)
