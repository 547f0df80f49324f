"""The job engine: an attempt's transitions: claim, settle, fence, heartbeat, reclaim.

The job's other transitions sit in two neighbours: ``jobs.enqueueing`` creates queued
rows, ``jobs.operations`` holds the operator's (requeue, cancel, prune). In all three,
each transition is one statement or one ``transaction.atomic()`` block whose guard
(``state``, ``lease_token``, lease expiry) is visible where it is written. The hot-path
statements (claim, settle, heartbeat, reclaim) are in ``jobs.sql``; the rest is ORM.
Every transition logs one structlog event.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, connection, transaction
from django.db.models import QuerySet, Subquery
from django.db.models.functions import Now
from django.utils import timezone

from . import lanes as lane_config
from . import notify, sql
from .exceptions import (
    LeaseLost,
)
from .log import get_logger
from .models import Job, JobEvent, JobLock, Lease, Outcome, State, Worker
from .registry import all_handlers
from .sql import Claimed, Settlement

log = get_logger("jobs.engine")

NOTIFY_CHANNEL = notify.NOTIFY_CHANNEL
CANCEL_CHANNEL = notify.CANCEL_CHANNEL  # payload: the job id whose cancellation was requested
MAX_ERROR_MESSAGE = 10_000
MAX_TRACEBACK = 50_000


# --- claim and settle ------------------------------------------------------------------


def job_log_context(job: Claimed, worker_id: str | None = None) -> dict[str, Any]:
    """The fields every log line about this attempt carries."""
    context = {
        "job_id": job.id,
        "kind": job.kind,
        "lane": job.lane,
        "attempt": job.attempt,
        "lease_token": job.lease_token,
    }
    if worker_id is not None:
        context["worker_id"] = worker_id
    return context


def claim(
    worker_id: str,
    lanes: Sequence[str] | None = None,
    limits: Mapping[str, int] | None = None,
    kinds: Sequence[str] | None = None,
) -> Claimed | None:
    """Claim the best runnable job under a fresh lease (I1): one atomic statement.

    ``limits`` (lane → max_running, default: from ``HOLDFAST_LANES``) keeps limited lanes
    within their running limit across all workers. Only jobs of ``kinds`` are claimed
    (default: every kind registered in this process), so a job no handler here can run
    stays queued, uncharged, for a worker that knows it.
    """
    if limits is None:
        limits = lane_config.running_limits(lanes)
    if kinds is None:
        kinds = served_kinds()
    job = sql.claim(worker_id, lanes, limits, kinds)
    _log_claimed(job, worker_id)
    return job


@dataclass(frozen=True)
class Failure:
    error_class: str
    message: str
    traceback: str
    context: dict[str, Any]
    permanent: bool = False


@dataclass(frozen=True)
class Verdict:
    """How an attempt ends, decided by the worker and written by ``settle``."""

    how: Settlement
    event: str
    fields: dict[str, Any]


def succeeded(result: Any = None) -> Verdict:
    return Verdict(
        Settlement(State.SUCCEEDED, Outcome.SUCCEEDED, result=result), "job_succeeded", {}
    )


def failed(job: Claimed, failure: Failure, backoff_seconds: float) -> Verdict:
    """Retry after ``backoff_seconds``, or ``dead`` when the error is permanent or spent."""
    dead = failure.permanent or job.attempt >= job.max_attempts
    error_class, message = storable(failure.error_class), storable(failure.message)
    how = Settlement(
        state=State.DEAD if dead else State.QUEUED,
        outcome=Outcome.FAILED,
        delay=0.0 if dead else max(0.0, backoff_seconds),
        last_error=f"{error_class}: {message}"[:MAX_ERROR_MESSAGE],
        error_class=error_class,
        error_message=message[:MAX_ERROR_MESSAGE],
        traceback=storable(failure.traceback)[-MAX_TRACEBACK:],
        context=storable(failure.context),
    )
    if dead:
        return Verdict(how, "job_dead", {"error": how.last_error})
    return Verdict(how, "job_retry_scheduled", {"error": how.last_error, "retry_in": how.delay})


def interrupted(job: Claimed, failure: Failure, delay: float) -> Verdict:
    """The attempt met a database fault (a restart, a failover, a lost prepared statement;
    ``sql.fault``): no failure of the job. It goes back to the queue uncharged, its
    attempt recorded as ``released`` with the error, to run again after ``delay``.

    Unless the job already had ``max_attempts`` such attempts: a job that itself brings the
    database down must still end, so from then on the fault is charged like any error.
    """
    try:
        earlier = (
            Lease.objects.filter(job_id=job.id, outcome=Outcome.RELEASED)
            .exclude(error_class="")
            .count()
        )
    except DatabaseError:
        earlier = 0  # the database is still away: the settle will wait for it
    if earlier >= job.max_attempts:
        return failed(job, failure, delay)
    error_class, message = storable(failure.error_class), storable(failure.message)
    how = Settlement(
        state=State.QUEUED,
        outcome=Outcome.RELEASED,
        delay=max(0.0, delay),
        uncharge=True,
        error_class=error_class,
        error_message=message[:MAX_ERROR_MESSAGE],
        traceback=storable(failure.traceback)[-MAX_TRACEBACK:],
        context=storable(failure.context),
    )
    error = f"{error_class}: {message}"
    return Verdict(how, "job_released", {"reason": "database", "error": error})


def storable(value: Any) -> Any:
    """``value`` with NUL characters and lone surrogates escaped (``\\x00``, ``\\udcff``):
    PostgreSQL text and jsonb cannot hold them, and no UTF-8 log line or database can hold
    a lone surrogate (``os.listdir`` gives one for every undecodable byte of a file name).

    An error message is evidence for the operator; it must be stored, not refused.
    """
    if isinstance(value, str):
        value = value.replace("\x00", "\\x00")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {storable(str(key)): storable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [storable(item) for item in value]
    return value


# The common verdict, built once: the handler returned None.
SUCCEEDED = succeeded(None)
# Graceful shutdown gives the job back: queued again, this attempt not charged.
RELEASED = Verdict(Settlement(State.QUEUED, Outcome.RELEASED, uncharge=True), "job_released", {})
# The handler honoured a cancellation request.
CANCELLED = Verdict(
    Settlement(State.CANCELLED, Outcome.CANCELLED, last_error="cancelled on request"),
    "job_cancelled",
    {},
)


# A cancel requested while an earlier attempt ran, which that attempt's settle did not see
# (it was decided a moment before): the job is not run again.
CANCELLED_BEFORE_RUN = Verdict(
    Settlement(
        State.CANCELLED,
        Outcome.CANCELLED,
        uncharge=True,
        last_error="cancelled on request, made while an earlier attempt ran: not run again",
    ),
    "job_cancelled",
    {"before_run": True},
)


def cancelled_on_request(verdict: Verdict) -> Verdict:
    """``verdict`` (a retry, a dead job, a release) of an attempt that ended without
    success after a cancel was requested: the job ends ``cancelled`` as the operator asked,
    instead of running again. The attempt keeps its own outcome and error on its lease row,
    and ``last_error`` says why it ended."""
    how = verdict.how
    reason = how.last_error or (
        f"{how.error_class}: {how.error_message}" if how.error_class else "given back at shutdown"
    )
    text = storable(f"cancelled on request; its attempt ended without stopping: {reason}")
    how = replace(how, state=State.CANCELLED, delay=0.0, last_error=text[:MAX_ERROR_MESSAGE])
    return Verdict(how, "job_cancelled", {"after": verdict.event, "error": reason})


def cancelled_by_handler(reason: str) -> Verdict:
    """The handler raised ``Cancelled`` with no cancel request: its own decision (a
    source removed, say). Its reason is the job's ``last_error``, never "on request"."""
    text = f"cancelled by its handler: {reason}" if reason else "cancelled by its handler"
    how = Settlement(
        State.CANCELLED, Outcome.CANCELLED, last_error=storable(text)[:MAX_ERROR_MESSAGE]
    )
    return Verdict(how, "job_cancelled", {"by": "handler", "reason": how.last_error})


def settle(job: Claimed, verdict: Verdict) -> None:
    """Write ``verdict`` for ``job``, fenced by its lease token; raise LeaseLost otherwise."""
    settled, _ = sql.settle_and_claim(job, verdict.how, None, None)
    _notify_freed(job, settled, None)  # inside ctx.atomic(complete=True): sent at its commit
    if not settled:
        _log_settled(job, verdict, settled)
        raise LeaseLost(f"job {job.id} is no longer running under lease {job.lease_token}")
    # Inside a transaction (ctx.atomic(complete=True)) the settle may still roll back: its
    # line is written when it commits, never for a success that did not happen.
    transaction.on_commit(lambda: _log_settled(job, verdict, True))


def settle_and_claim(
    job: Claimed,
    verdict: Verdict | None,
    worker_id: str | None,
    lanes: Sequence[str] | None,
    limits: Mapping[str, int] | None = None,
    kinds: Sequence[str] | None = None,
) -> Claimed | None:
    """Settle ``job`` and claim the worker's next job in the same commit.

    Either part may be absent: no verdict (the handler completed inside
    ``ctx.atomic(complete=True)``) or no worker id (the worker is stopping). A lost lease
    is logged, not raised: the worker carries on with the next job. The claim takes only
    ``kinds`` (default: every kind registered here).
    """
    if kinds is None and worker_id is not None:
        kinds = served_kinds()
    settled, claimed = sql.settle_and_claim(
        job, verdict.how if verdict else None, worker_id, lanes, limits, kinds
    )
    _notify_freed(job, settled and verdict is not None, limits)
    if verdict is not None:
        _log_settled(job, verdict, settled)
    if worker_id is not None:
        _log_claimed(claimed, worker_id)
    return claimed


def complete(job: Claimed, result: Any = None) -> None:
    """Mark ``job`` succeeded, fenced by its lease token; raise LeaseLost otherwise.

    Called inside ``ctx.atomic(complete=True)`` it commits together with the handler's
    writes (I4).
    """
    settle(job, succeeded(result))


def fail(job: Claimed, failure: Failure, backoff_seconds: float) -> str:
    """Record a failed attempt; returns the job's new state (queued or dead)."""
    verdict = failed(job, failure, backoff_seconds)
    settle(job, verdict)
    return verdict.how.state


def release(job: Claimed) -> None:
    settle(job, RELEASED)


def cancelled(job: Claimed) -> None:
    settle(job, CANCELLED)


# When each attempt this process claimed began (monotonic), for its settle's duration_ms.
_claimed_at: dict[tuple[int, int], float] = {}
# A settle's log level: a dead job wants someone's attention, a retry is a warning.
SETTLE_LEVELS = {"job_dead": "error", "job_retry_scheduled": "warning"}
SETTLE_NUMERIC_LEVELS = {"job_dead": logging.ERROR, "job_retry_scheduled": logging.WARNING}


def _log_claimed(job: Claimed | None, worker_id: str) -> None:
    if job is not None:
        _claimed_at[job.id, job.lease_token] = time.monotonic()
        if log.is_enabled_for(logging.INFO):  # else the line's fields are never built
            log.info(
                "job_claimed",
                expires_at=job.lease_expires_at.isoformat(),
                **job_log_context(job, worker_id),
            )


def _log_settled(job: Claimed, verdict: Verdict, settled: bool) -> bool:
    started = _claimed_at.pop((job.id, job.lease_token), None)
    level = logging.WARNING
    if settled:
        level = SETTLE_NUMERIC_LEVELS.get(verdict.event, logging.INFO)
    if not log.is_enabled_for(level):  # below LOG_LEVEL: the line's fields are never built
        return settled
    identity = job_log_context(job)
    if started is not None:
        identity["duration_ms"] = round((time.monotonic() - started) * 1000, 1)
    if settled:
        getattr(log, SETTLE_LEVELS.get(verdict.event, "info"))(
            verdict.event, **identity, **verdict.fields
        )
    else:
        log.warning("lease_lost", during=verdict.event, **identity)
    return settled


def served_kinds() -> list[str]:
    """The job kinds this process has handlers for: what its workers claim."""
    return [spec.kind for spec in all_handlers()]


def check_lease(job: Claimed, idle_timeout: bool = False) -> None:
    """At the start of a fenced block: raise LeaseLost at once if the lease is gone.

    A read, not a lock: the block holds no lock on the job row while handler code runs, so
    heartbeats, reclaim and cancel never wait behind it. With ``idle_timeout`` (PostgreSQL,
    the outermost block) it also sets ``idle_in_transaction_session_timeout`` to one lease
    for this transaction only, so a worker frozen inside the block (paused VM, SIGSTOP, cut
    network) has its session ended by the server, and with it every lock it holds, within
    a lease.
    """
    if sql.is_postgres() and idle_timeout:
        timeout_ms = str(max(1000, int(job.lease_seconds * 1000)))
        query = (
            "SELECT set_config('idle_in_transaction_session_timeout', %s, true) FROM jobs_job "
            "WHERE id = %s AND state = 'running' AND lease_token = %s"
        )
        params: list[Any] = [timeout_ms, job.id, job.lease_token]
    else:
        query = "SELECT 1 FROM jobs_job WHERE id = %s AND state = 'running' AND lease_token = %s"
        params = [job.id, job.lease_token]
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        if cursor.fetchone() is None:
            raise LeaseLost(f"job {job.id} is no longer running under lease {job.lease_token}")


def fence(job_id: int, lease_token: int, lease_seconds: float | None = None) -> None:
    """Inside a transaction, as its last statement: lock the job row iff it is still ours
    (and renew the lease, with ``lease_seconds``), else raise LeaseLost.

    The row lock lasts only until the commit that follows at once, and it serializes that
    commit with any reclaim or settle of the row: if a reclaimer got the row first, this
    UPDATE waits for it, then matches nothing (LeaseLost: the block rolls back, I2); if
    this got it first, the reclaim waits for the commit and then finds the lease renewed.
    """
    renew: dict[str, Any] = {}
    if lease_seconds is not None:
        renew = {
            "lease_expires_at": Now() + timedelta(seconds=lease_seconds),
            "heartbeat_at": Now(),
        }
    matched = Job.objects.filter(pk=job_id, state=State.RUNNING, lease_token=lease_token).update(
        updated_at=Now(), **renew
    )
    if matched != 1:
        raise LeaseLost(f"job {job_id} is no longer running under lease {lease_token}")


def record_progress(job: Claimed, done: int, total: int | None, note: str) -> None:
    """Store the handler's progress report; call inside a fenced ``ctx.atomic()``."""
    progress = {"done": done, "total": total, "note": note}
    if not Job.objects.filter(pk=job.id, state=State.RUNNING, lease_token=job.lease_token).update(
        progress=progress, updated_at=Now()
    ):
        raise LeaseLost(f"job {job.id} is no longer running under lease {job.lease_token}")
    record_event(job.id, "progress", job.lease_token, done=done, total=total, note=note)
    log.info("job_progress", job_id=job.id, done=done, total=total, note=note)


def record_event(
    job_id: int, event: str, lease_token: int | None = None, worker_id: str = "", **data: Any
) -> None:
    """Append to the job's event log: call in the transaction of the change it describes."""
    JobEvent.objects.create(
        job_id=job_id,
        event=event,
        lease_token=lease_token,
        worker_id=worker_id or "",
        data=storable(json.loads(json.dumps(data, default=str))),
    )


def held_locks(job_id: int | None = None) -> QuerySet[JobLock]:
    """Resource locks held now (by one job, or by all), in canonical order; not the lane
    slots (``jobs.sql.LANE_SLOT``) that running jobs of limited lanes hold in that table."""
    held = JobLock.objects.exclude(resource__startswith=sql.LANE_SLOT_PREFIX).order_by("resource")
    return held if job_id is None else held.filter(job_id=job_id)


def heartbeat(job: Claimed) -> bool:
    """Renew the lease from the database clock; returns whether a cancel was requested.

    One fenced statement (``jobs.sql.heartbeat``); raises LeaseLost if the lease is gone.
    """
    cancel_requested = sql.heartbeat(job)
    if cancel_requested is None:
        raise LeaseLost(f"job {job.id} is no longer running under lease {job.lease_token}")
    return cancel_requested


# --- recovery --------------------------------------------------------------------------


def reclaim_expired(
    limit: int = sql.RECLAIM_BATCH, timeout_ms: int = sql.RECLAIM_STATEMENT_TIMEOUT_MS
) -> list[int]:
    """Put ``running`` jobs whose lease expired back in the queue (or ``dead`` when spent).

    One statement for every expired lease (up to ``limit``), whatever their number
    (``jobs.sql.reclaim``): it skips rows a live transaction holds, re-checks state, token
    and expiry against the database clock on each row it takes, so it never clobbers a job
    completed or renewed meanwhile, frees only the reclaimed lease's locks, and leaves
    ``run_at`` alone, so the job keeps its place in the queue. Each attempt it ends is
    recorded as ``lease_expired``: its worker died, stopped responding or lost the
    database during it.
    ``timeout_ms`` bounds the statement (PostgreSQL), e.g. on the lease keeper's
    connection, which must renew its own lease on time.

    Then (PostgreSQL) the sweep of blocked jobs (``jobs.sql.promote_blocked``): the best
    blocked job of each resource whose lock is free goes back into the claim's path, for
    the locks this pass freed and any whose releaser died before promoting.
    """
    reclaimed = sql.reclaim(limit, timeout_ms=timeout_ms)
    _log_reclaimed(reclaimed)
    promoted = sql.promote_blocked()
    if promoted:
        log.debug("blocked_jobs_promoted", count=len(promoted))
    if reclaimed or promoted:  # runnable again, and locks are free
        notify.notify_lanes({job.lane for job in reclaimed if job.state == State.QUEUED})
        notify.notify_freed()
    return [job.id for job in reclaimed]


RECLAIM_HOLD_AFTER_OUTAGE = 30.0  # seconds after a reclaimer's last failed connection


class ReclaimHold:
    """A reclaimer's pause after its own connection to the server failed.

    Every lease that ran out while the server was down or refusing writes looks like a dead
    worker's once it is back, yet most belong to workers that are alive and reconnecting:
    their lease keepers renew at their next tick (also while the main thread waits to
    settle a finished job), each after a connection attempt of up to ``connect_timeout``
    (10 s). A reclaimer that came back first took those jobs and ran them again, its own
    worker's included, and a finished result was refused. So a reclaimer that lost its
    connection (``sql.fault``: "connection") leaves expired leases alone for
    ``RECLAIM_HOLD_AFTER_OUTAGE`` seconds after its last failure; a dead worker's job is
    reclaimed that much later after an outage. Other errors (a lock or statement timeout,
    SQLite's "database is locked") hold nothing: the server was there.
    """

    def __init__(self) -> None:
        self.until = 0.0

    def note(self, exc: BaseException) -> None:
        """Hold reclaims if ``exc`` says the connection to the server failed."""
        if sql.fault(exc) != "connection":
            return
        if not self.held():
            error = " ".join(str(exc).split()) or type(exc).__name__
            log.warning("reclaims_held", seconds=RECLAIM_HOLD_AFTER_OUTAGE, error=error)
        self.until = time.monotonic() + RECLAIM_HOLD_AFTER_OUTAGE

    def held(self) -> bool:
        return time.monotonic() < self.until


def _log_reclaimed(reclaimed: Sequence[sql.Reclaimed]) -> None:
    """One warning per reclaimed lease, and the error-level ``job_dead`` an operator
    alerts on for each job it left dead, as a failed last attempt gets (one line per
    pass above 100 jobs)."""
    if len(reclaimed) > 100:  # one line per pass, not per job
        states = {state: sum(job.state == state for job in reclaimed) for state in State}
        log.warning(
            "leases_reclaimed",
            count=len(reclaimed),
            **{state: n for state, n in states.items() if n},
        )
        if states[State.DEAD]:
            log.error("jobs_dead", count=states[State.DEAD], reason="lease_expired")
        return
    for job in reclaimed:
        identity = {
            "job_id": job.id,
            "kind": job.kind,
            "lane": job.lane,
            "attempt": job.attempt,
            "lease_token": job.lease_token,
            "worker_id": job.worker_id,
        }
        log.warning("lease_reclaimed", **identity, new_state=job.state)
        if job.state == State.DEAD:
            error = (
                f"LeaseExpired: worker {job.worker_id or '?'} stopped renewing lease "
                f"{job.lease_token} during attempt {job.attempt}, its last"
            )
            log.error("job_dead", **identity, reason="lease_expired", error=error)


def release_orphans(worker_id: str, keep: int | None = None) -> list[int]:
    """Give back (uncharged) every job leased to ``worker_id`` except ``keep``.

    For a worker that reconnects after an outage: a claim whose commit acknowledgement was
    lost left a job leased to it that it is not running. Only claims made since this
    worker registered count: a job an earlier process with the same id (a restarted
    systemd unit) held when it died is left to reclaim, charged, so a job that kills its
    worker still runs out of attempts. Each release is fenced by the job's lease token
    like any settle. Two live processes must not share a worker id.
    """
    registered = Worker.objects.filter(pk=worker_id).values("started_at")[:1]
    orphans = Job.objects.filter(
        state=State.RUNNING, leased_by=worker_id, started_at__gte=Subquery(registered)
    )
    if keep is not None:
        orphans = orphans.exclude(pk=keep)
    released = []
    for job in list(orphans):
        pk, token = job.pk, job.lease_token
        held = Claimed(
            id=pk,
            kind=job.kind,
            lane=job.lane,
            args=job.args,
            attempt=job.attempts,
            max_attempts=job.max_attempts,
            lease_token=token,
            lease_seconds=job.lease_seconds,
            lease_expires_at=job.lease_expires_at or timezone.now(),
            locks=tuple(job.locks or ()),
            cancel_requested=job.cancel_requested,
        )
        settled, _ = sql.settle_and_claim(held, RELEASED.how, None, None)
        if settled:
            released.append(pk)
            log.warning("orphan_released", job_id=pk, lease_token=token, worker_id=worker_id)
    return released


def _notify_freed(job: Claimed, settled: bool, limits: Mapping[str, int] | None) -> None:
    """After a settle: its resource locks are free (wake every idle worker: a job blocked
    on them may be in any lane), or a slot of its limited lane (wake that lane's)."""
    if not settled:
        return
    if job.locks:
        notify.notify_freed()
    if job.lane in (lane_config.running_limits(None) if limits is None else limits):
        notify.notify_lanes([job.lane])


def db_now() -> datetime:
    """The database clock: lease and age arithmetic never trusts a worker's clock."""
    if sql.is_postgres():
        with connection.cursor() as cursor:
            cursor.execute("SELECT statement_timestamp()")
            (now,) = cursor.fetchone()
            return now
    return timezone.now()  # SQLite runs on this host: its clock is the database's
