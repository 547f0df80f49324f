"""Database-side helpers of the process tests: wait for job states, describe jobs in
failure messages, freeze a worker outside any transaction."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from itertools import pairwise
from pathlib import Path

from django.db import connection

from jobs.models import Job, Lease
from tests.support.workers import WorkerPool, WorkerProc, wait_until


def job_summary(job_ids: Iterable[int] | None = None) -> str:
    """The jobs (and their attempts), for assertion messages."""
    jobs = Job.objects.order_by("pk")
    if job_ids is not None:
        jobs = jobs.filter(pk__in=list(job_ids))
    lines = []
    for job in jobs[:50]:
        leases = ", ".join(
            f"{lease.lease_token}:{lease.worker_id}:{lease.outcome}"
            for lease in job.leases.order_by("lease_token")
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


def overlapping_leases(job_ids: Iterable[int]) -> list[str]:
    """Attempts of one job whose recorded lease windows overlap (I1: one live lease).

    Each claim's lease starts after the previous attempt's lease was released (settled,
    released or reclaimed), and only a job's last attempt may still be running.
    """
    problems = []
    by_job: dict[int, list[Lease]] = {}
    for lease in Lease.objects.filter(job_id__in=list(job_ids)).order_by("job_id", "lease_token"):
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
    leases = Lease.objects.filter(job_id__in=list(job_ids)).order_by("worker_id", "acquired_at")
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
