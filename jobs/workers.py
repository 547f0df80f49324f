"""The worker registry: one row per worker process, its heartbeat, and pruning of gone ones.

Liveness (live/gone) is read by ``jobs.status.worker_liveness``; the process itself is
``jobs.worker``. On SQLite, also the one remedy for a worker frozen inside a transaction
(``FrozenHolderWatch``).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db.models import BooleanField, ExpressionWrapper, Q
from django.db.models.functions import Now

from . import sql
from .log import get_logger
from .models import Job, State, Worker
from .status import worker_liveness

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


def live_twin(worker_id: str) -> str | None:
    """What holds ``worker_id`` now, if another live process does; else None.

    Two processes with one id would release each other's jobs (a worker gives back, after
    an outage, the jobs leased to its id that it is not running) and mark each other
    stopped. Live means: not stopped, its heartbeat younger than the live/gone rule's
    ``stale_after`` (``jobs.status.worker_liveness``) and, on this host, its process still
    running with a start that matches its row (a worker killed and restarted at once under
    its fixed id is not its own twin)."""
    row = (
        Worker.objects.filter(
            pk=worker_id, stopped_at__isnull=True, heartbeat_at__gte=worker_liveness().cutoff
        )
        .values("host", "pid", "started_at", "heartbeat_at")
        .first()
    )
    if row is None:
        return None
    here = row["host"] == socket.gethostname()
    if here:
        process = process_state(row["pid"])
        if row["pid"] == os.getpid() or process is None:
            return None
        if process[1] > row["started_at"].timestamp() + START_SLACK_SECONDS:
            return None  # a later process reusing the pid
    return f"pid {row['pid']} on host {row['host']}, its last heartbeat at {row['heartbeat_at']}"


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


class FrozenHolderWatch:
    """SQLite only: kill (SIGKILL) a worker of this host that holds the write lock of the
    database (per ``/proc/locks``) while it is stopped (SIGSTOP, a debugger: process state
    ``T``), once it has kept it long enough to be frozen rather than paused.

    PostgreSQL ends a frozen session itself (``idle_in_transaction_session_timeout``);
    SQLite has no server, and a process stopped inside a transaction holds its one write
    lock until it is continued or killed: no reclaim, heartbeat, claim or registration of
    any process can commit meanwhile (I3). Killing it frees the lock at once and rolls its
    transaction back; its job, if it had one, is then reclaimed as a dead worker's.

    Long enough means: its lease expired (it was running a job: frozen inside
    ``ctx.atomic()``), or, holding no job (frozen inside its claim, its worker row's
    heartbeat, a reclaim), found stopped with the lock at two looks ``patience`` seconds
    or more apart (the lease keepers look every reclaim interval). A stopped worker whose
    lease is still live is left alone until it expires. Only the process the kernel names
    as the lock's holder is signalled, only a worker of this host whose start matches its
    row: a stopped process that is not a worker (a shell), or a stopped worker that holds
    nothing, is left alone.
    """

    def __init__(self, patience: float) -> None:
        self.patience = patience
        self._suspect: tuple[int, float] | None = None  # (pid, process start)
        self._suspect_since = 0.0  # monotonic: first found stopped with the lock

    def check(self, database: str | None = None) -> list[str]:
        """One look at ``database`` (default: this thread's connection's file); returns
        the ids of the processes killed (none, or the holder's)."""
        if database is None:
            from django.db import connection

            database = str(connection.settings_dict["NAME"])
        holder = write_lock_holder(database)
        found = service = None
        if holder is not None and holder != os.getpid():
            found = _stopped_worker(holder)
            service = None if found is not None else _stopped_service(holder)
        if holder is None or (found is None and service is None):
            self._suspect = None
            return []
        if service is not None:
            return self._after_patience(holder, service[1], service[0], "")
        assert found is not None
        worker_id, started = found
        expires = ExpressionWrapper(Q(lease_expires_at__lt=Now()), output_field=BooleanField())
        running = dict(
            Job.objects.filter(state=State.RUNNING, leased_by=worker_id)
            .annotate(expired=expires)
            .values_list("pk", "expired")
        )
        expired = [job_id for job_id, is_expired in running.items() if is_expired]
        if expired:
            reason = (
                "it held the database's write lock while stopped (SIGSTOP or a debugger) "
                "with an expired lease: SQLite has no server to end its transaction"
            )
            return _kill_holder(worker_id, holder, expired, reason)
        if running:
            return []  # frozen inside its job: killed once its lease expires
        return self._after_patience(holder, started, worker_id, ", running no job,")

    def _after_patience(self, holder: int, started: float, name: str, doing: str) -> list[str]:
        """Kill ``holder`` once it was found stopped with the lock at two looks
        ``patience`` seconds or more apart (not paused a moment by a debugger's step)."""
        now = time.monotonic()
        if self._suspect != (holder, started):
            self._suspect, self._suspect_since = (holder, started), now
            return []
        if now - self._suspect_since < self.patience:
            return []
        reason = (
            f"it held the database's write lock while stopped (SIGSTOP or a debugger)"
            f"{doing} for {now - self._suspect_since:.0f} s: SQLite has no server "
            "to end its transaction"
        )
        return _kill_holder(name, holder, [], reason)


def _stopped_worker(pid: int) -> tuple[str, float] | None:
    """(worker id, process start) if ``pid`` is a stopped worker of this host whose start
    matches its row (a reused pid started after the row was written); else None."""
    process = process_state(pid)
    if process is None or process[0] not in ("T", "t"):
        return None
    started = process[1]
    rows = Worker.objects.filter(
        pid=pid, host=socket.gethostname(), stopped_at__isnull=True
    ).values_list("pk", "started_at")
    matching = [
        (started_at, worker_id)
        for worker_id, started_at in rows
        if started <= started_at.timestamp() + START_SLACK_SECONDS
    ]
    if not matching:
        return None
    return max(matching)[1], started  # the row it registered last


#: Holdfast's own processes that are not workers but write: a stopped one holding the lock
#: is killed too (their transactions are crash-safe: a slot is enqueued once (I5), a spool
#: batch is applied once or not at all (I6)). The ingester's writer is its child.
SERVICES = ("runscheduler", "ingest_submissions")


def _stopped_service(pid: int) -> tuple[str, float] | None:
    """(a name such as ``runscheduler (pid 7)``, process start) if ``pid`` is a stopped
    scheduler or ingester of this host (or a child of one); else None."""
    process = process_state(pid)
    if process is None or process[0] not in ("T", "t"):
        return None
    for candidate in (pid, _parent(pid)):
        argv = _argv(candidate) if candidate else []
        if (
            argv[1:]
            and Path(argv[0]).name in ("manage.py", "django-admin")
            and (argv[1] in SERVICES)
        ):
            return f"{argv[1]} (pid {pid})", process[1]
    return None


def _argv(pid: int) -> list[str]:
    """``pid``'s command line, the interpreter left out (``manage.py runscheduler …``)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    args = [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]
    return args[1:] if args and "python" in Path(args[0]).name else args


def _parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def _kill_holder(worker_id: str, pid: int, job_ids: list[int], reason: str) -> list[str]:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return []  # gone meanwhile: its lock is free already
    log.error("frozen_worker_killed", worker_id=worker_id, pid=pid, job_ids=job_ids, reason=reason)
    return [worker_id]


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


def process_state(pid: int) -> tuple[str, float] | None:
    """A process's state letter (``R``, ``S``, ``T`` stopped, ``t`` traced…) and its start
    as a Unix time, from ``/proc``; None if it is gone or there is no ``/proc`` (not
    Linux: then nothing is ever signalled)."""
    fields = _stat(pid)
    try:
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    if fields is None:
        return None
    return fields[0], boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after ``pid (comm)``: state, parent pid, …"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()
