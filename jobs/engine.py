"""The job engine: the only code that changes a job's state.

Each transition is one statement or one ``transaction.atomic()`` block whose guard
(``state``, ``lease_token``, lease expiry) is visible where it is written. The hot-path
statements (claim, settle) are in ``jobs.sql``; the rest is ORM. Every transition logs
one structlog event.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import os
import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from django.conf import settings
from django.db import DatabaseError, IntegrityError, OperationalError, connection, transaction
from django.db.models import F, Q, QuerySet, Subquery
from django.db.models.base import ModelState
from django.db.models.functions import Now
from django.utils import timezone

from . import lanes as lane_config
from . import notify, retention, sql
from .exceptions import (
    InvalidJob,
    JobNotFound,
    LaneFull,
    LeaseLost,
    StateConflict,
    UnknownKind,
)
from .log import get_logger
from .models import ACTIVE_STATES, Job, JobEvent, JobLock, Lease, Outcome, State, Worker
from .registry import DEFAULT_MAX_ATTEMPTS, TASK_KIND, HandlerSpec, all_handlers, get_handler
from .sql import Claimed, Settlement

log = get_logger("jobs.engine")

NOTIFY_CHANNEL = notify.NOTIFY_CHANNEL
CANCEL_CHANNEL = notify.CANCEL_CHANNEL  # payload: the job id whose cancellation was requested
MAX_ERROR_MESSAGE = 10_000
MAX_TRACEBACK = 50_000
ARGS_ENCODER = json.JSONEncoder(allow_nan=False)  # strict JSON: no NaN or Infinity
MAX_ATTEMPTS_LIMIT = 1_000_000
MAX_DELAY = timedelta(days=365 * 100)
UNIQUE_KEY_LENGTH = 255
LOCK_NAME_LENGTH = 255
KEYS_PER_QUERY = 1000  # keeps ``IN (…)`` well under SQLite's bound-parameter limit


# --- enqueue ---------------------------------------------------------------------------


def enqueue(
    kind: str,
    args: dict[str, Any] | None = None,
    *,
    lane: str | None = None,
    priority: int = 0,
    delay: float | timedelta | None = None,
    run_at: datetime | None = None,
    unique_key: str | None = None,
    max_attempts: int | None = None,
    lease_seconds: float | None = None,
) -> Job | None:
    """Enqueue one job inside the caller's transaction: it exists iff the caller commits.

    With a ``unique_key`` (or a handler declared ``unique=True``), an existing queued or
    running job with that key is returned instead of a new one. Returns None only when the
    lane is full and its ``on_full`` policy is ``drop``.
    """
    jobs = enqueue_many(
        kind,
        [args if args is not None else {}],
        lane=lane,
        priority=priority,
        delay=delay,
        run_at=run_at,
        unique_key=unique_key,
        max_attempts=max_attempts,
        lease_seconds=lease_seconds,
    )
    return jobs[0] if jobs else None


def enqueue_many(
    kind: str,
    args_list: Iterable[dict[str, Any]],
    *,
    lane: str | None = None,
    priority: int = 0,
    delay: float | timedelta | None = None,
    run_at: datetime | None = None,
    unique_key: str | None = None,
    unique_keys: Sequence[str] | None = None,
    max_attempts: int | None = None,
    lease_seconds: float | None = None,
) -> list[Job]:
    """Enqueue one job per args dict with the same options; returns the jobs in order.

    ``unique_keys`` gives each job its own key (one per args dict): a key already held by a
    queued or running job returns that job instead, all in a few statements whatever the
    count, so bulk producers (discovery, refreshers) need no loop of single enqueues.
    """
    spec = get_handler(kind)
    args_list = list(args_list)
    args_text = _args_array(args_list)
    if unique_key is not None and unique_keys is not None:
        raise InvalidJob("give unique_key or unique_keys, not both")
    if unique_key is not None and len(args_list) > 1:
        raise InvalidJob("unique_key names one job; give enqueue_many unique_keys, one per job")
    keys = _validated_keys([unique_key] if unique_key is not None else unique_keys, len(args_list))
    chosen = lane_config.resolve(kind, lane, spec.lane)
    if not args_list:
        return []
    attempts_budget = _validated_max_attempts(max_attempts, spec)
    lease = _validated_lease_seconds(lease_seconds, spec)
    _validated_priority(priority)
    when = _run_at_expression(delay, run_at)
    if chosen.max_queued is not None:
        queued = Job.objects.filter(lane=chosen.name, state=State.QUEUED).count()
        if queued + len(args_list) > chosen.max_queued:
            message = f"lane {chosen.name!r} is full ({queued} of {chosen.max_queued} queued)"
            if chosen.on_full == "drop":
                log.warning("job_dropped", kind=kind, lane=chosen.name, count=len(args_list))
                return []
            raise LaneFull(message)
    locks = [_locks(spec, args) for args in args_list] if spec.locks else None
    options = {
        "kind": kind,
        "lane": chosen.name,
        "priority": priority,
        "max_attempts": attempts_budget,
        "lease_seconds": lease,
    }
    if keys is None and spec.unique:
        keys = [_args_key(kind, _args_json(args)) for args in args_list]
    if keys is None:  # no unique keys: plain inserts, one statement per chunk on PostgreSQL
        common = {**_field_defaults(), **options}
        created = jobs = _insert_new(common, args_list, args_text, locks, delay, run_at)
        _log_enqueued(kind, chosen.name, created)
        return jobs
    template = Job(**options)
    with transaction.atomic():
        if len(args_list) == 1:  # enqueue(): one savepoint, one insert
            job, new = _create_unique(
                _copy(
                    template,
                    args=args_list[0],
                    locks=locks[0] if locks else None,
                    unique_key=keys[0],
                    run_at=when,
                )
            )
            jobs, created = [job], [job] if new else []
        else:
            jobs, created = _create_unique_many(
                [
                    _copy(
                        template,
                        args=args,
                        locks=locks[n] if locks else None,
                        unique_key=keys[n],
                        run_at=when,
                    )
                    for n, args in enumerate(args_list)
                ],
                keys,
            )
        if created and _due_now(delay, run_at):  # a delayed job wakes no one now (notify.py)
            _notify(chosen.name)
    _log_enqueued(kind, chosen.name, created)
    return jobs


def _log_enqueued(kind: str, lane: str, created: list[Job]) -> None:
    if len(created) > 100:  # one line per bulk call, not per job
        log.info("jobs_enqueued", kind=kind, lane=lane, count=len(created))
    else:
        for job in created:
            log.info("job_enqueued", job_id=job.pk, kind=kind, lane=lane)


def _copy(template: Job, **fields: Any) -> Job:
    job = Job(**{f.attname: getattr(template, f.attname) for f in Job._meta.concrete_fields})
    for name, value in fields.items():
        if value is not None:
            setattr(job, name, value)
    return job


@functools.cache
def _field_defaults() -> dict[str, Any]:
    """Every column's value in a new ``Job()`` (the ones each job sets are replaced)."""
    job = Job()
    return {f.attname: getattr(job, f.attname) for f in Job._meta.concrete_fields}


def _insert_new(
    common: dict[str, Any],
    args_list: list[dict[str, Any]],
    args_text: str,
    locks: list[list[str]] | None,
    delay: float | timedelta | None,
    run_at: datetime | None,
) -> list[Job]:
    """Insert jobs without unique keys, with the wake-up; the new jobs in args order.

    PostgreSQL: one statement per 10,000 jobs (the first also sends the NOTIFY), so a single
    job outside a transaction is one round trip and one commit. SQLite: one executemany.
    """
    delay_seconds = delay.total_seconds() if isinstance(delay, timedelta) else delay
    jobs: list[Job] = []
    if sql.is_postgres():
        size = sql.BULK_INSERT_CHUNK
        starts = range(0, len(args_list), size)
        texts = (
            [args_text]
            if len(starts) == 1
            else [_args_array(args_list[n : n + size]) for n in starts]
        )
        chunk_locks = [locks[n : n + size] if locks else None for n in starts]
        # One statement is atomic by itself; inside the caller's transaction it keeps the
        # savepoint enqueue always had (a failed insert leaves the caller's work usable).
        single = len(texts) == 1 and not connection.in_atomic_block
        with nullcontext() if single else transaction.atomic():
            channels = _wake_up(common["lane"], delay, run_at)
            inserted = sql.insert_jobs(common, texts, chunk_locks, delay_seconds, run_at, channels)
            for start, (ids, job_run_at, created_at) in zip(starts, inserted, strict=True):
                end = start + size
                _add_jobs(
                    jobs,
                    common,
                    ids,
                    job_run_at,
                    created_at,
                    args_list[start:end],
                    locks and locks[start:end],
                )
    else:
        with transaction.atomic():
            ids, job_run_at, created_at = sql.sqlite_insert_jobs(
                common, [_args_json(args) for args in args_list], locks, delay_seconds, run_at
            )
            if _due_now(delay, run_at):
                _notify(common["lane"])  # this process's idle workers, after commit
        _add_jobs(jobs, common, ids, job_run_at, created_at, args_list, locks)
    return jobs


def _add_jobs(
    jobs: list[Job],
    common: dict[str, Any],
    ids: list[int],
    run_at: datetime,
    created_at: datetime,
    args_list: list[dict[str, Any]],
    locks: list[list[str]] | None,
) -> None:
    """Append to ``jobs`` the model instances of new rows, built the way ``Model.from_db``
    builds rows read from the database, from the field values all the rows share:
    ``Model.__init__`` per job would cost more than the insert itself."""
    if len(ids) != len(args_list):
        raise DatabaseError(f"inserted {len(args_list)} jobs but got {len(ids)} ids back")
    shared = {**common, "run_at": run_at, "created_at": created_at, "updated_at": created_at}
    alias = connection.alias
    append = jobs.append
    new = object.__new__
    with _collector_paused():
        for n, (pk, args) in enumerate(zip(ids, args_list, strict=True)):
            job = new(Job)
            fields = job.__dict__
            fields.update(shared)
            fields["id"] = pk
            fields["args"] = args
            fields["locks"] = locks[n] if locks else []
            job._state = state = new(ModelState)
            state.adding = False
            state.db = alias
            append(job)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while a batch of jobs is built: each of its full
    collections walks every object of the process, and building 50,000 jobs set off enough
    of them to cost more than the rest of ``enqueue_many`` (about 5 µs a job). The new jobs
    hold no cycles; the collector runs again right after."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _validated_keys(keys: Sequence[str] | None, count: int) -> list[str] | None:
    if keys is None:
        return None
    keys = list(keys)
    if isinstance(keys, str) or len(keys) != count:
        raise InvalidJob(f"unique_keys must hold one key per job: {len(keys)} for {count} jobs")
    for key in keys:
        if not isinstance(key, str) or not 0 < len(key) <= UNIQUE_KEY_LENGTH:
            raise InvalidJob(f"a unique key must be 1 to {UNIQUE_KEY_LENGTH} characters long")
    return keys


def _create_unique_many(jobs: list[Job], keys: list[str]) -> tuple[list[Job], list[Job]]:
    """Insert the jobs whose unique key (``keys[n]`` for ``jobs[n]``) no active job holds;
    return each key's job, in order, and the jobs that are new.

    One read of the keys already taken, one bulk insert that skips keys taken meanwhile
    (``ON CONFLICT DO NOTHING`` on the partial unique index; SQLite ``INSERT OR IGNORE``)
    and one read of the keys' active jobs. A key whose holder finished between those
    statements is inserted on its own.
    """
    taken = set(_active_by_key(keys))
    fresh: dict[str, Job] = {}
    for key, job in zip(keys, jobs, strict=True):
        if key not in taken:
            fresh.setdefault(key, job)
    Job.objects.bulk_create(list(fresh.values()), batch_size=2000, ignore_conflicts=True)
    active = _active_by_key(keys)
    for key, job in zip(keys, jobs, strict=True):
        if key not in active:  # its holder finished between our reads
            active[key], _ = _create_unique(job)
    for key in sorted(taken):
        log.info("job_deduplicated", job_id=active[key].pk, unique_key=key)
    return [active[key] for key in keys], [active[key] for key in fresh]


def _active_by_key(keys: Sequence[str]) -> dict[str, Job]:
    """The queued or running job holding each of ``keys`` (read in bounded chunks)."""
    found: dict[str, Job] = {}
    distinct = sorted(set(keys))
    for start in range(0, len(distinct), KEYS_PER_QUERY):
        chunk = distinct[start : start + KEYS_PER_QUERY]
        for job in Job.objects.filter(unique_key__in=chunk, state__in=ACTIVE_STATES):
            found[job.unique_key] = job  # type: ignore[index]
    return found


def _create_unique(job: Job) -> tuple[Job, bool]:
    """Insert ``job`` unless an active job holds its unique key; then return that one.

    Also says whether ``job`` is new.
    """
    try:
        with transaction.atomic():
            job.save(force_insert=True)
            return job, True
    except IntegrityError:
        existing = Job.objects.filter(unique_key=job.unique_key, state__in=ACTIVE_STATES).first()
        if existing is None:  # the holder finished between our insert and this read
            job.save(force_insert=True)
            return job, True
        log.info("job_deduplicated", job_id=existing.pk, unique_key=job.unique_key)
        return existing, False


def _locks(spec: HandlerSpec, args: dict[str, Any]) -> list[str]:
    """The resources a job must hold, in canonical order: sorted, each once (I8)."""
    assert spec.locks is not None
    try:
        names = spec.locks(args)
    except Exception as exc:
        message = f"the locks of {spec.kind!r} cannot be derived from its args: {exc!r}"
        raise InvalidJob(message) from None
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise InvalidJob(f"the locks of {spec.kind!r} must be a list of strings, not {names!r}")
    names = list(names)
    for name in names:
        if not isinstance(name, str) or not 0 < len(name) <= LOCK_NAME_LENGTH:
            raise InvalidJob(
                f"a lock of {spec.kind!r} must be a string of 1 to {LOCK_NAME_LENGTH} "
                f"characters, not {name!r}"
            )
        if name.startswith(sql.LANE_SLOT_PREFIX):
            raise InvalidJob(
                f"a lock of {spec.kind!r} may not start with {sql.LANE_SLOT_PREFIX!r} "
                f"(reserved for lane slots), not {name!r}"
            )
    return sorted(set(names))


def _args_array(args_list: list[Any]) -> str:
    """The args of every job as one JSON array text, encoded in one call; refuses what
    ``_args_json`` refuses, with the same error (the first bad job's)."""
    if all(type(args) is dict for args in args_list):
        try:
            text = ARGS_ENCODER.encode(args_list)
        except (TypeError, ValueError):
            text = None
        if text is not None and "\\u0000" not in text and "\\ud" not in text:
            return text
    return f"[{', '.join(_args_json(args) for args in args_list)}]"


def _args_json(args: Any) -> str:
    """The args as JSON text; refuses anything that is not a JSON object."""
    if not isinstance(args, dict):
        raise InvalidJob(f"job args must be a JSON object, not {type(args).__name__}")
    try:
        text = ARGS_ENCODER.encode(args)
    except (TypeError, ValueError) as exc:
        raise InvalidJob(f"job args are not JSON-serializable: {exc}") from None
    if ("\\u0000" in text or "\\ud" in text) and (problem := _unstorable(args)):
        raise InvalidJob(f"job args {problem}")
    return text


def _unstorable(value: Any) -> str | None:
    """Why a JSON value cannot be stored on every database (NUL, lone surrogates), or None."""
    if isinstance(value, str):
        if "\x00" in value:
            return "contain a NUL character"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "contain an unpaired surrogate (not valid Unicode)"
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        problem = _unstorable(key) if isinstance(key, str) else None
        if problem := problem or _unstorable(item):
            return problem
    return None


def _validated_max_attempts(max_attempts: int | None, spec: HandlerSpec) -> int:
    if max_attempts is None:
        return spec.max_attempts
    if not isinstance(max_attempts, int) or not 1 <= max_attempts <= MAX_ATTEMPTS_LIMIT:
        raise InvalidJob(
            f"max_attempts must be an integer from 1 to {MAX_ATTEMPTS_LIMIT}, not {max_attempts!r}"
        )
    return max_attempts


def _validated_lease_seconds(lease_seconds: float | None, spec: HandlerSpec) -> float:
    if lease_seconds is None:
        return _lease_seconds(spec)
    if (
        isinstance(lease_seconds, bool)
        or not isinstance(lease_seconds, int | float)
        or not 0 < lease_seconds < float("inf")
    ):
        raise InvalidJob(f"lease_seconds must be a positive number, not {lease_seconds!r}")
    return float(lease_seconds)


def _validated_priority(priority: int) -> None:
    if not isinstance(priority, int) or not -32768 <= priority <= 32767:
        raise InvalidJob(f"priority must be an integer from -32768 to 32767, not {priority!r}")


def _run_at_expression(delay: float | timedelta | None, run_at: datetime | None) -> Any:
    if delay is not None and run_at is not None:
        raise InvalidJob("give delay or run_at, not both")
    if run_at is not None:
        if timezone.is_naive(run_at):
            raise InvalidJob("run_at must be timezone-aware")
        try:
            run_at.astimezone(UTC)
        except OverflowError:
            raise InvalidJob(f"run_at {run_at.isoformat()} is out of range") from None
        if not 1970 <= run_at.year <= 9999:
            raise InvalidJob(f"run_at {run_at.isoformat()} is out of range (1970 to 9999)")
        return run_at
    if delay is None:
        return None  # the column's default: the database clock
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
    if not 0 <= seconds <= MAX_DELAY.total_seconds():  # also refuses NaN
        raise InvalidJob(f"delay must be from 0 to {MAX_DELAY.days} days in seconds, not {delay}")
    return Now() + timedelta(seconds=seconds)


def _lease_seconds(spec: HandlerSpec) -> float:
    return float(spec.lease_seconds or settings.HOLDFAST_LEASE_SECONDS)


def _args_key(kind: str, args_json: str) -> str:
    canonical = json.dumps(json.loads(args_json), sort_keys=True)
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    return f"{kind}:{digest[:32]}"


def _wake_up(lane: str, delay: float | timedelta | None, run_at: datetime | None) -> list[str]:
    """The NOTIFY channels that wake the idle PostgreSQL workers of ``lane`` for new jobs
    runnable now (none for delayed ones: ``jobs.notify``). The plain insert sends them
    within its own statement."""
    return notify.lane_channels(lane) if _due_now(delay, run_at) else []


def _notify(lane: str) -> None:
    """Wake the idle workers of ``lane``; NOTIFY is delivered only if the transaction
    commits (``jobs.notify``)."""
    notify.notify_lanes([lane])


def _due_now(delay: float | timedelta | None, run_at: datetime | None) -> bool:
    """Whether jobs enqueued with these options are runnable at once (this host's clock
    decides; a job it deems delayed is found by the idle workers' next-due look-up)."""
    if run_at is not None:
        return run_at <= timezone.now()
    if delay is None:
        return True
    return (delay.total_seconds() if isinstance(delay, timedelta) else float(delay)) <= 0


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
    """``value`` with NUL characters escaped: PostgreSQL text and jsonb cannot hold them.

    An error message is evidence for the operator; it must be stored, not refused.
    """
    if isinstance(value, str):
        return value.replace("\x00", "\\x00")
    if isinstance(value, dict):
        return {storable(str(key)): storable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [storable(item) for item in value]
    return value


# Graceful shutdown gives the job back: queued again, this attempt not charged.
RELEASED = Verdict(Settlement(State.QUEUED, Outcome.RELEASED, uncharge=True), "job_released", {})
# The handler honoured a cancellation request.
CANCELLED = Verdict(
    Settlement(State.CANCELLED, Outcome.CANCELLED, last_error="cancelled on request"),
    "job_cancelled",
    {},
)


def settle(job: Claimed, verdict: Verdict) -> None:
    """Write ``verdict`` for ``job``, fenced by its lease token; raise LeaseLost otherwise."""
    settled, _ = sql.settle_and_claim(job, verdict.how, None, None)
    _notify_freed(job, settled, None)  # inside ctx.atomic(complete=True): sent at its commit
    if not _log_settled(job, verdict, settled):
        raise LeaseLost(f"job {job.id} is no longer running under lease {job.lease_token}")


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
_claimed_at: dict[int, float] = {}
# A settle's log level: a dead job wants someone's attention, a retry is a warning.
SETTLE_LEVELS = {"job_dead": "error", "job_retry_scheduled": "warning"}


def _log_claimed(job: Claimed | None, worker_id: str) -> None:
    if job is not None:
        _claimed_at[job.lease_id] = time.monotonic()
        log.info(
            "job_claimed",
            expires_at=job.lease_expires_at.isoformat(),
            **job_log_context(job, worker_id),
        )


def _log_settled(job: Claimed, verdict: Verdict, settled: bool) -> bool:
    identity = job_log_context(job)
    started = _claimed_at.pop(job.lease_id, None)
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
    _event(job.id, "progress", job.lease_token, done=done, total=total, note=note)
    log.info("job_progress", job_id=job.id, done=done, total=total, note=note)


def _event(
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
    recorded as ``lease_expired``: its worker died or stopped responding during it.
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
        notify.notify_lanes({job.lane for job in reclaimed} or {"default"}, freed=True)
    return [job.id for job in reclaimed]


def _log_reclaimed(reclaimed: Sequence[sql.Reclaimed]) -> None:
    if len(reclaimed) > 100:  # one line per pass, not per job
        states = {state: sum(job.state == state for job in reclaimed) for state in State}
        log.warning(
            "leases_reclaimed",
            count=len(reclaimed),
            **{state: n for state, n in states.items() if n},
        )
        return
    for job in reclaimed:
        log.warning(
            "lease_reclaimed",
            job_id=job.id,
            kind=job.kind,
            lane=job.lane,
            attempt=job.attempt,
            lease_token=job.lease_token,
            worker_id=job.worker_id,
            new_state=job.state,
        )


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
    for pk, token in list(orphans.values_list("pk", "lease_token")):
        lease = Lease.objects.filter(job_id=pk, lease_token=token).first()
        job = Job.objects.filter(pk=pk).first()
        if lease is None or job is None:
            continue
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
            lease_id=lease.pk,
        )
        settled, _ = sql.settle_and_claim(held, RELEASED.how, None, None)
        if settled:
            released.append(pk)
            log.warning("orphan_released", job_id=pk, lease_token=token, worker_id=worker_id)
    return released


# --- operator actions ------------------------------------------------------------------


def get_job(job_id: int) -> Job:
    try:
        return Job.objects.get(pk=job_id)
    except Job.DoesNotExist:
        raise JobNotFound(f"no job with id {job_id}") from None


def kind_filter(kind: str) -> Q:
    """Jobs of ``kind``: a handler's kind, or the path of a Django task function (all tasks
    are ``django.task`` jobs; ``args["task"]`` names the function)."""
    return Q(kind=kind) | Q(kind=TASK_KIND, args__task=kind)


def dead_jobs(
    ids: Sequence[int] = (),
    kind: str | None = None,
    lane: str | None = None,
    since: datetime | None = None,
) -> QuerySet[Job]:
    """The dead jobs an operator selected (by id, kind, lane, time of death), oldest first."""
    query = Q(state=State.DEAD)
    if ids:
        query &= Q(pk__in=ids)
    if kind:
        query &= kind_filter(kind)
    if lane:
        query &= Q(lane=lane)
    if since:
        query &= Q(finished_at__gte=since)
    return Job.objects.filter(query).order_by("pk")


@dataclass(frozen=True)
class RequeueReport:
    """What ``requeue_each`` did: the jobs requeued, and each one it could not requeue
    with the reason (``{"id": …, "reason": …}``)."""

    requeued: list[int]
    conflicts: list[dict[str, Any]]


def requeue_each(
    jobs: Iterable[Job], actor: str = "operator", dry_run: bool = False
) -> RequeueReport:
    """Move dead jobs back to ``queued`` with a fresh attempt budget, each on its own.

    ``attempts`` keeps counting (each attempt's record stays numbered uniquely); the
    budget grows by the handler's ``max_attempts`` from the attempts spent so far. A job
    that cannot be requeued (its unique key is held by a live job, or it is no longer
    dead) is reported and the others are requeued all the same: each job's change is its
    own savepoint. ``dry_run`` changes nothing and reports what would happen.
    """
    jobs = list(jobs)
    holders = {
        key: (job.pk, job.state)
        for key, job in _active_by_key([job.unique_key for job in jobs if job.unique_key]).items()
    }
    requeued: list[int] = []
    conflicts: list[dict[str, Any]] = []

    def conflict(job: Job, reason: str) -> None:
        conflicts.append({"id": job.pk, "reason": reason})  # the caller reports them

    for job in jobs:
        key = job.unique_key
        if key and key in holders:
            holder, state = holders[key]
            conflict(job, f"job {job.pk}: its unique key {key!r} is held by job {holder} ({state})")
            continue
        if job.state != State.DEAD:
            conflict(job, f"job {job.pk} is {job.state}, not dead: nothing to requeue")
            continue
        if not dry_run:
            try:
                with transaction.atomic():
                    matched = Job.objects.filter(pk=job.pk, state=State.DEAD).update(
                        state=State.QUEUED,
                        run_at=Now(),
                        max_attempts=F("attempts") + _requeue_budget(job.kind),
                        finished_at=None,
                        cancel_requested=False,
                        updated_at=Now(),
                    )
                    if matched == 1:
                        _event(job.pk, "requeued", by=actor)
                        sql.count_jobs({(job.lane, State.DEAD): -1})  # out of the dead count
            except IntegrityError:  # a live job took the key since we looked
                holder_job = _active_by_key([key]).get(key) if key else None
                held_by = f"job {holder_job.pk} ({holder_job.state})" if holder_job else "a job"
                conflict(job, f"job {job.pk}: its unique key {key!r} is held by {held_by}")
                continue
            if matched != 1:
                now = Job.objects.filter(pk=job.pk).values_list("state", flat=True).first()
                conflict(job, f"job {job.pk} is {now or 'gone'}, not dead: nothing to requeue")
                continue
            log.info("job_requeued", job_id=job.pk, kind=job.kind, lane=job.lane, by=actor)
        requeued.append(job.pk)
        if key:
            holders[key] = (job.pk, State.QUEUED)  # a second dead job with that key conflicts
    if requeued and not dry_run:
        done = set(requeued)
        _notify_lanes({job.lane for job in jobs if job.pk in done})
    return RequeueReport(requeued, conflicts)


def requeue_dead(jobs: Sequence[Job], actor: str = "operator") -> list[int]:
    """``requeue_each``, returning only the ids requeued."""
    return requeue_each(jobs, actor=actor).requeued


CANCEL_LOCK_WAIT = 3.0  # seconds: cancel_job answers within 5 s whatever holds the row


def cancel(job_id: int, actor: str = "operator") -> Job:
    """Cancel a queued job at once, or ask a running one to stop at its next safe point.

    A running job learns of the request through ``ctx.cancel_requested``: at once on
    PostgreSQL (NOTIFY on ``holdfast_cancel``, delivered on commit), else at its worker's
    next lease renewal (at most every 5 s). The job ends ``cancelled`` only if the handler
    honours it. A running job whose lease has expired (its worker died or froze) is
    cancelled at once, as a reclaim would end that attempt. A finished job cannot be
    cancelled (StateConflict). Lock waits are bounded, so this returns within seconds even
    if a frozen worker holds the row: then it raises StateConflict, saying to try again.
    """
    try:
        with sql.lock_waits_bounded(CANCEL_LOCK_WAIT):
            return _cancel(job_id, actor)
    except OperationalError as exc:
        if not _is_lock_wait(exc):
            raise
        raise StateConflict(
            f"job {job_id} is locked by an open transaction (its worker may be frozen; the "
            f"server ends such sessions within one lease): nothing changed, try again"
        ) from None


def _is_lock_wait(exc: OperationalError) -> bool:
    cause = exc.__cause__
    if isinstance(cause, psycopg.errors.LockNotAvailable):
        return True
    return "database is locked" in str(exc)


def _cancel(job_id: int, actor: str) -> Job:
    if Job.objects.filter(pk=job_id, state=State.QUEUED).update(
        state=State.CANCELLED,
        cancel_requested=True,
        finished_at=Now(),
        last_error=f"cancelled by {actor} before it ran",
        updated_at=Now(),
    ):
        job = get_job(job_id)
        sql.count_jobs({(job.lane, State.CANCELLED): 1})
        _event(job_id, "cancelled", by=actor)
        log.info("job_cancelled", job_id=job_id, kind=job.kind, lane=job.lane, by=actor)
        return job
    # Its lease expired (worker died or frozen): end that attempt as a reclaim would, into
    # `cancelled` (its `reclaimed` event says so), fencing out the old worker's writes.
    expired = Job.objects.filter(pk=job_id, state=State.RUNNING, lease_expires_at__lt=Now())
    ended_attempts = sql.reclaim(1, job_id=job_id, cancel=True, actor=actor) if expired else []
    if ended_attempts:
        sql.promote_blocked()  # its locks are free: their blocked waiters go on
    for ended in ended_attempts:
        log.info(
            "job_cancelled",
            job_id=job_id,
            kind=ended.kind,
            lane=ended.lane,
            lease_token=ended.lease_token,
            worker_id=ended.worker_id,
            by=actor,
            lease_expired=True,
        )
        return get_job(job_id)
    if Job.objects.filter(pk=job_id, state=State.RUNNING).update(
        cancel_requested=True, updated_at=Now()
    ):
        job = get_job(job_id)
        _event(job_id, "cancel_requested", job.lease_token, job.leased_by or "", by=actor)
        if sql.is_postgres():
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_notify(%s, %s)", [CANCEL_CHANNEL, str(job_id)])
        log.info(
            "job_cancel_requested",
            job_id=job_id,
            kind=job.kind,
            lane=job.lane,
            lease_token=job.lease_token,
            worker_id=job.leased_by,
            by=actor,
        )
        return job
    job = get_job(job_id)  # raises JobNotFound for an unknown id
    raise StateConflict(f"job {job_id} is {job.state}: it has finished, nothing to cancel")


def prune(older_than: timedelta, include_dead: bool = False, batch: int = 5000) -> int:
    """Delete finished jobs (and their attempts) that finished more than ``older_than`` ago.

    Succeeded and cancelled jobs only, unless ``include_dead``: dead jobs are evidence an
    operator may still need. Queued and running jobs are never pruned. Deletes in batches
    so that no single transaction holds the table for long; returns how many went.
    """
    states = [State.SUCCEEDED, State.CANCELLED] + ([State.DEAD] if include_dead else [])
    deleted = sum(retention.prune(dict.fromkeys(states, older_than), batch=batch).values())
    log.info(
        "jobs_pruned",
        count=deleted,
        older_than_s=older_than.total_seconds(),
        include_dead=include_dead,
    )
    return deleted


def requeue_one(job_id: int, actor: str = "operator") -> Job:
    """Requeue one dead job; StateConflict (saying why) if it cannot be."""
    report = requeue_each([get_job(job_id)], actor=actor)
    if report.conflicts:
        raise StateConflict(report.conflicts[0]["reason"])
    return get_job(job_id)


def _requeue_budget(kind: str) -> int:
    try:
        return get_handler(kind).max_attempts
    except UnknownKind:
        return DEFAULT_MAX_ATTEMPTS


def _notify_lanes(lanes: Iterable[str]) -> None:
    notify.notify_lanes(lanes)


def _notify_freed(job: Claimed, settled: bool, limits: Mapping[str, int] | None) -> None:
    """After a settle: its resource locks are free (wake every idle worker: a job blocked
    on them may be in any lane), or a slot of its limited lane (wake that lane's)."""
    if not settled:
        return
    if job.locks:
        notify.notify_lanes([job.lane], freed=True)
    if job.lane in (lane_config.running_limits(None) if limits is None else limits):
        notify.notify_lanes([job.lane])


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


def db_now() -> datetime:
    """The database clock: lease and age arithmetic never trusts a worker's clock."""
    if sql.is_postgres():
        with connection.cursor() as cursor:
            cursor.execute("SELECT statement_timestamp()")
            (now,) = cursor.fetchone()
            return now
    return timezone.now()  # SQLite runs on this host: its clock is the database's
