"""The engine's tables: jobs, the attempt record of each claim (leases), and workers.

Only the engine (``jobs.engine``, ``jobs.enqueueing``, ``jobs.operations``) changes a
job's state; these classes hold data and indexes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now


class RowidField(models.BigAutoField):
    """An id SQLite keeps as the table's plain rowid, without ``AUTOINCREMENT``.

    ``AUTOINCREMENT`` writes ``sqlite_sequence`` on every insert, and on every upsert even
    when it updates: with the attempt record and its counter both keyed by it, one page
    more in each settle's commit, a twentieth of a SQLite job's cost (docs/benchmarks.md).
    For rows whose ids nothing shows, orders by or expects to only grow, the rowid's own
    "highest plus one" does. PostgreSQL's column is the same identity column as before.
    """

    def db_type_suffix(self, connection: Any) -> str | None:
        if connection.vendor == "sqlite":
            return None
        return super().db_type_suffix(connection)


class State(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    DEAD = "dead"
    CANCELLED = "cancelled"


ACTIVE_STATES = (State.QUEUED, State.RUNNING)
FINISHED_STATES = (State.SUCCEEDED, State.DEAD, State.CANCELLED)
# Every state but succeeded: the rows ``job_state_idx`` holds, as equalities joined by OR
# (SQLite uses a partial index only for a query that repeats one of its OR's terms, or
# all of a leading run of them: ``ACTIVE`` below, never ``state IN (…)``).
INDEXED_STATES = (State.QUEUED, State.RUNNING, State.DEAD, State.CANCELLED)
ENDED_BADLY = (State.DEAD, State.CANCELLED)  # job_ended_badly_idx: (state, id) of these


def in_states(*states: str) -> Q:
    """``state`` is one of ``states``, as ``state = … OR state = …``: the form in which
    SQLite finds the state index for it (``state IN (…)`` would scan the table)."""
    query = Q()
    for state in states:
        query |= Q(state=state)
    return query


ACTIVE = in_states(*ACTIVE_STATES)  # queued or running, through job_state_idx


class Outcome(models.TextChoices):
    """How one attempt (one claim) ended."""

    RUNNING = "running"  # the lease is live
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # the handler raised; the job was retried or went dead
    LEASE_EXPIRED = "lease_expired"  # the worker vanished; the job was reclaimed
    RELEASED = "released"  # graceful shutdown gave the job back, not charged
    CANCELLED = "cancelled"


class Job(models.Model):
    kind = models.CharField(max_length=200)
    lane = models.CharField(max_length=100, default="default")
    args = models.JSONField(default=dict)
    priority = models.SmallIntegerField(default=0)
    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    run_at = models.DateTimeField(db_default=Now())
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=10)
    lease_seconds = models.FloatField(default=60)
    lease_token = models.BigIntegerField(default=0)
    leased_by = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    # NULL, not "": only jobs that have a key take part in the partial unique index.
    unique_key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    cancel_requested = models.BooleanField(default=False)
    # The resources this job must hold to run (I8): sorted, deduplicated, fixed at enqueue.
    locks = models.JSONField(default=list, blank=True)
    # A queued job a claim found blocked: one of its resource locks (this one) was held.
    # It leaves the runnable index until that lock is released (jobs.sql.PG_PROMOTE);
    # the job is still ``queued`` (PostgreSQL only; NULL on SQLite).
    blocked_by = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    result = models.JSONField(null=True, blank=True)
    progress = models.JSONField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # Claim reads only runnable rows, however many finished (or blocked) ones the
            # table holds: lane by lane, priority by priority, in run_at order. An idle
            # worker's "when is the next job due?" walks it the same way (sql.next_due_in).
            models.Index(
                fields=["lane", "-priority", "run_at", "id"],
                name="job_runnable_idx",
                condition=Q(state="queued", blocked_by__isnull=True),
            ),
            # The blocked jobs of each resource, best first: what a release promotes.
            models.Index(
                fields=["blocked_by", "-priority", "run_at", "id"],
                name="job_blocked_idx",
                condition=Q(state="queued", blocked_by__isnull=False),
            ),
            # Jobs by state, for the engine (reclaim reads the running rows, one per busy
            # worker; a lane's running count; the queued counts) and operators (dead jobs
            # by lane and kind). Not the succeeded ones: that history only grows (ten
            # million rows is ten million entries nothing reads: their counts are
            # jobs_outcomecount's), and a settled job's row then enters no state index at
            # all (migration 0014_i16_state_index). No index holds lease_expires_at or
            # heartbeat_at, so a heartbeat is a HOT update (migration 0007_i16 leaves room
            # on each page for it).
            models.Index(
                fields=["state", "lane", "kind"],
                name="job_state_idx",
                condition=in_states(*INDEXED_STATES),
            ),
            # Dead and cancelled jobs newest (or oldest) first: the dead-jobs listing, its
            # pages and requeue batches, list_jobs --state dead|cancelled. By state alone
            # the pages walked the primary key past every newer job of other states
            # (0.3 s a page behind a million newer succeeded jobs).
            models.Index(
                fields=["state", "id"],
                name="job_ended_badly_idx",
                condition=in_states(*ENDED_BADLY),
            ),
            # Pruning by age reads only finished rows.
            models.Index(
                fields=["finished_at"],
                name="job_finished_idx",
                condition=Q(finished_at__isnull=False),
            ),
        ]
        constraints = [
            # unique_key dedupes while a job with that key is queued or running.
            models.UniqueConstraint(
                fields=["unique_key"],
                name="job_unique_key_active",
                condition=Q(state__in=["queued", "running"]) & Q(unique_key__isnull=False),
            ),
            models.CheckConstraint(
                condition=Q(state__in=[s.value for s in State]), name="job_state_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.pk} {self.kind} ({self.state})"


if TYPE_CHECKING:
    BoolLookup = models.Lookup[bool]
else:
    BoolLookup = models.Lookup  # not subscriptable at run time


class HoldsItsKey(BoolLookup):
    """``state__holds_its_key=True``: ``state IN ('queued', 'running')``, the states written
    into the SQL, as ``job_unique_key_active``'s own condition.

    SQLite uses a partial index only when the query's terms imply its condition, and
    cannot tell what bound parameters hold: ``state IN (%s, %s)`` (Django's
    ``state__in``) read the whole table, ten million finished rows included, at every
    look-up of a unique key (each ``enqueue_many`` with keys did two).
    """

    lookup_name = "holds_its_key"

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[str | int, ...]]:
        lhs, params = self.process_lhs(compiler, connection)
        states = ", ".join(f"'{state}'" for state in ACTIVE_STATES)  # the enum's own values
        return f"{lhs} IN ({states})", tuple(params)


Job._meta.get_field("state").register_lookup(HoldsItsKey)
#: Jobs that hold their unique key (queued or running), through ``job_unique_key_active``.
HOLDS_ITS_KEY = Q(state__holds_its_key=True)


class Lease(models.Model):
    """One claim of a job: the record of that attempt, kept after it ends."""

    id = RowidField(primary_key=True)
    # The database deletes a job's attempts with it: pruning is one DELETE, not a Python
    # loop over every attempt row. No index of its own: the unique (job, lease_token)
    # serves every lookup by job (and the cascade).
    job = models.ForeignKey(Job, on_delete=models.DB_CASCADE, related_name="leases", db_index=False)
    attempt = models.PositiveIntegerField()
    lease_token = models.BigIntegerField()
    worker_id = models.CharField(max_length=200)
    acquired_at = models.DateTimeField(db_default=Now())
    expires_at = models.DateTimeField()
    released_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=Outcome.choices, default=Outcome.RUNNING)
    error_class = models.CharField(max_length=300, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    traceback = models.TextField(blank=True, default="")
    context = models.JSONField(default=dict, blank=True)
    # Written by the settle that ends the attempt (NULL while it runs, when reclaim ended it,
    # or when a worker of 0.1 settled it): the job's state after it and whether a
    # cancel had been requested. With acquired_at and released_at they are the attempt's
    # "claimed" and "settled" events (``jobs.events``), which are not stored twice.
    settled_state = models.CharField(max_length=16, null=True, blank=True)  # noqa: DJ001
    cancel_requested = models.BooleanField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["job", "lease_token"], name="lease_job_token_unique")
        ]

    def __str__(self) -> str:
        return f"lease {self.lease_token} of job {self.job_id} ({self.outcome})"


class JobLock(models.Model):
    """A resource held by a running job, tied to its lease token (I8).

    The resource name is the primary key, so two holders cannot coexist: a claimer that
    races another for the same resource fails its whole claim statement on this key and
    claims again. Rows are written by the claim and deleted in the same transaction as the
    settle or reclaim that ends the lease, so a lock never outlives its lease for longer
    than the reclaim interval.
    """

    # Only ever compared for equality: the primary key's index serves it. Migration
    # 0006_i16 drops the varchar_pattern_ops ("_like") index Django adds on PostgreSQL; an
    # AlterField of this column would re-create it (drop it again in the same migration).
    resource = models.CharField(max_length=255, primary_key=True)
    job = models.ForeignKey(Job, on_delete=models.DB_CASCADE, related_name="held_locks")
    lease_token = models.BigIntegerField()
    acquired_at = models.DateTimeField(db_default=Now())

    def __str__(self) -> str:
        return f"lock {self.resource} held by job {self.job_id} (lease {self.lease_token})"


class JobEvent(models.Model):
    """The job's append-only activity log.

    Each event is inserted by the same statement or transaction as the state change it
    describes, so the log has no gaps and no events for changes that rolled back.
    """

    # No index of its own: jobevent_job_idx (job, id) serves every lookup by job.
    job = models.ForeignKey(Job, on_delete=models.DB_CASCADE, related_name="events", db_index=False)
    at = models.DateTimeField(db_default=Now())
    event = models.CharField(max_length=32)
    lease_token = models.BigIntegerField(null=True, blank=True)
    worker_id = models.CharField(max_length=200, blank=True, default="")
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        indexes = [models.Index(fields=["job", "id"], name="jobevent_job_idx")]

    def __str__(self) -> str:
        return f"{self.event} of job {self.job_id} at {self.at}"


class Worker(models.Model):
    """A running (or stopped) worker process and its last heartbeat."""

    id = models.CharField(max_length=200, primary_key=True)
    host = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    lanes = models.JSONField(default=list, blank=True)
    # The job kinds it has handlers for (all it claims); NULL: not recorded (an older
    # worker, which claims every kind).
    kinds = models.JSONField(null=True, blank=True)
    started_at = models.DateTimeField(db_default=Now())
    heartbeat_at = models.DateTimeField(db_default=Now())
    stopped_at = models.DateTimeField(null=True, blank=True)
    current_job = models.BigIntegerField(null=True, blank=True)

    def __str__(self) -> str:
        return f"worker {self.id}"


class CatchUp(models.TextChoices):
    ONCE = "once"  # missed slots collapse into one run
    SKIP = "skip"  # missed slots are skipped; the schedule waits for the next one


class Schedule(models.Model):
    """A recurring job and its slot ledger.

    ``next_due_at`` is the next slot; advancing it and enqueueing the slot's job happen in
    one transaction guarded by the value read (I5). The row outlives job pruning, so a
    slot can never look unrun because its job was deleted.
    """

    name = models.CharField(max_length=200, unique=True)
    kind = models.CharField(max_length=200)
    args = models.JSONField(default=dict, blank=True)
    lane = models.CharField(max_length=100, null=True, blank=True)  # noqa: DJ001
    cron = models.CharField(max_length=200, blank=True, default="")
    every = models.FloatField(null=True, blank=True)  # seconds, when not a cron schedule
    timezone = models.CharField(max_length=64, default="UTC")
    catch_up = models.CharField(max_length=4, choices=CatchUp.choices, default=CatchUp.ONCE)
    origin = models.CharField(max_length=20, default="settings")  # "settings" or "handler"
    declared = models.BooleanField(default=True)  # still in code or settings
    paused = models.BooleanField(default=False)  # an operator paused it
    next_due_at = models.DateTimeField()
    last_slot_at = models.DateTimeField(null=True, blank=True)
    last_job_id = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        indexes = [
            models.Index(
                fields=["next_due_at"],
                name="schedule_due_idx",
                condition=Q(declared=True, paused=False),
            )
        ]

    def __str__(self) -> str:
        return f"schedule {self.name} ({self.cron or f'every {self.every:g}s'})"


# Upper bounds (seconds) of the attempt-duration histogram's buckets; index len() is +Inf.
# Changing them re-labels the stored counts: only ever append larger bounds.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
ATTEMPT_COUNT_SHARDS = 16  # rows per (kind, outcome, bucket): concurrent settles spread out


class OutcomeCount(models.Model):
    """How many attempts of a kind in a lane ended with an outcome, leaving the job in a
    state, by duration bucket: one row write per settled attempt serves two readers.

    * the metrics' counters (``holdfast_job_attempts_total``,
      ``holdfast_job_duration_seconds``) sum it by (kind, outcome, bucket);
    * the finished jobs' counts sum it by (lane, state) over the finished states, plus
      ``JobCount``, which holds every transition into or out of a finished state that is
      not an attempt ending (cancel of a queued job, requeue of a dead one, pruning).

    The settle statement (``jobs.sql``) and reclaim add to a row in the same statement
    that records the attempt's outcome, so both stay exact, survive restarts and are never
    touched by pruning. ``shard`` (the backend's pid modulo ``ATTEMPT_COUNT_SHARDS``) keeps
    concurrent workers off each other's row locks; readers sum over it.
    """

    id = RowidField(primary_key=True)
    kind = models.CharField(max_length=200)
    lane = models.CharField(max_length=100)
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    state = models.CharField(max_length=16, choices=State.choices)  # the job's, after it
    bucket = models.PositiveSmallIntegerField()  # index into DURATION_BUCKETS; len() is +Inf
    shard = models.PositiveSmallIntegerField(default=0)
    count = models.BigIntegerField(default=0)
    seconds = models.FloatField(default=0.0)  # the attempts' summed durations

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "lane", "outcome", "state", "bucket", "shard"],
                name="outcome_count_key",
            )
        ]

    def __str__(self) -> str:
        return f"{self.count} {self.kind} attempts {self.outcome} → {self.state}"


class JobCount(models.Model):
    """How many jobs of a lane are in a finished state (succeeded, dead, cancelled) now:
    what ``queue_status`` and the metrics' ``holdfast_jobs`` report for those states, read
    without scanning the finished history.

    The count of (lane, state) is this table's sum plus ``OutcomeCount``'s for the same
    lane and state. Attempts that end (settle, reclaim) are counted there; every other
    transition into or out of a finished state adds its +1 or -1 here in its own
    transaction (cancel of a queued job, requeue of a dead job in ``jobs.operations``; pruning
    in ``jobs.retention``), so the two sums together
    equal ``count(*)`` of the lane's rows in that state. ``shard`` (the backend's
    pid modulo ``ATTEMPT_COUNT_SHARDS``) keeps concurrent settles off each other's row
    locks; a shard's own count may go below zero, only the sum means anything.
    ``manage.py recount_jobs`` rebuilds the rows from ``jobs_job``.
    """

    lane = models.CharField(max_length=100)
    state = models.CharField(max_length=16, choices=State.choices)
    shard = models.PositiveSmallIntegerField(default=0)
    count = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["lane", "state", "shard"], name="job_count_key")
        ]

    def __str__(self) -> str:
        return f"{self.count} {self.state} jobs in lane {self.lane} (shard {self.shard})"
