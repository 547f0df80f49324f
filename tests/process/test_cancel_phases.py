"""Cancellation at every phase of a job, with a real ``runworker`` process (issue #6).

A job cancelled while queued never runs. A running job (``test.cancel_point``) waits at a
gate while the test cancels it; once its worker has heard the request, the gate opens
and the handler reaches its first safe point: just after the claim, after a committed
progress report, or never (it ignores the request and completes). On PostgreSQL the
worker hears the request through NOTIFY well within a second; elsewhere at its next
lease renewal. The engine-level versions are in ``tests/integration/test_cancel_phases.py``.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from jobs import engine, operations
from jobs.enqueueing import enqueue
from jobs.events import events, one_event
from jobs.models import Lease, Outcome, State
from tests.conftest import on_postgres
from tests.process.helpers import (
    assert_engine_invariants,
    job_summary,
    wait_for_job,
    wait_for_marker,
)
from tests.support.workers import WorkerPool, WorkerProc
from tests.testapp.models import Effect

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]

#: How soon a worker busy with a job must hear a cancel request through NOTIFY.
NOTIFY_LATENCY = 0.75

PHASES: dict[str, dict[str, Any]] = {
    "just_claimed": {"progress": False, "honour": True},
    "mid_progress": {"progress": True, "honour": True},
    "never_honoured": {"progress": False, "honour": False},
}


def test_a_job_cancelled_while_queued_is_never_claimed(workers: WorkerPool) -> None:
    doomed = enqueue("test.effect")
    operations.cancel(doomed.pk, actor="tester")
    follower = enqueue("test.effect")
    worker = workers.start("w1")
    wait_for_job(follower.pk, State.SUCCEEDED, workers)

    doomed.refresh_from_db()
    assert doomed.state == State.CANCELLED
    assert not worker.events("job_claimed", job_id=doomed.pk)
    assert not Lease.objects.filter(job_id=doomed.pk).exists()
    assert [event.event for event in events(doomed.pk)] == ["cancelled"]
    assert not Effect.objects.filter(job_id=doomed.pk).exists()
    assert_engine_invariants(context=workers.describe())


@pytest.mark.parametrize("phase", PHASES)
def test_a_running_job_cancelled_at_each_phase(
    workers: WorkerPool, tmp_path: Path, phase: str
) -> None:
    gate, marker = tmp_path / "gate", tmp_path / "started"
    args = {"gate": str(gate), "marker": str(marker), "resources": ["r1"], **PHASES[phase]}
    # PostgreSQL: renewals 5 s apart (not the handler's 1.5 s lease), so the request is
    # heard through NOTIFY, not read by a renewal that happened to run at that moment.
    job = enqueue("test.cancel_point", args, lease_seconds=15 if on_postgres() else None)
    worker = workers.start("w1")
    wait_for_marker(marker, worker)
    if on_postgres():
        worker.wait_for_event("listening")  # before it, only a renewal could hear it

    asked_at = time.time()
    operations.cancel(job.pk, actor="tester")
    wait_until_heard(job.pk, worker, asked_at)
    gate.touch()

    honoured = PHASES[phase]["honour"]
    wait_for_job(job.pk, State.CANCELLED if honoured else State.SUCCEEDED, workers)
    job.refresh_from_db()
    lease = Lease.objects.get(job_id=job.pk)
    settled = one_event(job.pk, "settled")
    assert settled.data["cancel_requested"] is True, job_summary([job.pk])
    effects = list(Effect.objects.filter(job_id=job.pk).values_list("label", flat=True))
    if honoured:
        assert lease.outcome == Outcome.CANCELLED
        assert effects == []  # the block open at the safe point rolled back
        done = 1 if PHASES[phase]["progress"] else None
        assert (job.progress or {}).get("done") == done  # committed progress stays
        assert not worker.events("cancel_not_honoured")
    else:
        assert (lease.outcome, job.result) == (Outcome.SUCCEEDED, "finished")
        assert effects == ["after the gate"]
        worker.wait_for_event("cancel_not_honoured", job_id=job.pk)
    assert [event.event for event in events(job.pk)][-2:] == [
        "cancel_requested",
        "settled",
    ]
    assert not engine.held_locks().exists()
    assert worker.alive
    assert_engine_invariants(context=workers.describe())


def wait_until_heard(job_id: int, worker: WorkerProc, asked_at: float) -> None:
    """Wait until ``worker`` knows of the cancel request for ``job_id``: it logs
    ``cancel_request_heard`` once, when it flags ``ctx.cancel_requested``.

    PostgreSQL: through NOTIFY (``via=notify``), within ``NOTIFY_LATENCY`` of the
    request. Otherwise: a lease renewal read it (``via=renewal``).
    """
    heard = worker.wait_for_event("cancel_request_heard", timeout=5, job_id=job_id)
    if on_postgres():
        assert heard["via"] == "notify", heard
        latency = datetime.fromisoformat(heard["timestamp"]).timestamp() - asked_at
        assert latency < NOTIFY_LATENCY, f"heard {latency:.3f} s after the request"
    else:
        assert heard["via"] == "renewal", heard
