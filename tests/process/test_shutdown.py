"""Graceful shutdown of a real worker process: SIGTERM finishes or releases the current
job (a released claim is not charged), a second SIGTERM exits at once."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from jobs.enqueueing import enqueue
from jobs.models import Job, Lease, Outcome, State
from tests.process.helpers import job_summary, wait_for_job, wait_for_marker
from tests.support.workers import WorkerPool
from tests.testapp.models import Effect

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_lets_a_job_shorter_than_the_grace_period_finish(
    workers: WorkerPool, tmp_path: Path, signum: signal.Signals
) -> None:
    marker = tmp_path / "started"
    job = enqueue("test.sleep", {"seconds": 1.5, "marker": str(marker)}, priority=10)
    later = enqueue("test.echo", {"never": "claimed"})  # lower priority: waits behind it
    worker = workers.start("w1", env={"HOLDFAST_SHUTDOWN_GRACE_SECONDS": "20"})
    wait_for_marker(marker, worker)
    assert Job.objects.get(pk=job.pk).state == State.RUNNING

    worker.send(signum)
    worker.wait_for_event("worker_stopping", signal=signum.name)
    assert worker.wait_exit(timeout=15) == 0, worker.describe()

    job.refresh_from_db()
    assert job.state == State.SUCCEEDED, job_summary([job.pk])
    assert job.result == 1.5
    assert job.attempts == 1
    assert list(Lease.objects.filter(job_id=job.pk).values_list("outcome", flat=True)) == [
        Outcome.SUCCEEDED
    ]
    # A stopping worker finishes its job and claims nothing more.
    later.refresh_from_db()
    assert later.state == State.QUEUED
    assert later.attempts == 0
    assert worker.events("worker_exiting", processed=1)


def test_sigterm_releases_a_job_longer_than_the_grace_period_uncharged(
    workers: WorkerPool, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    job = enqueue("test.sleep", {"seconds": 30, "marker": str(marker)}, max_attempts=1)
    worker = workers.start("w1", env={"HOLDFAST_SHUTDOWN_GRACE_SECONDS": "1"})
    wait_for_marker(marker, worker)
    running = Job.objects.get(pk=job.pk)
    assert (running.state, running.attempts, running.lease_token) == (State.RUNNING, 1, 1)

    sent = time.monotonic()
    worker.terminate()
    assert worker.wait_exit(timeout=10) == 0, worker.describe()
    assert time.monotonic() - sent < 6, "the worker did not release the job after its grace"
    # Written by the lease keeper's thread, with the whole identity of the attempt.
    worker.wait_for_event(
        "shutdown_grace_expired",
        job_id=job.pk,
        kind="test.sleep",
        lane="default",
        attempt=1,
        lease_token=1,
        worker_id="w1",
    )
    worker.wait_for_event("job_released", job_id=job.pk, lease_token=1)

    job.refresh_from_db()
    assert job.state == State.QUEUED, job_summary([job.pk])
    assert job.attempts == 0  # not charged: with max_attempts=1 it can still run
    assert job.max_attempts == 1
    assert job.leased_by is None
    assert job.lease_expires_at is None
    assert job.finished_at is None
    (lease,) = Lease.objects.filter(job_id=job.pk)
    assert lease.lease_token == 1
    assert lease.outcome == Outcome.RELEASED
    assert lease.released_at is not None
    assert lease.error_class == ""


def test_a_second_sigterm_exits_at_once_and_the_job_is_reclaimed_later(
    workers: WorkerPool, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    job = enqueue("test.progress_then_sleep", {"sleep": 3, "marker": str(marker)})
    worker = workers.start("w1", env={"HOLDFAST_SHUTDOWN_GRACE_SECONDS": "20"})
    wait_for_marker(marker, worker)

    worker.terminate()
    worker.wait_for_event("worker_stopping", signal="SIGTERM")
    sent = time.monotonic()
    worker.terminate()
    code = worker.wait_exit(timeout=5)
    assert code == 128 + signal.SIGTERM, worker.describe()
    assert time.monotonic() - sent < 2
    assert worker.events("worker_killed", signal="SIGTERM")
    # Abandoned mid-job: still running under a lease nobody renews.
    abandoned = Job.objects.get(pk=job.pk)
    assert (abandoned.state, abandoned.leased_by) == (State.RUNNING, "w1")
    assert not Effect.objects.filter(job_id=job.pk).exists()

    rescuer = workers.start("rescuer")
    job = wait_for_job(job.pk, State.SUCCEEDED, workers, timeout=20)
    assert job.attempts == 2
    leases = dict(Lease.objects.filter(job_id=job.pk).values_list("lease_token", "outcome"))
    assert leases == {1: Outcome.LEASE_EXPIRED, 2: Outcome.SUCCEEDED}
    assert rescuer.events("lease_reclaimed", job_id=job.pk, lease_token=1)
    assert list(
        Effect.objects.filter(job_id=job.pk).values_list("label", "lease_token").order_by("pk")
    ) == [("progress", 2), ("complete", 2)]


def test_sigterm_stops_an_idle_worker_promptly(workers: WorkerPool) -> None:
    worker = workers.start("idle", env={"HOLDFAST_POLL_SECONDS": "1"})
    time.sleep(0.3)  # let it settle into its idle wait (LISTEN on PostgreSQL)
    sent = time.monotonic()
    worker.terminate()
    assert worker.wait_exit(timeout=10) == 0, worker.describe()
    assert time.monotonic() - sent < 3, worker.describe()
    assert worker.events("worker_exiting", processed=0)


def test_sigterm_releases_uncharged_a_job_whose_grace_ends_inside_ctx_atomic(
    workers: WorkerPool, tmp_path: Path
) -> None:
    """SQLite: the handler's open block holds the database's write lock, so the release
    could not be written; the worker exited anyway, the lease expired and the attempt was
    charged: with one attempt allowed the job went dead on a routine restart (helper-27
    #4). The release is handed to a process that writes it once the exit frees the lock.
    PostgreSQL writes it at once (the release waits for the job row only)."""
    from django.utils import timezone

    from tests.testapp.models import Document

    document = Document.objects.create(url="https://example.test/g", refresh_after=timezone.now())
    marker = tmp_path / "attempt"
    args = {"document_id": document.pk, "resources": ["grace:1"], "marker": str(marker)}
    job = enqueue("test.freezable", {**args, "pause_in_block": 20}, max_attempts=1)
    worker = workers.start("w1", env={"HOLDFAST_SHUTDOWN_GRACE_SECONDS": "1"})
    wait_for_marker(Path(f"{marker}.in-block"), worker)
    worker.terminate()
    assert worker.wait_exit(timeout=15) == 0, worker.describe()
    worker.wait_for_event("shutdown_grace_expired", job_id=job.pk)
    wait_for_job(job.pk, State.QUEUED, workers, timeout=15)
    job.refresh_from_db()
    assert (job.attempts, job.max_attempts, job.leased_by) == (0, 1, None), job_summary([job.pk])
    (lease,) = Lease.objects.filter(job_id=job.pk)
    assert (lease.lease_token, lease.outcome) == (1, Outcome.RELEASED)
    assert not Effect.objects.filter(job_id=job.pk).exists()  # the block never committed
    # On SQLite the hand-over process logs the release as the engine does, under the
    # worker's id (its stderr is the worker's); PostgreSQL's worker writes it itself.
    from django.db import connection

    if connection.vendor == "sqlite":
        worker.wait_for_event("release_handed_over", job_id=job.pk)
    worker.wait_for_event("job_released", job_id=job.pk, worker_id="w1")


@pytest.mark.django_db(transaction=True)
def test_a_handed_over_release_that_comes_too_late_writes_nothing() -> None:
    """The hand-over process finds the job no longer under the lease it was to release
    (reclaimed, or settled meanwhile): the fenced release matches nothing, and the engine
    says so."""
    import dataclasses
    import json

    from structlog.testing import capture_logs

    from jobs import engine, handover
    from tests.integration.helpers import claim_one

    job = enqueue("test.echo")
    claimed = claim_one()
    engine.complete(claimed, "done")
    fields = dataclasses.asdict(claimed)
    fields["lease_expires_at"] = claimed.lease_expires_at.isoformat()
    with capture_logs() as logs:
        handover.release_handed_over(json.dumps(fields), "w-gone")
    [lost] = logs
    assert (lost["event"], lost["during"]) == ("lease_lost", "job_released")
    job.refresh_from_db()
    assert (job.state, job.attempts) == (State.SUCCEEDED, 1)
