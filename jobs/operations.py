"""Operator actions and queries: look jobs up, requeue dead ones, cancel, prune.

Each action is one guarded statement or one ``transaction.atomic()`` block per job (the
guard, e.g. ``state = 'dead'``, in plain sight), and one structlog event per change.
The commands, the HTTP API and the Django Tasks backend call these.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.apps import apps
from django.db import IntegrityError, OperationalError, connection, transaction
from django.db.models import Case, F, Q, QuerySet, TextField, Value, When
from django.db.models.functions import Concat, Now
from django.tasks import Task
from django.utils.module_loading import import_string

from . import engine, enqueueing, lanes, notify, registry, retention, sql
from .exceptions import (
    InvalidJob,
    JobNotFound,
    StateConflict,
    UnknownKind,
)
from .log import get_logger
from .models import INDEXED_STATES, Job, JobCount, OutcomeCount, State, in_states
from .registry import DEFAULT_MAX_ATTEMPTS, TASK_KIND, get_handler

log = get_logger("jobs.operations")

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


def check_filters(kind: str | None, lane: str | None) -> None:
    """A filter naming a kind or lane that nothing knows is bad input (DESIGN §8: an
    unknown kind is exit 2), not an empty answer: a typo must not look like "none". Known
    is a declared lane or a registered handler (or Django task), or one that jobs have or
    had (a kind retired since, a lane removed from settings: ``_seen``). Called when a
    filtered answer came back empty, so the look-up costs only then."""
    declared = lanes.lanes()
    if (
        lane is not None
        and lane not in declared
        and not _seen(
            Q(lane=lane),
            OutcomeCount.objects.filter(lane=lane),
            JobCount.objects.filter(lane=lane),
        )
    ):
        names = ", ".join(sorted(declared))
        raise InvalidJob(f"unknown lane {lane!r} (no job has it; declared: {names})")
    if kind is None or kind in registry.kinds() or is_task(kind):
        return
    if not _seen(kind_filter(kind), OutcomeCount.objects.filter(kind=kind)):
        raise UnknownKind(f"unknown kind {kind!r}: no handler, no task and no job of it")


def _seen(jobs: Q, *counts: QuerySet[Any]) -> bool:
    """Do or did jobs have it: a job in any state but succeeded (``job_state_idx``: the
    active, dead and cancelled rows, never the succeeded history, which at ten million
    rows took seconds per mistyped name), or a row of ``counts``: attempts or finished
    jobs ever counted with it (``jobs_outcomecount``, ``jobs_jobcount``: small tables that
    pruning leaves, so a name stays known after its last job is pruned). Not seen: a kind
    whose only jobs succeeded under 0.1, which counted no attempts (``recount_jobs``
    counts lanes, not kinds), and a Django task's path whose jobs all succeeded (its
    attempts are counted as ``django.task``)."""
    indexed = Job.objects.filter(in_states(*INDEXED_STATES) & jobs)
    return indexed.exists() or any(count.exists() for count in counts)


def is_task(path: str) -> bool:
    """Is ``path`` the dotted path of a Django task function (``@task``)?

    Only a module of an installed app is imported to tell: the path comes from a filter
    that any token holder or operator types, and importing ``this`` or ``antigravity``
    runs their code."""
    module = path.rpartition(".")[0]
    if not any(
        module == app.name or module.startswith(f"{app.name}.") for app in apps.get_app_configs()
    ):
        return False
    try:
        found = import_string(path)
    except Exception:  # any module of an app may fail to import (LookupError: an app's
        return False  # admin.py without django.contrib.admin): not a task, never a 500
    return isinstance(found, Task)


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


def rows_by_id(found: QuerySet[Any], start: int, stop: int) -> list[Any]:
    """``found[start:stop]``, read in two steps: the ids (through an index alone), then
    their rows.

    Asked for whole rows in id order, PostgreSQL walks the primary key and filters, since
    its statistics cannot tell that, say, the dead jobs are all older than the million
    succeeded ones in the way: 0.3 s a page of dead jobs. The ids are read without plain
    index scans (``sql.ids_through_an_index``), so through ``job_ended_badly_idx`` (dead
    and cancelled jobs by id) alone, or a bitmap of ``job_state_idx``: 0.1 ms a page.
    """
    with sql.ids_through_an_index():
        ids = list(found.values_list("pk", flat=True)[start:stop])
    return list(found.filter(pk__in=ids)) if ids else []


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
        for key, job in enqueueing.active_by_key(
            [job.unique_key for job in jobs if job.unique_key]
        ).items()
    }
    requeued: list[int] = []
    conflicts: list[dict[str, Any]] = []

    def conflict(job: Job, reason: str) -> None:
        conflicts.append({"id": job.pk, "reason": reason})  # the caller reports them

    for job in jobs:
        key = job.unique_key
        if job.state != State.DEAD:  # first: a live job "holds" its own key
            conflict(job, f"job {job.pk} is {job.state}, not dead: nothing to requeue")
            continue
        if key and key in holders:
            holder, state = holders[key]
            conflict(job, f"job {job.pk}: its unique key {key!r} is held by job {holder} ({state})")
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
                        engine.record_event(job.pk, "requeued", by=actor)
                        sql.count_jobs({(job.lane, State.DEAD): -1})  # out of the dead count
            except IntegrityError:  # a live job took the key since we looked
                holder_job = enqueueing.active_by_key([key]).get(key) if key else None
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


# What a requeue reads of a job: enough to decide and to write it, nothing of its args,
# result or errors (a backlog of dead jobs is read a batch at a time, these columns only).
REQUEUE_FIELDS = ("pk", "kind", "lane", "state", "unique_key")


def left_out(
    ids: Sequence[int],
    chosen: set[int],
    kind: str | None,
    lane: str | None,
    actor: str = "operator",
    flag: str = "",
) -> list[dict[str, Any]]:
    """The conflicts of named jobs a selection (``chosen``) left out: one that is not dead
    (as ``requeue_each`` words it), or a dead one outside the ``kind`` or ``lane`` given,
    which must not be requeued all the same. ``flag`` prefixes the filters' names in the
    reason (``--`` for the command's options)."""
    wanted = " and ".join(
        f"{flag}{name} {value}" for name, value in (("kind", kind), ("lane", lane)) if value
    )
    jobs = Job.objects.filter(pk__in=[pk for pk in ids if pk not in chosen]).only(*REQUEUE_FIELDS)
    conflicts = requeue_each(
        [job for job in jobs if job.state != State.DEAD], actor=actor
    ).conflicts
    return conflicts + [
        {"id": job.pk, "reason": f"job {job.pk} is not of {wanted}: not requeued"}
        for job in jobs
        if job.state == State.DEAD
    ]


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
        if not sql.is_lock_wait(exc):
            raise
        if not sql.is_postgres():
            # SQLite's lock is the whole database's, held by any process (not this job's
            # worker): the database is busy, which the API answers 503 (retry), not the
            # 409 of a job whose state refuses it.
            raise OperationalError(
                "the database is locked by another process's open transaction (a frozen "
                "one is killed by the workers once its lease expired): nothing changed, "
                "try again"
            ) from None
        raise StateConflict(
            f"job {job_id} is locked by an open transaction (its worker may be frozen; "
            "the server ends such sessions within one lease): nothing changed, try again"
        ) from None


CANCEL_PASSES = 5  # looks at a job that keeps moving between queued and running


def _cancel(job_id: int, actor: str) -> Job:
    """Each pass tries the three guarded transitions in turn. On PostgreSQL a worker can
    commit between them (an UPDATE that matches nothing locks nothing): a running attempt
    retried or released to ``queued`` after the first, say. So a job found still queued or
    running is looked at again; only a finished one is refused."""
    for _ in range(CANCEL_PASSES):
        job = _cancel_pass(job_id, actor)
        if job is not None:
            return job
        job = get_job(job_id)  # raises JobNotFound for an unknown id
        if job.state not in (State.QUEUED, State.RUNNING):
            raise StateConflict(f"job {job_id} is {job.state}: it has finished, nothing to cancel")
    raise StateConflict(f"job {job_id} kept changing state: nothing changed, try again")


def _cancel_pass(job_id: int, actor: str) -> Job | None:
    if Job.objects.filter(pk=job_id, state=State.QUEUED).update(
        state=State.CANCELLED,
        cancel_requested=True,
        finished_at=Now(),
        last_error=Case(  # a job waiting to retry ran before: its last error is kept
            When(attempts=0, then=Value(f"cancelled by {actor} before it ran")),
            default=Concat(
                Value(f"cancelled by {actor} while it waited to run again; before: "),
                F("last_error"),
                output_field=TextField(),
            ),
            output_field=TextField(),
        ),
        updated_at=Now(),
    ):
        job = get_job(job_id)
        sql.count_jobs({(job.lane, State.CANCELLED): 1})
        engine.record_event(job_id, "cancelled", by=actor)
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
        engine.record_event(
            job_id, "cancel_requested", job.lease_token, job.leased_by or "", by=actor
        )
        if sql.is_postgres():
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_notify(%s, %s)", [notify.CANCEL_CHANNEL, str(job_id)])
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
    return None


def prune(
    older_than: timedelta,
    include_dead: bool = False,
    batch: int = 5000,
    tally: dict[str, int] | None = None,
) -> int:
    """Delete finished jobs (and their attempts) that finished more than ``older_than`` ago.

    Succeeded and cancelled jobs only, unless ``include_dead``: dead jobs are evidence an
    operator may still need. Queued and running jobs are never pruned. Deletes in batches
    so that no single transaction holds the table for long; returns how many went.

    Each batch commits on its own, so ``jobs_pruned`` is logged however the run ends: a
    database error or an interruption (``interrupted``) after some batches still says how
    many went. ``tally`` (per state) is kept up to date batch by batch for the caller.
    """
    states = [State.SUCCEEDED, State.CANCELLED] + ([State.DEAD] if include_dead else [])
    tally = {} if tally is None else tally
    ended_by: BaseException | None = None
    try:
        retention.prune(dict.fromkeys(states, older_than), batch=batch, tally=tally)
    except BaseException as exc:
        ended_by = exc
        raise
    finally:
        fields: dict[str, Any] = {
            "count": sum(tally.values()),
            "older_than_s": older_than.total_seconds(),
            "include_dead": include_dead,
        }
        if ended_by is None:
            log.info("jobs_pruned", **fields)
        else:
            log.warning("jobs_pruned", **fields, interrupted=_error_name(ended_by))
    return sum(tally.values())


def _error_name(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


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
