"""Wake-ups of idle workers (jobs/notify.py), with real worker processes.

- A delayed job runs when due with an idle worker whose poll interval is far longer: the
  worker sleeps until the next due job of its lanes, not a poll interval.
- A job blocked on a resource lock is claimed promptly when the lock frees, by an idle
  worker of another lane (no lost wake-up): NOTIFY on PostgreSQL; on SQLite, another
  process's worker finds it within its poll interval (the documented bound).
- PostgreSQL: a busy worker keeps reading its LISTEN connection, so the server's
  notification queue does not grow behind it.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from jobs import enqueueing
from jobs.models import Job, Lease, State
from tests.conftest import database_url
from tests.process.helpers import wait_for_job, wait_for_marker
from tests.support.workers import WorkerPool, wait_until

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

LANES = {"default": {}, "other": {}}


def _is_pg() -> bool:
    return connection.vendor == "postgresql"


def test_a_delayed_job_runs_when_due_with_an_idle_worker(workers: WorkerPool) -> None:
    job = enqueueing.enqueue("test.noop", {}, delay=2.0)
    # Polls every 30 s: only the next-due look-up can run the job on time.
    worker = workers.start("idle", env={"HOLDFAST_POLL_SECONDS": "30"})
    done = wait_for_job(job.pk, State.SUCCEEDED, workers, timeout=15)
    lease = Lease.objects.get(job_id=job.pk)
    late = (lease.acquired_at - done.run_at).total_seconds()
    assert 0 <= late < 1.0, (late, worker.describe())


def test_a_blocked_job_is_claimed_promptly_when_its_lock_frees(
    workers: WorkerPool, tmp_path: Path, settings: object
) -> None:
    settings.HOLDFAST_LANES = LANES  # type: ignore[attr-defined]
    # PostgreSQL: only the freed-lock NOTIFY can wake the idle worker in time. SQLite:
    # another process's worker polls; its bound is the poll interval.
    poll = "30" if _is_pg() else "0.5"
    env = {"HOLDFAST_TEST_LANES": json.dumps(LANES), "HOLDFAST_POLL_SECONDS": poll}
    holder_job = enqueueing.enqueue("test.locked", {"resources": ["r"], "seconds": 2.0})
    holder = workers.start("holder", "--lanes", "default", env=env)
    wait_until(lambda: Job.objects.get(pk=holder_job.pk).state == State.RUNNING, 15)
    blocked = enqueueing.enqueue("test.locked", {"resources": ["r"]}, lane="other")
    waiter = workers.start("waiter", "--lanes", "other", env=env)
    done = wait_for_job(blocked.pk, State.SUCCEEDED, workers, timeout=40)
    first = Job.objects.get(pk=holder_job.pk)
    assert first.state == State.SUCCEEDED
    lease = Lease.objects.get(job_id=done.pk)
    assert lease.worker_id == "waiter"
    late = (lease.acquired_at - first.finished_at).total_seconds()
    bound = 1.0 if _is_pg() else 0.5 + 1.0
    assert 0 <= late < bound, (late, holder.describe(), waiter.describe())


@pytest.mark.postgres
def test_the_notification_queue_does_not_grow_behind_a_busy_worker(
    workers: WorkerPool, tmp_path: Path
) -> None:
    marker = tmp_path / "running"
    long = enqueueing.enqueue("test.sleep", {"seconds": 60, "marker": str(marker)})
    worker = workers.start("busy", env={"HOLDFAST_POLL_SECONDS": "30"})
    wait_for_marker(marker, worker)
    for n in range(200):  # enqueues, one transaction each: each notifies the idle workers
        enqueueing.enqueue("test.noop", {"n": n})

    def usage() -> float:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notification_queue_usage()")
            return float(cursor.fetchone()[0])

    def flood(channel: str, count: int) -> None:
        with connection.cursor() as cursor:  # autocommit: one transaction
            cursor.execute(
                "SELECT pg_notify(%s, g::text || repeat('x', 4000)) FROM generate_series(1, %s) g",
                [channel, count],
            )

    # Megabytes of notifications on a channel the worker LISTENs on: far more than socket
    # buffers hold, so a LISTEN connection nobody reads would pin the queue. A control
    # listener that never reads pins it for the measurement (without it a fast worker may
    # drain the queue before the peak is read, and the peak says nothing); once the control
    # leaves, only the worker's own reading can let the queue's tail move on.
    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as control:
        control.execute("LISTEN holdfast_jobs")
        flood("holdfast_jobs", 2000)
        peak = usage()
    assert peak > 0

    def drained() -> bool:
        flood("hf_probe", 10)  # new pages let the server move the queue's tail on
        return usage() <= peak / 10

    wait_until(drained, 20, interval=0.2, message=lambda: f"{usage()} {worker.describe()}")
    assert Job.objects.get(pk=long.pk).state == State.RUNNING  # still busy all along
    assert worker.alive, worker.describe()
