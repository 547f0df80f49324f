"""A notification sent before a LISTEN took effect is never delivered: the lease keeper
catches up each time its listener (re)subscribes (jobs/worker.py, ``_catch_up``). A
worker's first LISTEN may come just after its first claim, and a reconnect leaves a gap:
a cancel request sent in either is read by a renewal at once, and an idle worker looks
for work once more (a wake-up sent in the gap is lost too)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection
from structlog.testing import capture_logs

from jobs import engine, notify, operations
from jobs.context import JobContext
from jobs.enqueueing import enqueue
from jobs.models import Job
from jobs.notify import PollWaker, SideListener
from jobs.worker import WorkerProcess, _KeeperState

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def worker() -> Iterator[WorkerProcess]:
    if connection.vendor != "postgresql":
        pytest.skip("LISTEN/NOTIFY: PostgreSQL")
    process = WorkerProcess(worker_id="w1")
    process._waker = PollWaker()
    yield process
    process._waker.close()
    connection.close()  # the LISTEN session


def _running(worker: WorkerProcess) -> JobContext:
    enqueue("test.noop", lease_seconds=0.3)  # the keeper's _listen waits a beat: 0.1 s
    claimed = engine.claim("w1")
    assert claimed is not None
    ctx = JobContext(claimed, "w1", own_connection=True)
    worker.current = (claimed, ctx)
    return ctx


def test_a_cancel_sent_before_the_first_listen_is_heard_when_it_subscribes(
    worker: WorkerProcess,
) -> None:
    ctx = _running(worker)
    operations.cancel(ctx.job_id, actor="tester")  # its NOTIFY reaches no one
    listener = SideListener(notify.worker_channels(None))
    with capture_logs() as logs:
        worker._listen(listener, _KeeperState())  # subscribes, catches up, reads
    assert ctx.cancel_requested
    heard = [entry for entry in logs if entry["event"] == "cancel_request_heard"]
    assert heard == [
        {
            "event": "cancel_request_heard",
            "job_id": ctx.job_id,
            "via": "renewal",
            "log_level": "info",
        }
    ]


def test_a_cancel_sent_while_the_listener_reconnects_is_heard_after_it(
    worker: WorkerProcess,
) -> None:
    ctx = _running(worker)
    listener, state = SideListener(notify.worker_channels(None)), _KeeperState()
    worker._listen(listener, state)
    assert not ctx.cancel_requested
    beat = Job.objects.get(pk=ctx.job_id).heartbeat_at
    worker._listen(listener, state)  # no new LISTEN: nothing to catch up on, no renewal
    assert Job.objects.get(pk=ctx.job_id).heartbeat_at == beat

    connection.close()  # the side connection dropped ...
    operations.cancel(ctx.job_id, actor="tester")  # ... and the request came meanwhile
    worker._listen(listener, state)
    assert listener.subscriptions == 2
    assert ctx.cancel_requested


def test_an_idle_worker_looks_for_work_once_more_after_each_listen(
    worker: WorkerProcess,
) -> None:
    listener, state = SideListener(notify.worker_channels(None)), _KeeperState()
    worker._listen(listener, state)
    assert worker._waker.wait(0)
    worker._listen(listener, state)  # no new LISTEN, nothing notified: no wake-up
    assert not worker._waker.wait(0)
    connection.close()
    worker._listen(listener, state)
    assert worker._waker.wait(0)
