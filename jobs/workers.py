"""The worker registry: one row per worker process, its heartbeat, and pruning of gone ones.

Liveness (live/gone) is read by ``jobs.status.worker_liveness``; the process itself is
``jobs.worker``. On SQLite, also the one remedy for a worker frozen inside a transaction
(``end_frozen_holders``).
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db.models.functions import Now

from . import sql
from .log import get_logger
from .models import Job, State, Worker

log = get_logger("jobs.workers")

# --- workers ---------------------------------------------------------------------------


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def register_worker(
    worker_id: str, lanes: Sequence[str] | None, kinds: Sequence[str] | None = None
) -> None:
    """Record a starting worker: where it runs, the lanes and the job kinds it serves."""
    Worker.objects.update_or_create(
        pk=worker_id,
        defaults={
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "lanes": list(lanes) if lanes is not None else [],
            "kinds": sorted(kinds) if kinds is not None else None,
            "started_at": Now(),
            "heartbeat_at": Now(),
            "stopped_at": None,
            "current_job": None,
        },
    )
    log.info("worker_started", worker_id=worker_id, lanes=list(lanes) if lanes else "all")
    sql.warn_if_jit()
    sql.analyze_if_never_analyzed()


def worker_heartbeat(worker_id: str, current_job: int | None) -> None:
    Worker.objects.filter(pk=worker_id).update(heartbeat_at=Now(), current_job=current_job)


def worker_stopped(worker_id: str) -> None:
    Worker.objects.filter(pk=worker_id).update(stopped_at=Now(), current_job=None)
    log.info("worker_stopped", worker_id=worker_id)


def prune_workers(retention_seconds: float | None = None, batch: int = 1000) -> int:
    """Delete the rows of workers whose last heartbeat is older than the retention
    (``HOLDFAST_WORKER_RETENTION_SECONDS``; stopped or gone alike), at most ``batch`` per
    call: a bounded read and, when it found rows, a bounded delete; run by every worker's
    reclaimer thread after its reclaim passes."""
    if retention_seconds is None:
        retention_seconds = float(settings.HOLDFAST_WORKER_RETENTION_SECONDS)
    cutoff = Now() - timedelta(seconds=retention_seconds)
    expired = list(
        Worker.objects.filter(heartbeat_at__lt=cutoff)
        .order_by("heartbeat_at")
        .values_list("pk", flat=True)[:batch]
    )
    if not expired:
        return 0  # the usual pass: one read, no write (and no SQLite write lock)
    deleted, _ = Worker.objects.filter(pk__in=expired, heartbeat_at__lt=cutoff).delete()
    if deleted:
        log.info("workers_pruned", count=deleted, retention_s=retention_seconds)
    return deleted


# --- SQLite: a worker frozen while it holds the write lock -------------------------------

#: How much later than its worker row's ``started_at`` a process may have started and
#: still be that worker (``/proc/stat``'s boot time is in whole seconds). A process that
#: started later holds a reused pid: it is never signalled.
START_SLACK_SECONDS = 2.0


def end_frozen_holders(database: str) -> list[str]:
    """SQLite only: kill (SIGKILL) the worker of this host that holds the write lock of
    ``database`` (per ``/proc/locks``) while it is stopped (SIGSTOP, a debugger: process
    state ``T``) with an expired lease.

    PostgreSQL ends a frozen session itself (``idle_in_transaction_session_timeout``);
    SQLite has no server, and a process stopped inside a transaction holds its one write
    lock until it is continued or killed: no reclaim, heartbeat or claim of any process
    can commit meanwhile (I3). Killing it frees the lock at once and rolls its transaction
    back; its job, whose lease expired, is then reclaimed as a dead worker's would be.
    Only the process the kernel names as the lock's holder is signalled, only a worker of
    this host whose start matches its row; a stopped worker that holds nothing is left
    alone. Returns the ids of the workers killed."""
    candidates = _stopped_with_expired_leases()
    if not candidates:
        return []
    holder = write_lock_holder(database)
    killed = []
    for worker_id, pid, jobs in candidates:
        if pid != holder:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue  # gone meanwhile: its lock is free already
        killed.append(worker_id)
        log.error(
            "frozen_worker_killed",
            worker_id=worker_id,
            pid=pid,
            job_ids=jobs,
            reason="it held the database's write lock while stopped (SIGSTOP or a "
            "debugger) with an expired lease: SQLite has no server to end its transaction",
        )
    return killed


#: The byte of a SQLite WAL database's ``-shm`` file whose POSIX lock is the write lock
#: (WALINDEX_LOCK_OFFSET 120, lock slot 0).
WAL_WRITE_LOCK_BYTE = 120


def write_lock_holder(database: str) -> int | None:
    """The pid holding the WAL write lock of the SQLite file ``database``, from
    ``/proc/locks``; None when nobody does, or it cannot be told (no ``/proc``)."""
    try:
        shm = os.stat(f"{database}-shm")
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 8 or fields[1] != "POSIX" or fields[3] != "WRITE":
            continue  # a waiter ("->"), a flock, a read lock
        try:
            major, minor, inode = fields[5].split(":")
            first, last = int(fields[6]), int(fields[7]) if fields[7] != "EOF" else None
            same_file = (int(major, 16), int(minor, 16), int(inode)) == (
                os.major(shm.st_dev),
                os.minor(shm.st_dev),
                shm.st_ino,
            )
            pid = int(fields[4])
        except ValueError:
            continue
        covers = first <= WAL_WRITE_LOCK_BYTE and (last is None or last >= WAL_WRITE_LOCK_BYTE)
        if same_file and covers:
            return pid
    return None


def _stopped_with_expired_leases() -> list[tuple[str, int, list[int]]]:
    """(worker id, pid, its expired jobs) of this host's stopped workers; a read only."""
    expired: dict[str, list[int]] = {}
    for job_id, worker_id in Job.objects.filter(
        state=State.RUNNING, lease_expires_at__lt=Now()
    ).values_list("pk", "leased_by"):
        if worker_id:
            expired.setdefault(worker_id, []).append(job_id)
    if not expired:
        return []
    found = []
    rows = Worker.objects.filter(
        pk__in=list(expired), host=socket.gethostname(), stopped_at__isnull=True
    ).values_list("pk", "pid", "started_at")
    for worker_id, pid, started_at in rows:
        if pid == os.getpid():
            continue
        process = process_state(pid)
        if process is None:
            continue
        state, started = process
        if state in ("T", "t") and started <= started_at.timestamp() + START_SLACK_SECONDS:
            found.append((worker_id, pid, expired[worker_id]))
    return found


def process_state(pid: int) -> tuple[str, float] | None:
    """A process's state letter (``R``, ``S``, ``T`` stopped, ``t`` traced…) and its start
    as a Unix time, from ``/proc``; None if it is gone or there is no ``/proc`` (not
    Linux: then nothing is ever signalled)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return fields[0], boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
