"""A job's attempts: the lease rows of those that ended, and the one running now.

An attempt's lease row is written once, complete, by the statement that ends the attempt
(a settle, a release, a reclaim: ``jobs.sql``). While the attempt runs, the job row alone
records it: ``state`` running, its ``lease_token``, ``attempts``, ``leased_by``,
``started_at`` and ``lease_expires_at``, all written by the claim. So a claim and each
heartbeat write the job row only, and a job that succeeds costs one lease row write, not
an insert at claim and an update at settle.

Whoever shows a job's attempts reads them here: the stored rows, oldest first, and the
running attempt as an unsaved ``Lease`` built from the job row (unless a worker of an
earlier release, which inserted the row at claim, already stored it).
"""

from __future__ import annotations

from django.utils import timezone

from .models import Job, Lease, Outcome, State


def leases(job: Job) -> list[Lease]:
    """Every attempt of ``job``, by lease token: those that ended, then the running one."""
    rows = list(Lease.objects.filter(job_id=job.pk).order_by("lease_token"))
    running = running_lease(job)
    if running is not None and all(row.lease_token != running.lease_token for row in rows):
        rows.append(running)
    return rows


def running_lease(job: Job) -> Lease | None:
    """The attempt ``job`` runs now, read from the job row (None unless it is running)."""
    if job.state != State.RUNNING:
        return None
    started = job.started_at or timezone.now()
    return Lease(
        job=job,
        attempt=job.attempts,
        lease_token=job.lease_token,
        worker_id=job.leased_by or "",
        acquired_at=started,
        expires_at=job.lease_expires_at or started,
        outcome=Outcome.RUNNING,
        context={},
    )
