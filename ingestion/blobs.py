"""The content-addressed blob store: bytes kept under their sha256 in ``HOLDFAST_BLOB_DIR``.

A blob lives at ``<root>/<h[:2]>/<h[2:4]>/<h>``. Storing writes a temporary file in the
same directory, fsyncs it, renames it into place and fsyncs the directory; a shard
directory it had to create is fsynced into its parent too, so after a crash a blob whose
row committed is still reachable. A reader never sees a partial blob, and a crash leaves
at most a stray ``.tmp-*`` file, which :func:`collect` removes. Storing the same bytes
twice is harmless (the second store finds the blob and only refreshes its mtime, which
tells :func:`collect` it is in use; a lock on the shard directory keeps a collection from
deleting it between the two, :func:`shard_lock`), which is what lets a retried spool
batch upload its log excerpts again safely.

:func:`collect` (``manage.py gc_blobs``) deletes the blobs nothing references: no
artifact's body, indexed text or spool submission's log excerpt. It never deletes a blob
younger than its age threshold, so one stored for a row that has not committed yet (a
fetch, a spool apply in progress) is safe.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from django.conf import settings


def root() -> Path:
    return Path(settings.HOLDFAST_BLOB_DIR)


def path_for(digest: str, base: Path | None = None) -> Path:
    """Where the blob with this sha256 (hex) lives."""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"not a sha256 hex digest: {digest!r}")
    return (base or root()) / digest[:2] / digest[2:4] / digest


def exists(digest: str, base: Path | None = None) -> bool:
    return path_for(digest, base).is_file()


def read(digest: str, base: Path | None = None) -> bytes:
    return path_for(digest, base).read_bytes()


def store(data: bytes, base: Path | None = None) -> str:
    """Keep ``data`` durably under its sha256 and return the digest (hex)."""
    digest = hashlib.sha256(data).hexdigest()
    target = path_for(digest, base)
    _make_dirs(target.parent)
    with shard_lock(target.parent, exclusive=False):
        if target.is_file() and target.stat().st_size == len(data):
            with contextlib.suppress(PermissionError):  # a store another user owns
                os.utime(target)  # in use again: a collection running now must keep it
            return digest
        write_durably(target, data)
    return digest


def write_durably(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` all or nothing: a temporary file beside it, flushed to
    disk, renamed over it, and the directory flushed, so a crash leaves the old file or
    the new one, never a torn one (a leftover ``.tmp-*`` is what ``gc_blobs`` cleans)."""
    fd, tmp_name = tempfile.mkstemp(prefix=TMP_PREFIX, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


@contextlib.contextmanager
def shard_lock(directory: Path, *, exclusive: bool) -> Iterator[None]:
    """An advisory lock on a shard directory (``flock``, across processes): storing holds
    it shared from "is the blob there?" to its rename, :func:`collect` exclusive from its
    last look at a blob's age to the unlink. So a store that finds an old blob and only
    refreshes its age cannot have it deleted under it: either the collection removed it
    first (and the store writes it afresh) or it sees the new age and keeps it."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def _make_dirs(directory: Path) -> None:
    """Create ``directory`` and missing parents, each made durable in its own parent."""
    missing = []
    current = directory
    while not current.is_dir():
        missing.append(current)
        current = current.parent
    for created in reversed(missing):
        try:
            created.mkdir()
        except FileExistsError:
            continue  # another process made it (and fsyncs it)
        fsync_dir(created.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- collection --------------------------------------------------------------------------

TMP_PREFIX = ".tmp-"
TMP_MAX_AGE = timedelta(hours=1)  # a write takes seconds; an older temporary file is a crash's
DEFAULT_MIN_AGE = timedelta(days=1)


@dataclass
class Collected:
    removed: int = 0
    removed_bytes: int = 0
    referenced: int = 0
    young: int = 0  # unreferenced, but newer than the threshold: maybe in use now
    temporary: int = 0  # stale .tmp-* files removed
    dry_run: bool = False
    examples: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "removed": self.removed,
            "removed_bytes": self.removed_bytes,
            "referenced": self.referenced,
            "kept_young": self.young,
            "temporary_removed": self.temporary,
            "dry_run": self.dry_run,
        }


ReferenceSource = Callable[[str], Iterable[str]]
#: ``func(prefix) -> digests`` of every table that references blobs, given a first hex digit.
references: list[ReferenceSource] = []


def collect(
    *, dry_run: bool = False, min_age: timedelta = DEFAULT_MIN_AGE, base: Path | None = None
) -> Collected:
    """Delete blobs no row references and stale temporary files; with ``dry_run``, count.

    The store is walked in 16 parts (by the first hex digit), each with the references
    of that part only, so memory stays bounded however many blobs there are. A blob is
    deleted only if no reference names it and its mtime is older than ``min_age``, checked
    again just before the unlink (a store of the same bytes refreshes the mtime).
    """
    store_root = base or root()
    report = Collected(dry_run=dry_run)
    if not store_root.is_dir():
        return report
    now = time.time()
    for digit in "0123456789abcdef":
        shards = sorted(store_root.glob(f"{digit}?/??"))
        if not shards:
            continue
        referenced = {digest for source in references for digest in source(digit)}
        for shard in shards:
            removed_here = False
            for entry in shard.iterdir():
                removed_here |= _collect_one(entry, referenced, now, min_age, report)
            if removed_here and not dry_run:
                fsync_dir(shard)
    return report


def _collect_one(
    entry: Path, referenced: set[str], now: float, min_age: timedelta, report: Collected
) -> bool:
    try:
        stat = entry.stat()
    except FileNotFoundError:
        return False
    if entry.name.startswith(TMP_PREFIX):
        if now - stat.st_mtime > TMP_MAX_AGE.total_seconds():
            report.temporary += 1
            if not report.dry_run:
                entry.unlink(missing_ok=True)
                return True
        return False
    if entry.name in referenced:
        report.referenced += 1
        return False
    if now - stat.st_mtime <= min_age.total_seconds():
        report.young += 1
        return False
    if not report.dry_run:
        with shard_lock(entry.parent, exclusive=True):  # no store between look and unlink
            try:
                if now - entry.stat().st_mtime <= min_age.total_seconds():
                    report.young += 1  # stored again since the walk started
                    return False
            except FileNotFoundError:
                return False
            entry.unlink()
    report.removed += 1
    report.removed_bytes += stat.st_size
    if len(report.examples) < 10:
        report.examples.append(entry.name)
    return not report.dry_run
