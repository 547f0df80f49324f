"""Enqueue: validate a job's options and arguments, and insert it (or a batch) inside the
caller's transaction, with its wake-up.

The transitions of a job once it exists are ``jobs.engine``'s (its attempts) and
``jobs.operations``' (the operator's); this module only creates ``queued`` rows. The
public entry points are ``jobs.enqueue`` and ``jobs.enqueue_many``.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import json.encoder
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError, IntegrityError, connection, transaction
from django.db.models.base import ModelState
from django.db.models.functions import Now
from django.utils import timezone

from . import lanes as lane_config
from . import notify, options, sql
from .exceptions import (
    InvalidJob,
    LaneFull,
)
from .log import get_logger
from .models import HOLDS_ITS_KEY, Job, State
from .options import lane_problem
from .registry import HandlerSpec, bind, fits, get_handler

log = get_logger("jobs.enqueueing")

ARGS_ENCODER = json.JSONEncoder(allow_nan=False)  # strict JSON: no NaN or Infinity

UNIQUE_KEY_LENGTH = 255
LOCK_NAME_LENGTH = 255
KEYS_PER_QUERY = 1000  # keeps ``IN (…)`` well under SQLite's bound-parameter limit


def _accepted_args_encoder() -> Callable[[dict[str, Any]], str]:
    """``ARGS_ENCODER.encode`` for one job's args that ``_args_array`` has already accepted
    (every job's args of a batch, encoded in one call): the same text, from a C encoder set
    up once. ``JSONEncoder.encode`` sets one up on every call: 1.5 µs a job against 0.4,
    where all of ``enqueue_many`` took about 7 (146,000 jobs/s measured). No circular-reference
    check: the array's encode made it. Without the C accelerator, ``ARGS_ENCODER.encode``."""
    make = getattr(json.encoder, "c_make_encoder", None)  # not in typeshed's stub
    if make is None:
        return ARGS_ENCODER.encode
    encoder = make(
        None,  # markers: no cycle check (done)
        ARGS_ENCODER.default,
        json.encoder.encode_basestring_ascii
        if ARGS_ENCODER.ensure_ascii
        else json.encoder.encode_basestring,
        None,  # indent: ARGS_ENCODER has none (JSONEncoder uses the C encoder only then)
        ARGS_ENCODER.key_separator,
        ARGS_ENCODER.item_separator,
        ARGS_ENCODER.sort_keys,
        ARGS_ENCODER.skipkeys,
        ARGS_ENCODER.allow_nan,
    )
    join = "".join
    return lambda args: join(encoder(args, 0))


encode_accepted_args = _accepted_args_encoder()


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
    continuation: bool = False,
) -> Job | None:
    """Enqueue one job inside the caller's transaction: it exists iff the caller commits.

    With a ``unique_key`` (or a handler declared ``unique=True``), an existing queued or
    running job with that key is returned instead of a new one. Returns None only when the
    lane is full and its ``on_full`` policy is ``drop``.

    ``continuation=True`` is for a handler that hands the rest of its own work to a next
    job, enqueued in the transaction that completes the current one: the lane's
    ``max_queued`` does not refuse it. That work was admitted when its first job was; a
    full lane refusing the hand-over would roll the finished part back (``reject``) or
    leave the rest with no job to do it (``drop``). One job ends as the next is queued,
    so the lane holds no more jobs for it.
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
        continuation=continuation,
    )
    return jobs[0] if jobs else None


def _check_args(spec: HandlerSpec, args_list: list[dict[str, Any]]) -> None:
    """Args the handler cannot take are refused here, not a job that dies (PermanentError)
    at its first run: a missing required argument, or one it does not accept."""
    for index, args in enumerate(args_list):
        if fits(spec.func, args):
            continue
        try:
            bind(spec, None, args)
        except InvalidJob as exc:
            where = f"job {index} of {len(args_list)}: " if len(args_list) > 1 else ""
            raise InvalidJob(f"{where}{exc}") from None


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
    continuation: bool = False,
) -> list[Job]:
    """Enqueue one job per args dict with the same options; returns the jobs in order.

    ``unique_keys`` gives each job its own key (one per args dict): a key already held by a
    queued or running job returns that job instead, all in a few statements whatever the
    count, so bulk producers (discovery, refreshers) need no loop of single enqueues.
    """
    spec = get_handler(kind)
    if lane is not None and (problem := lane_problem(lane)):
        raise InvalidJob(problem)
    args_list = list(args_list)
    args_text = _args_array(args_list)
    _check_args(spec, args_list)
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
    if keys is None and spec.unique:
        keys = [_args_key(kind, _args_json(args)) for args in args_list]
    room_checked = chosen.max_queued is not None and not continuation
    if room_checked and not _admitted(kind, chosen, args_list, keys):
        return []  # dropped (on_full "drop"), logged
    locks = [_locks(spec, args) for args in args_list] if spec.locks else None
    options = {
        "kind": kind,
        "lane": chosen.name,
        "priority": priority,
        "max_attempts": attempts_budget,
        "lease_seconds": lease,
    }
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


def _admitted(
    kind: str, chosen: lane_config.Lane, args_list: list[dict[str, Any]], keys: list[str] | None
) -> bool:
    """Whether the lane's ``max_queued`` has room for the jobs; ``False`` when they are
    dropped (``on_full: "drop"``), ``LaneFull`` when refused.

    Only the jobs that would be new count: a unique key an active job already holds
    returns that job and adds nothing, so an idempotent producer repeating its keys is
    never refused (or told its work was dropped) by a full lane. The count is read without
    a lock (no producer waits on another's transaction): producers enqueueing at the same
    moment can together overshoot the bound by their batches (docs/handlers.md).
    """
    assert chosen.max_queued is not None
    new = len(args_list)
    if keys is not None:
        held = active_by_key(keys)
        new = len({key for key in keys if key not in held})
        if not new:
            return True
    queued = Job.objects.filter(lane=chosen.name, state=State.QUEUED).count()
    if queued + new <= chosen.max_queued:
        return True
    message = f"lane {chosen.name!r} is full ({queued} of {chosen.max_queued} queued)"
    if new > 1:  # a batch is refused whole: it may be what does not fit
        message = (
            f"lane {chosen.name!r} has room for {max(0, chosen.max_queued - queued)} "
            f"more jobs ({queued} of {chosen.max_queued} queued), not "
            f"{new}: nothing enqueued"
        )
    if chosen.on_full == "drop":
        log.warning("job_dropped", kind=kind, lane=chosen.name, count=len(args_list))
        return False
    log.warning("lane_full", kind=kind, lane=chosen.name, error=message)
    raise LaneFull(message)


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
    job outside a transaction is one round trip and one commit; from ``sql.COPY_THRESHOLD``
    jobs on, one statement draws the ids (and sends the NOTIFY) and COPY writes the rows,
    in a savepoint or a transaction of its own (``_copy_new``). SQLite: one executemany.
    """
    delay_seconds = delay.total_seconds() if isinstance(delay, timedelta) else delay
    jobs: list[Job] = []
    if sql.is_postgres() and len(args_list) >= sql.COPY_THRESHOLD:
        with transaction.atomic():  # a savepoint inside the caller's transaction
            _copy_new(jobs, common, args_list, locks, delay_seconds, run_at, delay)
    elif sql.is_postgres():
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
                common, list(map(encode_accepted_args, args_list)), locks, delay_seconds, run_at
            )
            if _due_now(delay, run_at):
                _notify(common["lane"])  # this process's idle workers, after commit
        _add_jobs(jobs, common, ids, job_run_at, created_at, args_list, locks)
    return jobs


def _copy_new(
    jobs: list[Job],
    common: dict[str, Any],
    args_list: list[dict[str, Any]],
    locks: list[list[str]] | None,
    delay_seconds: float | None,
    run_at: datetime | None,
    delay: float | timedelta | None,
) -> None:
    """PostgreSQL, a large batch, inside a transaction: draw the ids (with the clock and
    the wake-up), then COPY the rows in chunks, building each chunk's jobs while the
    server copies the one before. The args were validated (``_args_array``): encoding
    them one by one cannot fail."""
    channels = _wake_up(common["lane"], delay, run_at)
    ids, job_run_at, created_at = sql.draw_job_ids(
        len(args_list), delay_seconds, run_at, channels, common["lane"]
    )
    encode = encode_accepted_args
    size = sql.COPY_CHUNK
    with sql.copy_jobs(common, job_run_at, created_at) as write:
        for start in range(0, len(args_list), size):
            end = start + size
            chunk = args_list[start:end]
            chunk_locks = locks[start:end] if locks else None
            write(ids[start:end], [encode(args) for args in chunk], chunk_locks)
            _add_jobs(jobs, common, ids[start:end], job_run_at, created_at, chunk, chunk_locks)


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
    if isinstance(keys, str | bytes):  # a sequence too: one key per character
        raise InvalidJob("unique_keys must be a list of keys, one per job, not one string")
    keys = list(keys)
    if len(keys) != count:
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
    taken = set(active_by_key(keys))
    fresh: dict[str, Job] = {}
    for key, job in zip(keys, jobs, strict=True):
        if key not in taken:
            fresh.setdefault(key, job)
    Job.objects.bulk_create(list(fresh.values()), batch_size=2000, ignore_conflicts=True)
    active = active_by_key(keys)
    for key, job in zip(keys, jobs, strict=True):
        if key not in active:  # its holder finished between our reads
            active[key], _ = _create_unique(job)
    for key in sorted(taken):
        log.info("job_deduplicated", job_id=active[key].pk, unique_key=key)
    return [active[key] for key in keys], [active[key] for key in fresh]


def active_by_key(keys: Sequence[str]) -> dict[str, Job]:
    """The queued or running job holding each of ``keys`` (read in bounded chunks)."""
    found: dict[str, Job] = {}
    distinct = sorted(set(keys))
    for start in range(0, len(distinct), KEYS_PER_QUERY):
        chunk = distinct[start : start + KEYS_PER_QUERY]
        for job in Job.objects.filter(HOLDS_ITS_KEY, unique_key__in=chunk):
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
        existing = Job.objects.filter(HOLDS_ITS_KEY, unique_key=job.unique_key).first()
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


def check_handler_args(spec: HandlerSpec, args: dict[str, Any]) -> None:
    """Refuse (``InvalidJob``) args this handler cannot take, or cannot derive its locks
    from: what every enqueue of them would refuse, said before the first one (a schedule's
    args, at ``manage.py check`` and scheduler start)."""
    _check_args(spec, [args])
    if spec.locks:
        _locks(spec, args)


def check_args(args: Any) -> None:
    """Refuse (``InvalidJob``) args that enqueue would refuse, for declarations checked
    long before their first enqueue (a schedule's, at ``manage.py check``)."""
    _args_json(args)


def _args_json(args: Any) -> str:
    """The args as JSON text; refuses anything that is not a JSON object."""
    if not isinstance(args, dict):
        raise InvalidJob(f"job args must be a JSON object, not {type(args).__name__}")
    try:
        text = ARGS_ENCODER.encode(args)
    except (TypeError, ValueError) as exc:
        raise InvalidJob(f"job args are not JSON-serializable: {exc}") from None
    if ("\\u0000" in text or "\\ud" in text) and (problem := unstorable(args)):
        raise InvalidJob(f"job args {problem}")
    return text


def unstorable(value: Any) -> str | None:
    """Why a JSON value cannot be stored on every database (NUL, lone surrogates), or None:
    SQLite keeps them, PostgreSQL's jsonb refuses them, so a job that works on one would
    fail on the other. Job args and handler results alike."""
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
        problem = unstorable(key) if isinstance(key, str) else None
        if problem := problem or unstorable(item):
            return problem
    return None


def _validated_max_attempts(max_attempts: int | None, spec: HandlerSpec) -> int:
    if max_attempts is None:
        return spec.max_attempts
    if problem := options.max_attempts_problem(max_attempts):
        raise InvalidJob(problem)
    return max_attempts


def _validated_lease_seconds(lease_seconds: float | None, spec: HandlerSpec) -> float:
    if lease_seconds is None:
        return _lease_seconds(spec)
    if problem := options.lease_seconds_problem(lease_seconds):
        raise InvalidJob(problem)
    return float(lease_seconds)


def _validated_priority(priority: int) -> None:
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not -32768 <= priority <= 32767
    ):
        raise InvalidJob(f"priority must be an integer from -32768 to 32767, not {priority!r}")


def _run_at_expression(delay: float | timedelta | None, run_at: datetime | None) -> Any:
    if delay is not None and run_at is not None:
        raise InvalidJob("give delay or run_at, not both")
    if run_at is not None:
        if not isinstance(run_at, datetime):
            raise InvalidJob(f"run_at must be a timezone-aware datetime, not {run_at!r}")
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
    if problem := options.delay_problem(delay):  # also refuses NaN, a string, a bool
        raise InvalidJob(problem)
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
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
