"""Cooperative cancellation end to end: ``cancel_job`` on a job a real worker is running."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.enqueueing import enqueue
from jobs.models import Lease, Outcome, State
from tests.process.helpers import wait_for_job, wait_for_marker
from tests.support.workers import WorkerPool

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


def test_a_running_job_honours_a_cancel_request_within_seconds(
    workers: WorkerPool, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    job = enqueue("test.cancellable", {"seconds": 30, "marker": str(marker)})
    worker = workers.start("cancel-worker")
    wait_for_marker(marker, worker)
    result = workers.command("cancel_job", str(job.pk))
    assert result.returncode == 0, result.describe()
    assert "cancellation requested" in result.stdout
    # The worker renews its lease (and reads the request) at least every 5 s.
    wait_for_job(job.pk, State.CANCELLED, workers, timeout=10)
    job.refresh_from_db()
    assert job.progress is not None and job.progress["done"] >= 1  # progress stays
    assert Lease.objects.get(job_id=job.pk).outcome == Outcome.CANCELLED
    assert worker.alive  # and it carries on with other work
    assert workers.command("cancel_job", str(job.pk)).returncode == 1  # already finished
