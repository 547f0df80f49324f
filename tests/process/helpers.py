"""Database-side helpers of the process tests: wait for job states, describe jobs in
failure messages, freeze a worker outside any transaction, and check what the engine
recorded against its invariants."""

from __future__ import annotations

import json
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import combinations, pairwise
from pathlib import Path
from typing import Any

from django.db import connection
from django.utils.dateparse import parse_datetime

from jobs import attempts, enqueueing
from jobs.models import FINISHED_STATES, Job, JobEvent, Lease, Outcome
from tests.support.workers import WorkerPool, WorkerProc, wait_until
from tests.testapp.models import Effect, Span


def job_summary(job_ids: Iterable[int] | None = None) -> str:
    """The jobs (and their attempts), for assertion messages."""
    jobs = Job.objects.order_by("pk")
    if job_ids is not None:
        jobs = jobs.filter(pk__in=list(job_ids))
    lines = []
    for job in jobs[:50]:
        leases = ", ".join(
            f"{lease.lease_token}:{lease.worker_id}:{lease.outcome}"
            for lease in attempts.leases(job)
        )
        lines.append(
            f"job {job.pk} {job.kind} {job.state} attempts={job.attempts} "
            f"token={job.lease_token} leased_by={job.leased_by} leases=[{leases}] "
            f"last_error={job.last_error!r}"
        )
    return "\n".join(lines) or "(no jobs)"


def wait_for_job(
    job_id: int, states: str | Iterable[str], pool: WorkerPool, timeout: float = 20.0
) -> Job:
    """Poll the job until its state is one of ``states``; return it."""
    wanted = {states} if isinstance(states, str) else set(states)

    def reached() -> Job | None:
        job = Job.objects.get(pk=job_id)
        return job if job.state in wanted else None

    return wait_until(
        reached,
        timeout,
        interval=0.1,
        message=lambda: (
            f"job {job_id} never reached {sorted(wanted)}\n"
            f"{job_summary([job_id])}\n{pool.describe()}"
        ),
    )


def wait_for_lease_outcome(
    job_id: int, lease_token: int, outcome: str, pool: WorkerPool, timeout: float = 20.0
) -> Lease:
    def reached() -> Lease | None:
        return Lease.objects.filter(job_id=job_id, lease_token=lease_token, outcome=outcome).first()

    return wait_until(
        reached,
        timeout,
        interval=0.1,
        message=lambda: (
            f"lease {lease_token} of job {job_id} never became {outcome}\n"
            f"{job_summary([job_id])}\n{pool.describe()}"
        ),
    )


def wait_for_marker(marker: Path, proc: WorkerProc, timeout: float = 15.0) -> None:
    """Wait until a test handler run by ``proc`` has written its marker file."""
    wait_until(
        lambda: marker.exists(),
        timeout,
        interval=0.02,
        message=lambda: f"{marker.name} not written\n{proc.describe()}",
    )


def database_locks_held() -> bool:
    """True while another process holds a write lock or an open transaction on the DB.

    Used after SIGSTOP: a worker frozen inside a transaction would block every other
    writer until it is continued, which is not the situation the test sets up.
    """
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND state <> 'idle'"
            )
            (busy,) = cursor.fetchone()
        return busy > 0
    probe = sqlite3.connect(connection.settings_dict["NAME"], timeout=0.2)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError:
        return True
    finally:
        probe.close()


def stop_outside_transaction(proc: WorkerProc, attempts: int = 20) -> None:
    """SIGSTOP ``proc`` at a moment when it holds no transaction open.

    Call only while ``proc`` is the only other process using the database.
    """
    for _ in range(attempts):
        proc.stop()
        time.sleep(0.05)  # let a statement in flight on the server side finish
        if not database_locks_held():
            return
        proc.cont()
        time.sleep(0.03)
    raise AssertionError(f"could not stop {proc.name} outside a transaction\n{proc.describe()}")


def every_attempt(job_ids: Iterable[int]) -> list[Lease]:
    """The attempts of these jobs (jobs.attempts: the running ones too), by job and token."""
    return [
        lease
        for job in Job.objects.filter(pk__in=list(job_ids)).order_by("pk")
        for lease in attempts.leases(job)
    ]


def overlapping_leases(job_ids: Iterable[int]) -> list[str]:
    """Attempts of one job whose recorded lease windows overlap (I1: one live lease).

    Each claim's lease starts after the previous attempt's lease was released (settled,
    released or reclaimed), and only a job's last attempt may still be running.
    """
    problems = []
    by_job: dict[int, list[Lease]] = {}
    for lease in every_attempt(job_ids):
        by_job.setdefault(lease.job_id, []).append(lease)
    for job_id, leases in by_job.items():
        for before, after in pairwise(leases):
            if before.released_at is None or before.released_at > after.acquired_at:
                problems.append(
                    f"job {job_id}: lease {before.lease_token} ({before.outcome}, released "
                    f"{before.released_at}) overlaps lease {after.lease_token} (acquired "
                    f"{after.acquired_at})"
                )
    return problems


def concurrent_jobs_per_worker(job_ids: Iterable[int]) -> list[str]:
    """Leases held at once by one worker process (I7: one job at a time per worker).

    A worker's next claim may share its previous settle's commit (same timestamp), never
    precede it. Use with workers that each have their own ``--worker-id``.
    """
    problems = []
    by_worker: dict[str, list[Lease]] = {}
    leases = sorted(every_attempt(job_ids), key=lambda lease: (lease.worker_id, lease.acquired_at))
    for lease in leases:
        by_worker.setdefault(lease.worker_id, []).append(lease)
    for worker_id, held in by_worker.items():
        for before, after in pairwise(held):
            if before.released_at is None or before.released_at > after.acquired_at:
                problems.append(
                    f"{worker_id}: job {before.job_id} (released {before.released_at}) still "
                    f"held when job {after.job_id} was claimed at {after.acquired_at}"
                )
    return problems


# --- engine invariants (issue #6) ---------------------------------------------------------

#: Runs one SQL query and returns its rows: Django's connection, or a probe of a database
#: the ORM does not point at (a throwaway cluster that restarts under the test).
Rows = Callable[[str], list[tuple[Any, ...]]]

TERMINAL_STATES = frozenset(state.value for state in FINISHED_STATES)


def django_rows(query: str) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(query)
        return cursor.fetchall()


@dataclass(frozen=True)
class _Attempt:
    job_id: int
    token: int
    outcome: str
    acquired_at: datetime
    released_at: datetime | None


@dataclass(frozen=True)
class _Event:
    job_id: int
    event: str
    token: int | None
    data: dict[str, Any]


def engine_violations(rows: Rows = django_rows, job_ids: Iterable[int] | None = None) -> list[str]:
    """How the engine's record breaks its invariants once the jobs have all finished.

    Read from the tables alone (plain SQL, so it also works on a database that restarted
    under the test): every job ended in exactly one terminal state (one terminal
    transition in its event log, plus one per operator requeue) and completed at most
    once; every claim left its attempt's record (lease tokens 1 to the job's token, each
    once: the record is written when the attempt ends, so a lost one shows here); every
    attempt has its ``claimed`` event, and every attempt that ended has
    exactly one ``settled`` or ``reclaimed`` event agreeing with its outcome; no resource
    lock is left held; and no domain write of the test handlers (``Effect``, ``Span``)
    came from a stale attempt: each lies within its own attempt's lease, and completion
    writes belong to the attempt that succeeded.
    """
    wanted = set(job_ids) if job_ids is not None else None

    def kept(job_id: int) -> bool:
        return wanted is None or job_id in wanted

    jobs, tokens = {}, {}
    for job_id, state, token in rows("SELECT id, state, lease_token FROM jobs_job"):
        if kept(job_id):
            jobs[job_id], tokens[job_id] = state, token
    attempts = [
        _Attempt(job_id, token, outcome, _instant(acquired), _instant(released))
        for job_id, token, outcome, acquired, released in rows(
            "SELECT job_id, lease_token, outcome, acquired_at, released_at FROM jobs_lease"
        )
        if kept(job_id)
    ]
    events = _events(rows, kept)
    problems = [
        f"job {job_id} is still {state}"
        for job_id, state in jobs.items()
        if state not in TERMINAL_STATES
    ]
    recorded: dict[int, list[int]] = {job_id: [] for job_id in jobs}
    for attempt in attempts:
        recorded.setdefault(attempt.job_id, []).append(attempt.token)
    problems += [
        f"job {job_id}: attempts recorded for tokens {sorted(seen)}, claimed {tokens[job_id]}"
        for job_id, seen in recorded.items()
        if job_id in tokens and sorted(seen) != list(range(1, tokens[job_id] + 1))
    ]
    problems += _terminal_transitions(jobs, events)
    problems += _attempt_events(attempts, events)
    problems += [
        f"lock {resource} still held by job {job_id} (lease {token})"
        for resource, job_id, token in rows(
            "SELECT resource, job_id, lease_token FROM jobs_joblock"
        )
        if kept(job_id)
    ]
    problems += _stale_writes(rows, attempts, kept)
    return problems


def _events(rows: Rows, kept: Callable[[int], bool]) -> list[_Event]:
    """The event log of every kept job, in time order: its ``jobs_jobevent`` rows and the
    claimed and settled events its lease rows record (as ``jobs.events`` reads them, but
    from plain SQL here). On a tie of timestamps, claimed before rows before settled."""
    logged: list[tuple[datetime | None, int, _Event]] = []
    for job_id, event, token, data, at in rows(
        "SELECT job_id, event, lease_token, data, at FROM jobs_jobevent ORDER BY id"
    ):
        parsed = data if isinstance(data, dict) else json.loads(data or "{}")
        logged.append((_instant(at), 1, _Event(job_id, event, token, parsed)))
    for job_id, token, acquired, released, state, outcome in rows(
        "SELECT job_id, lease_token, acquired_at, released_at, settled_state, outcome"
        " FROM jobs_lease"
    ):
        logged.append((_instant(acquired), 0, _Event(job_id, "claimed", token, {})))
        if state is not None:
            data = {"state": state, "outcome": outcome}
            logged.append((_instant(released), 2, _Event(job_id, "settled", token, data)))
    logged.sort(key=lambda entry: (entry[0] or datetime.min.replace(tzinfo=UTC), entry[1]))
    return [event for _, _, event in logged if kept(event.job_id)]


def assert_engine_invariants(
    rows: Rows = django_rows, job_ids: Iterable[int] | None = None, context: str = ""
) -> None:
    """Fail with every violation of :func:`engine_violations` (and ``context``) listed."""
    problems = engine_violations(rows, job_ids)
    shown = "\n".join(problems[:30])
    assert not problems, f"{len(problems)} engine invariant violations:\n{shown}\n{context}"


def _instant(value: datetime | str | None) -> datetime | None:
    """A timestamp column as an aware datetime (SQLite's raw rows hold text)."""
    if value is None or isinstance(value, datetime):
        return value
    parsed = parse_datetime(value)
    if parsed is None:
        raise ValueError(f"not a timestamp: {value!r}")
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _terminal_state(event: _Event) -> str | None:
    """The terminal state ``event`` moved its job into, if it did."""
    if event.event == "cancelled":
        return "cancelled"
    if event.event in ("settled", "reclaimed") and event.data.get("state") in TERMINAL_STATES:
        return event.data["state"]
    return None


def _terminal_transitions(jobs: dict[int, str], events: list[_Event]) -> list[str]:
    """One terminal transition per finished job (and per requeue), the last one its state."""
    problems = []
    for job_id, state in jobs.items():
        mine = [event for event in events if event.job_id == job_id]
        ends = [end for event in mine if (end := _terminal_state(event))]
        requeues = sum(event.event == "requeued" for event in mine)
        expected = requeues + (state in TERMINAL_STATES)
        if len(ends) != expected:
            problems.append(
                f"job {job_id} ({state}) has {len(ends)} terminal transitions {ends} "
                f"for {requeues} requeues"
            )
        elif ends and state in TERMINAL_STATES and ends[-1] != state:
            problems.append(f"job {job_id} is {state} but its last terminal event says {ends[-1]}")
    return problems


def _attempt_events(attempts: list[_Attempt], events: list[_Event]) -> list[str]:
    """Each attempt: one ``claimed`` event, and one end event once it ended, in agreement."""
    problems = []
    by_attempt: dict[tuple[int, int | None], list[_Event]] = {}
    for event in events:
        by_attempt.setdefault((event.job_id, event.token), []).append(event)
    known = {(attempt.job_id, attempt.token) for attempt in attempts}
    for (job_id, token), logged in by_attempt.items():
        if token is not None and (job_id, token) not in known:
            names = [event.event for event in logged]
            problems.append(f"job {job_id}: events {names} name lease {token}, which has no row")
    succeeded: Counter[int] = Counter()
    for attempt in attempts:
        logged = by_attempt.get((attempt.job_id, attempt.token), [])
        names = [event.event for event in logged]
        where = f"job {attempt.job_id} lease {attempt.token} ({attempt.outcome}): events {names}"
        if names.count("claimed") != 1:
            problems.append(f"{where}: not exactly one claimed event")
        ends = [event for event in logged if event.event in ("settled", "reclaimed")]
        if attempt.outcome == Outcome.RUNNING:
            if ends or attempt.released_at is not None:
                problems.append(f"{where}: still running, yet it ended")
            continue
        if len(ends) != 1:
            problems.append(f"{where}: not exactly one settled or reclaimed event")
        elif ends[0].event == "reclaimed" and attempt.outcome != Outcome.LEASE_EXPIRED:
            problems.append(f"{where}: reclaimed, but the attempt's outcome disagrees")
        elif ends[0].event == "settled" and ends[0].data.get("outcome") != attempt.outcome:
            problems.append(f"{where}: settled as {ends[0].data.get('outcome')}")
        succeeded[attempt.job_id] += attempt.outcome == Outcome.SUCCEEDED
    problems += [f"job {job_id} completed {n} times" for job_id, n in succeeded.items() if n > 1]
    return problems


def _stale_writes(rows: Rows, attempts: list[_Attempt], kept: Callable[[int], bool]) -> list[str]:
    """Test-handler writes made outside their own attempt's lease (I2, I4)."""
    problems = []
    by_token = {(attempt.job_id, attempt.token): attempt for attempt in attempts}
    winner = {a.job_id: a.token for a in attempts if a.outcome == Outcome.SUCCEEDED}
    completions: Counter[int] = Counter()
    for job_id, token, label in rows("SELECT job_id, lease_token, label FROM testapp_effect"):
        if not kept(job_id):
            continue
        if (job_id, token) not in by_token:
            problems.append(f"job {job_id}: a {label!r} effect of lease {token}, which has no row")
        if label == "complete":
            completions[job_id] += 1
            if winner.get(job_id) != token:
                problems.append(f"job {job_id}: completion effect of lease {token}, which lost")
    problems += [
        f"job {job_id}: {n} completion effects" for job_id, n in completions.items() if n > 1
    ]
    for job_id, token, started, ended in rows(
        "SELECT job_id, lease_token, started_at, ended_at FROM testapp_span"
    ):
        if not kept(job_id):
            continue
        attempt = by_token.get((job_id, token))
        started, ended = _instant(started), _instant(ended)
        where = f"job {job_id}: span of lease {token} ({started} to {ended})"
        if attempt is None:
            problems.append(f"{where} has no lease row")
            continue
        released = attempt.released_at
        if started < attempt.acquired_at or (released is not None and started > released):
            problems.append(
                f"{where} started outside its lease ({attempt.acquired_at} to {released})"
            )
        if ended is not None and (winner.get(job_id) != token or (released and ended > released)):
            problems.append(f"{where} ended though its attempt did not complete the job then")
    return problems


def conflicting_spans(job_ids: Iterable[int]) -> list[str]:
    """Pairs of ``test.locked`` attempts that shared a resource and ran at once (I8).

    A span ends with its completion; a killed attempt's span never got an end, so it is
    bounded by its ``reclaimed`` event, written where its locks were released.
    """
    ids = list(job_ids)
    reclaimed = {
        (job_id, token): at
        for job_id, token, at in JobEvent.objects.filter(
            job_id__in=ids, event="reclaimed"
        ).values_list("job_id", "lease_token", "at")
    }
    problems = []
    spans = []
    for span in Span.objects.filter(job_id__in=ids).order_by("started_at"):
        end = span.ended_at or reclaimed.get((span.job_id, span.lease_token))
        if end is None:
            problems.append(f"job {span.job_id}: span of lease {span.lease_token} never ended")
        else:
            spans.append((span, end))
    for (a, a_end), (b, b_end) in combinations(spans, 2):
        shared = set(a.resources) & set(b.resources)
        if shared and a.started_at < b_end and b.started_at < a_end:
            problems.append(
                f"jobs {a.job_id} (lease {a.lease_token}, {a.started_at} to {a_end}) and "
                f"{b.job_id} (lease {b.lease_token}, {b.started_at} to {b_end}) both held "
                f"{sorted(shared)}"
            )
    return problems


def most_leases_at_once(job_ids: Iterable[int]) -> int:
    """The most attempts of these jobs that held a live lease at the same moment.

    A lease is live from its claim until it was settled or reclaimed (until then the job
    counts as running); one that ends at the instant another begins (a settle and the
    next claim in one statement) does not overlap it.
    """
    edges = []
    for acquired, released in Lease.objects.filter(job_id__in=list(job_ids)).values_list(
        "acquired_at", "released_at"
    ):
        edges.append((acquired, 1))
        if released is not None:
            edges.append((released, -1))
    live = most = 0
    for _, change in sorted(edges):  # at one instant, releases (-1) sort before claims
        live += change
        most = max(most, live)
    return most


def succeeded() -> int:
    return Job.objects.filter(state="succeeded").count()


def drained_uncharged(
    ids: list[int], procs: list[WorkerProc], describe: Callable[[], str], after: str
) -> None:
    """Wait for every job to succeed, then check what a deploy must not do: no worker
    exited or had a settle refused, every job ran on its one charged attempt, no attempt
    was recorded as failed, and each ``test.effect`` job's effect is there exactly once.
    Then the workers stop cleanly."""
    wait_until(
        lambda: succeeded() == len(ids),
        90,
        interval=0.1,
        message=lambda: f"queue not drained after {after}\n{describe()}",
    )
    assert all(proc.alive for proc in procs), describe()
    assert not any(proc.events("settlement_refused") for proc in procs), describe()
    charged = list(Job.objects.filter(pk__in=ids).exclude(attempts=1).values_list("pk", "attempts"))
    assert charged == [], describe()
    assert not Lease.objects.filter(job_id__in=ids, outcome="failed").exists(), describe()
    assert Lease.objects.filter(job_id__in=ids, outcome="succeeded").count() == len(ids)
    effects = Job.objects.filter(pk__in=ids, kind="test.effect").count()
    done = Effect.objects.filter(label="complete")
    assert done.count() == effects and done.values("job_id").distinct().count() == effects
    for proc in procs:
        proc.terminate()
    for proc in procs:
        assert proc.wait_exit(timeout=15) == 0, proc.describe()


def busy_fleet(
    workers: WorkerPool, total: int, name: str
) -> tuple[list[int], list[WorkerProc], Callable[[], str]]:
    """A deploy test's busy fleet: ``total`` short jobs (half ``test.sleep``, half
    ``test.effect``) and three workers running them. Returns the job ids, the workers and
    a description of both for failure messages, once the first jobs have succeeded."""
    sleeps = enqueueing.enqueue_many("test.sleep", [{"seconds": 0.05}] * (total // 2))
    effects = enqueueing.enqueue_many("test.effect", [{"sleep": 0.05}] * (total // 2))
    ids = [job.pk for job in [*sleeps, *effects]]
    procs = [workers.start(f"{name}-{n}") for n in range(3)]

    def describe() -> str:
        return f"{job_summary(ids)}\n{workers.describe()}"

    wait_until(lambda: succeeded() >= 10, 40, interval=0.05, message=describe)
    return ids, procs, describe
