"""A job's event log, read as one sequence from the rows that record it.

Every attempt has its lease row (``jobs.attempts``: written by the statement that ends the
attempt, in the same statement or transaction as the job row's change; while it runs,
read from the job row, which the claim wrote). That row *is* the attempt's ``claimed``
event (``acquired_at``, worker, token, attempt) and, once ``settled_state`` is set, its
``settled`` event (``released_at``, the job's next state, the outcome, whether a cancel had
been requested). So those two events are not inserted again as ``jobs_jobevent`` rows:
two row writes fewer per job, and the log is still complete, since a lease row and the
change it records commit together or not at all.

Everything else (progress, cancel requests, reclaims, requeues, cancels) is a
``jobs_jobevent`` row. Rows of ``claimed`` or ``settled`` written by workers of 0.1 are
kept and shown as they are, never twice.

Order: attempt by attempt (lease token), each as claimed, the events its token names (in
insertion order), settled; an event of no attempt (a requeue, the cancel of a queued job)
before the first attempt claimed at or after its time.
"""

from __future__ import annotations

import bisect
from datetime import timedelta

from . import attempts
from .models import Job, JobEvent, Lease

STORED_IN_LEASE = ("claimed", "settled")


def events(job_id: int) -> list[JobEvent]:
    """The job's event log, oldest first (unsaved JobEvent instances for the two events a
    lease row holds); empty for a job that does not exist."""
    job = Job.objects.filter(pk=job_id).first()
    return [] if job is None else job_events(job, attempts.leases(job))


def job_events(job: Job, leases: list[Lease]) -> list[JobEvent]:
    """``events`` of a job already read, with its attempts (``attempts.leases(job)``)."""
    rows = list(JobEvent.objects.filter(job_id=job.pk).order_by("pk"))
    stored = {(row.event, row.lease_token) for row in rows if row.event in STORED_IN_LEASE}
    lease_seconds = float(job.lease_seconds)
    by_attempt: list[list[JobEvent]] = []
    for lease in leases:
        by_token = [row for row in rows if row.lease_token == lease.lease_token]
        claimed = (
            [] if ("claimed", lease.lease_token) in stored else [_claimed(lease, lease_seconds)]
        )
        settled = [_settled(lease)] if _settles(lease, stored) else []
        by_attempt.append([*claimed, *sorted(by_token, key=_attempt_order), *settled])
    tokens = {lease.lease_token for lease in leases}
    between = [row for row in rows if row.lease_token not in tokens]
    return _interleave(by_attempt, leases, between)


def _settles(lease: Lease, stored: set[tuple[str, int | None]]) -> bool:
    return lease.settled_state is not None and ("settled", lease.lease_token) not in stored


def _attempt_order(row: JobEvent) -> int:
    """Within an attempt: an old worker's stored ``claimed`` row first, its ``settled``
    row last, the others in between (the sort is stable: insertion order)."""
    return {"claimed": 0, "settled": 2}.get(row.event, 1)


def _claimed(lease: Lease, lease_seconds: float) -> JobEvent:
    expires_at = lease.acquired_at + timedelta(seconds=lease_seconds)
    return JobEvent(
        job_id=lease.job_id,
        at=lease.acquired_at,
        event="claimed",
        lease_token=lease.lease_token,
        worker_id=lease.worker_id,
        data={"attempt": lease.attempt, "expires_at": expires_at.isoformat()},
    )


def _settled(lease: Lease) -> JobEvent:
    return JobEvent(
        job_id=lease.job_id,
        at=lease.released_at or lease.acquired_at,  # set by the settle that set the state
        event="settled",
        lease_token=lease.lease_token,
        worker_id=lease.worker_id,
        data={
            "state": lease.settled_state,
            "outcome": lease.outcome,
            "cancel_requested": bool(lease.cancel_requested),
        },
    )


def _interleave(
    attempts: list[list[JobEvent]], leases: list[Lease], between: list[JobEvent]
) -> list[JobEvent]:
    """Each event of no attempt goes before the first attempt claimed at or after its time.

    Such an event (a requeue, the cancel of a queued job) happens while no attempt runs,
    so it precedes the next claim even when both fall in the same clock tick (SQLite's
    clock has milliseconds).
    """
    starts = [lease.acquired_at for lease in leases]
    slots: list[list[JobEvent]] = [[] for _ in range(len(attempts) + 1)]
    for row in between:
        slots[bisect.bisect_left(starts, row.at)].append(row)
    ordered = list(slots[0])
    for attempt, after in zip(attempts, slots[1:], strict=True):
        ordered += attempt + after
    return ordered


def one_event(job_id: int, event: str) -> JobEvent:
    """The job's only event named ``event``; raises ValueError if there is not exactly one."""
    found = [each for each in events(job_id) if each.event == event]
    if len(found) != 1:
        raise ValueError(f"job {job_id} has {len(found)} {event!r} events, not one")
    return found[0]
