"""The scheduler: turns due schedule slots into jobs, exactly once per slot (I5).

Each tick locks every due schedule row in its own transaction (``SKIP LOCKED`` on
PostgreSQL, so concurrent schedulers split the work instead of queueing behind each
other), advances ``next_due_at`` past the slot with an UPDATE guarded by the value it
read, and enqueues that slot's job in the same transaction. Whatever the restarts or the
number of schedulers, a slot is advanced once, and its job exists iff the advance
committed. Time is the database clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import (
    DatabaseError,
    IntegrityError,
    OperationalError,
    connection,
    transaction,
)
from django.db.models import F
from django.db.models.functions import Now

from . import engine, enqueueing, retention, sql
from .exceptions import HoldfastError, LaneFull, StateConflict
from .log import get_logger
from .models import CatchUp, Job, Schedule
from .schedules import catch_up, declared, enqueue_problem, next_slot, slot_key

log = get_logger("jobs.scheduler")

SKIP_GRACE = timedelta(minutes=5)  # with catch_up=skip, a slot later than this is missed
OVERDUE_AFTER = timedelta(minutes=1)  # queue_status flags schedules this far behind
MAX_SLEEP = 5.0  # seconds: wake at least this often (reclaim, clock jumps, new schedules)
# A slot's transaction takes milliseconds; one whose scheduler froze inside it (SIGSTOP, a
# paused VM) is ended by the server after this long, its row lock freed for the others.
SLOT_IDLE_LIMIT = 10.0  # seconds
SCHEDULE_LOCK_WAIT = 3.0  # seconds pause/resume wait for a schedule row another holds


class ScheduleNotFound(HoldfastError, LookupError):
    """No schedule has this name."""


def sync(now: datetime | None = None, origin: str | None = None) -> None:
    """Make the schedule rows match the declarations, at start-up.

    New schedules wait for their next slot (no immediate run); a changed timing is
    recomputed from now; schedules no longer declared are marked so (kept, with their
    history, never deleted silently). ``origin`` (e.g. ``"source"``, from
    ``add_source``): only the schedules of that origin, so that a command run from a
    shell with other settings leaves the rest as the schedulers declared them.
    """
    now = now or engine.db_now()
    wanted = declared()
    rows_of = Schedule.objects.select_for_update()
    if origin is not None:
        wanted = {name: item for name, item in wanted.items() if item.origin == origin}
        rows_of = rows_of.filter(origin=origin)
    with transaction.atomic():
        rows = {row.name: row for row in rows_of}
        for name, declaration in wanted.items():
            definition = declaration.definition()
            row = rows.get(name)
            if row is None:
                _add(name, definition, now)
                continue
            timing = ("cron", "every", "timezone")
            retimed = any(getattr(row, key) != definition[key] for key in timing)
            changed = any(getattr(row, key) != value for key, value in definition.items())
            if not (changed or not row.declared):
                continue
            for key, value in definition.items():
                setattr(row, key, value)
            if retimed or not row.declared:
                row.next_due_at = next_slot(row.cron, row.every, row.timezone, now)
            row.declared = True
            row.save()
            log.info("schedule_updated", schedule=name, next_due_at=row.next_due_at.isoformat())
        for name, row in rows.items():
            if name not in wanted and row.declared:
                Schedule.objects.filter(pk=row.pk).update(declared=False, updated_at=Now())
                log.warning("schedule_undeclared", schedule=name)


def _add(name: str, definition: dict[str, Any], now: datetime) -> None:
    due = next_slot(definition["cron"], definition["every"], definition["timezone"], now)
    try:
        with transaction.atomic():
            Schedule.objects.create(name=name, next_due_at=due, **definition)
    except IntegrityError:
        return  # another scheduler added it at the same moment
    log.info("schedule_added", schedule=name, next_due_at=due.isoformat())


def tick(
    now: datetime | None = None,
    between: Callable[[], None] | None = None,
    unserved: set[int] | None = None,
) -> list[int]:
    """Enqueue the job of every due slot; returns the ids of the jobs enqueued. ``between``
    runs after each slot (the lease keeper's heartbeat, in ``runworker --with-scheduler``).

    A schedule this process cannot enqueue (its kind or lane unknown here: a scheduler of
    another version, during a rolling deploy) is left due, not advanced, for a scheduler
    that can: its slot is not spent on a refusal. A schedule whose slot cannot be computed
    (its row holds a timing no longer accepted) is left so too, with its error logged, and
    the others still tick. Either way its primary key joins ``unserved`` (logged once).
    """
    now = now or engine.db_now()
    unserved = set() if unserved is None else unserved
    due = Schedule.objects.filter(declared=True, paused=False, next_due_at__lte=now)
    enqueued = []
    for row in due.exclude(pk__in=unserved).only("pk", "name", "kind", "lane"):
        if problem := enqueue_problem(row):
            unserved.add(row.pk)
            log.warning("schedule_not_served_here", schedule=row.name, error=problem)
            continue
        try:
            job_id = _advance(row.pk, now)
        except DatabaseError:
            raise  # an outage: the caller's to retry
        except Exception:
            unserved.add(row.pk)
            log.exception("schedule_failed", schedule=row.name)
            continue
        if job_id is not None:
            enqueued.append(job_id)
        if between is not None:
            between()
    return enqueued


def _advance(pk: int, now: datetime) -> int | None:
    with transaction.atomic():
        sql.end_session_if_frozen(SLOT_IDLE_LIMIT)  # a frozen scheduler stalls no schedule
        row = (
            Schedule.objects.select_for_update(skip_locked=True)
            .filter(pk=pk, declared=True, paused=False, next_due_at__lte=now)
            .first()
        )
        if row is None:
            return None  # another scheduler holds it, or already advanced it
        latest, following = catch_up(row.cron, row.every, row.timezone, row.next_due_at, now)
        run = latest if row.catch_up == CatchUp.ONCE or now - latest <= SKIP_GRACE else None
        advanced = Schedule.objects.filter(pk=pk, next_due_at=row.next_due_at).update(
            next_due_at=following,
            last_slot_at=run if run is not None else F("last_slot_at"),
            updated_at=Now(),
        )
        if not advanced:
            return None
        if run is None:
            log.info(
                "schedule_slot_skipped",
                schedule=row.name,
                slot=latest.isoformat(),
                next_due_at=following.isoformat(),
            )
            return None
        job = _enqueue_slot(row, slot_key(row.name, run))
        if job is not None:
            Schedule.objects.filter(pk=pk).update(last_job_id=job.pk)
            log.info(
                "schedule_enqueued",
                schedule=row.name,
                slot=run.isoformat(),
                job_id=job.pk,
                next_due_at=following.isoformat(),
                missed=latest != row.next_due_at,
            )
        return job.pk if job is not None else None


def _enqueue_slot(row: Schedule, unique_key: str) -> Job | None:
    """Enqueue a schedule's job; a refusal is logged and the schedule still advances."""
    try:
        with transaction.atomic():
            return enqueueing.enqueue(row.kind, row.args, lane=row.lane, unique_key=unique_key)
    except HoldfastError as exc:
        log.error("schedule_enqueue_failed", schedule=row.name, kind=row.kind, error=str(exc))
        return None


def get(name: str) -> Schedule:
    try:
        return Schedule.objects.get(name=name)
    except Schedule.DoesNotExist:
        raise ScheduleNotFound(f"no schedule named {name!r}") from None


def pause(name: str, actor: str = "operator") -> Schedule:
    get(name)
    with _row_waits_bounded(name):
        Schedule.objects.filter(name=name).update(paused=True, updated_at=Now())
    log.info("schedule_paused", schedule=name, by=actor)
    return get(name)


def resume(name: str, actor: str = "operator") -> Schedule:
    """Resume a paused schedule from its next slot: slots missed while paused do not run."""
    row = get(name)
    if row.paused:
        due = next_slot(row.cron, row.every, row.timezone, engine.db_now())
        with _row_waits_bounded(name):
            Schedule.objects.filter(name=name).update(
                paused=False, next_due_at=due, updated_at=Now()
            )
        log.info("schedule_resumed", schedule=name, by=actor, next_due_at=due.isoformat())
    return get(name)


@contextmanager
def _row_waits_bounded(name: str) -> Iterator[None]:
    """An operator's write to a schedule row waits ``SCHEDULE_LOCK_WAIT`` at most for a
    scheduler's slot transaction (a frozen one holds the row until the server ends it),
    then says so: StateConflict, nothing changed."""
    try:
        with sql.lock_waits_bounded(SCHEDULE_LOCK_WAIT):
            yield
    except OperationalError as exc:
        if not sql.is_lock_wait(exc):
            raise
        ends = (
            f"the server ends such a session within {SLOT_IDLE_LIMIT:g} s"
            if sql.is_postgres()
            else "it holds the database's write lock until it goes on or is killed"
        )
        raise StateConflict(
            f"schedule {name!r} is locked by a scheduler's open transaction (it may be "
            f"frozen; {ends}): nothing changed, try again"
        ) from None


def run_now(name: str, actor: str = "operator") -> Job:
    """Enqueue a schedule's job now, outside its slots; the next slot is not disturbed.

    While such a manual run is queued or running, asking again returns that job.
    """
    row = get(name)
    if not row.declared:  # its source disabled, or its code or setting removed
        raise StateConflict(
            f"schedule {name!r} is no longer declared (a disabled source, or removed from "
            "code or settings): nothing to run"
        )
    job = enqueueing.enqueue(
        row.kind, row.args, lane=row.lane, unique_key=f"schedule:{name}:manual"
    )
    if job is None:
        raise LaneFull(f"the lane of schedule {name!r} is full and drops new jobs")
    log.info("schedule_run_now", schedule=name, job_id=job.pk, by=actor)
    return job


def overdue(now: datetime) -> list[dict[str, Any]]:
    """Active schedules whose slot is well past: no scheduler is running (or keeping up)."""
    late = Schedule.objects.filter(
        declared=True, paused=False, next_due_at__lt=now - OVERDUE_AFTER
    ).order_by("next_due_at")
    return [
        {
            "name": row.name,
            "kind": row.kind,
            "next_due_at": row.next_due_at.isoformat(),
            "overdue_s": round((now - row.next_due_at).total_seconds(), 1),
        }
        for row in late
    ]


class SchedulerLoop:
    """``runscheduler``'s loop. In ``runworker --with-scheduler`` the worker's lease keeper
    runs its passes instead (``run_once``, renewing its lease in ``between``), on the
    keeper's connection: a worker uses two connections, with the scheduler or without.

    Every pass reclaims expired leases and ticks; it then sleeps until the next due slot,
    at most ``MAX_SLEEP`` seconds, measured on the monotonic clock and recomputed from the
    database clock each pass, so a suspend/resume or wall-clock jump only delays one pass.
    """

    def __init__(self, stop: threading.Event | None = None) -> None:
        self.stop = stop or threading.Event()
        self.retention = retention.Retention()
        self._synced = False
        self.unserved: set[int] = set()  # schedules this process cannot tick (``tick``)
        self.reclaim_hold = engine.ReclaimHold()
        from .workers import FrozenHolderWatch  # it imports status, which imports this

        self._frozen_watch = FrozenHolderWatch(float(settings.HOLDFAST_RECLAIM_SECONDS))

    def run(self) -> None:
        delay = 0.5
        sqlite = not sql.is_postgres()
        look_every = float(settings.HOLDFAST_RECLAIM_SECONDS)
        if sqlite:  # a held write lock fails a pass in time for the next look
            sql.sqlite_busy_timeout(int(look_every * 1000 / 2))
        while not self.stop.is_set():
            if sqlite:
                self._end_frozen_holder()
            try:
                sleep = self.synced_pass()
                delay = 0.5
            except DatabaseError as exc:
                if not sql.unavailable(exc):
                    raise
                log.error(
                    "database_unavailable",
                    during="scheduler",
                    error=str(exc).strip(),
                    retry_in=delay,
                )
                self.reclaim_hold.note(exc)
                connection.close()
                sleep, delay = delay, min(delay * 2, 30.0)
            self.stop.wait(min(sleep, look_every) if sqlite else sleep)
        connection.close()

    def _end_frozen_holder(self) -> None:
        """SQLite: one look of ``workers.FrozenHolderWatch`` at the database's write lock,
        as each worker's lease keeper makes. A worker frozen (SIGSTOP) inside a
        transaction holds that lock, and with it every write of the installation: with
        one worker and this scheduler, nobody else looked, and its job stayed running
        with every write refused until someone killed it by hand (I3)."""
        try:
            self._frozen_watch.check()
        except DatabaseError as exc:
            log.warning("frozen_holder_check_failed", error=str(exc).strip())
            connection.close()

    def synced_pass(self, between: Callable[[], None] | None = None) -> float:
        """A pass of a running loop: the first one syncs the schedule rows first (again
        after a failed sync). ``between`` given (a worker's lease keeper, which reclaims
        on its own): no reclaim here, ``between`` after each transaction."""
        if not self._synced:
            sync()
            self._synced = True
        return self.run_once(reclaim=between is None, between=between)

    def run_once(self, reclaim: bool = True, between: Callable[[], None] | None = None) -> float:
        """One pass; returns how long to sleep before the next. ``reclaim=False`` when the
        caller reclaims on its own; ``between`` runs between the pass's transactions."""
        if reclaim and not self.reclaim_hold.held():
            engine.reclaim_expired()
        now = engine.db_now()
        tick(now, between, self.unserved)
        self.retention.run_if_due(time.monotonic(), between)  # built-in retention, batched
        upcoming = (
            Schedule.objects.filter(declared=True, paused=False)
            .exclude(pk__in=self.unserved)
            .order_by("next_due_at")
            .values_list("next_due_at", flat=True)
            .first()
        )
        if upcoming is None:
            return MAX_SLEEP
        return min(MAX_SLEEP, max(0.05, (upcoming - now).total_seconds()))
