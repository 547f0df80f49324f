"""Handler code that breaks its contract must cost its own attempt, never the worker,
another job, or the database. Real worker processes, on both databases.

- LeaseLost while the attempt still holds its lease (a ``ctx.atomic(complete=True)``
  nested in another; raised by hand) fails the attempt at once, with its traceback:
  it used to leave the job ``running`` until its lease expired.
- A transaction left open (an atomic block never exited, autocommit off, a raw BEGIN)
  is rolled back, its writes gone, the attempt failed with ``TransactionLeftOpen``;
  the worker goes on serving jobs (on SQLite the open transaction held the only write
  lock, so every worker stalled).
- An error raised after the handler's ``ctx.atomic(complete=True)`` committed is logged
  (``handler_raised_after_complete``); the job stays succeeded.
- A handler that replaces the SIGTERM handler leaves the worker still stoppable.
- What a handler binds to the log context does not follow the worker into the next job.
- A forked child returning from the handler exits at once instead of working as a
  second copy of its parent (with its parent's connection).
"""

from __future__ import annotations

import pytest

from jobs import enqueueing
from jobs.models import Job, Lease, Outcome, State
from tests.process.helpers import assert_engine_invariants, wait_for_job
from tests.support.workers import WorkerPool, WorkerProc
from tests.testapp.models import Effect

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


def _misuse(workers: WorkerPool, how: str, state: str) -> tuple[WorkerProc, Job]:
    """Start worker ``w1``, run a ``test.misuse`` job doing ``how``; wait for ``state``."""
    worker = workers.start("w1")
    job = enqueueing.enqueue("test.misuse", {"how": how})
    return worker, wait_for_job(job.pk, state, workers)


def _failed_attempts(job: Job) -> list[Lease]:
    leases = list(job.leases.order_by("lease_token"))
    assert [lease.outcome for lease in leases] == [Outcome.FAILED] * len(leases)
    return leases


@pytest.mark.parametrize("how", ["nested_complete", "raise_lease_lost"])
def test_lease_lost_raised_while_the_lease_is_held_fails_the_attempt_at_once(
    workers: WorkerPool, how: str
) -> None:
    worker = workers.start("w1")
    job = enqueueing.enqueue("test.misuse", {"how": how}, lease_seconds=600)
    # With a ten-minute lease, only a settle of the worker's own ends it in time.
    dead = wait_for_job(job.pk, State.DEAD, workers, timeout=30)
    leases = _failed_attempts(dead)
    assert len(leases) == 2 and dead.attempts == 2
    for lease in leases:
        assert lease.error_class == "jobs.exceptions.LeaseLost"
        assert "still held its lease" in lease.error_message
        # The traceback points at the handler's own line that raised it.
        raised_at = {"nested_complete": 'result="outer"', "raise_lease_lost": "raise LeaseLost("}
        assert raised_at[how] in lease.traceback, lease.traceback
        assert "testapp/handlers.py" in lease.traceback
    assert not Effect.objects.filter(job_id=job.pk).exists()  # the blocks rolled back
    after = enqueueing.enqueue("test.echo", {"n": 1})
    wait_for_job(after.pk, State.SUCCEEDED, workers)
    assert worker.alive, worker.describe()
    assert_engine_invariants(context=workers.describe())


@pytest.mark.parametrize("how", ["open_atomic", "autocommit_off", "raw_begin"])
def test_a_transaction_left_open_is_rolled_back_and_fails_the_attempt(
    workers: WorkerPool, how: str
) -> None:
    first = workers.start("w1")
    second = workers.start("w2")
    job = enqueueing.enqueue("test.misuse", {"how": how})
    dead = wait_for_job(job.pk, State.DEAD, workers, timeout=30)
    for lease in _failed_attempts(dead):
        assert lease.error_class == "jobs.exceptions.TransactionLeftOpen"
        assert "transaction still open" in lease.error_message
    assert not Effect.objects.filter(job_id=job.pk).exists()  # rolled back, not committed
    # Both workers go on: nothing holds a lock (on SQLite: the write lock) any more.
    followers = [enqueueing.enqueue("test.echo", {"n": n}) for n in range(6)]
    for follower in followers:
        wait_for_job(follower.pk, State.SUCCEEDED, workers)
    opened = first.events("handler_left_transaction_open") + second.events(
        "handler_left_transaction_open"
    )
    assert len(opened) == 2 and {e["job_id"] for e in opened} == {job.pk}
    assert first.alive and second.alive, workers.describe()
    assert_engine_invariants(context=workers.describe())


def test_an_error_after_the_job_completed_is_logged_and_the_job_stays_succeeded(
    workers: WorkerPool,
) -> None:
    worker, job = _misuse(workers, "raise_after_complete", State.SUCCEEDED)
    assert job.result == "done" and job.attempts == 1
    event = worker.wait_for_event("handler_raised_after_complete", job_id=job.pk)
    assert event["error"] == "RuntimeError: cleanup failed after the job completed"
    assert not worker.events("lease_lost", job_id=job.pk), worker.describe()
    assert Effect.objects.filter(job_id=job.pk).count() == 1


def test_a_handler_replacing_sigterms_handler_leaves_the_worker_stoppable(
    workers: WorkerPool,
) -> None:
    worker, job = _misuse(workers, "replace_sigterm", State.SUCCEEDED)
    worker.wait_for_event("signal_handler_replaced", signal="SIGTERM", job_id=job.pk)
    worker.terminate()
    assert worker.wait_exit(20) == 0, worker.describe()
    worker.wait_for_event("worker_stopping", signal="SIGTERM")


def test_a_thread_a_handler_left_running_does_not_keep_a_stopped_worker_alive(
    workers: WorkerPool,
) -> None:
    """The interpreter waited for the thread at exit: the worker logged its stop and never
    ended, and ``--burst`` never returned (helper-29 #7)."""
    worker, job = _misuse(workers, "thread", State.SUCCEEDED)
    worker.terminate()
    assert worker.wait_exit(20) == 0, worker.describe()
    [left] = worker.events("handler_threads_left")
    assert left["threads"] == ["lingering"] and left["level"] == "warning"
    assert job.attempts == 1


def test_a_stopped_worker_whose_handlers_left_no_thread_says_nothing_of_threads(
    workers: WorkerPool,
) -> None:
    worker, _ = _misuse(workers, "bind_context", State.SUCCEEDED)
    worker.terminate()
    assert worker.wait_exit(20) == 0, worker.describe()
    assert not worker.events("handler_threads_left"), worker.describe()


def test_what_a_handler_binds_to_the_log_context_ends_with_its_job(
    workers: WorkerPool,
) -> None:
    worker, _ = _misuse(workers, "bind_context", State.SUCCEEDED)
    after = enqueueing.enqueue("test.echo", {"n": 1})
    wait_for_job(after.pk, State.SUCCEEDED, workers)
    [claimed] = worker.events("job_claimed", job_id=after.pk)
    [succeeded] = worker.events("job_succeeded", job_id=after.pk)
    assert "leaked" not in claimed and "leaked" not in succeeded, worker.describe()


def test_a_forked_child_returning_from_the_handler_exits_at_once(workers: WorkerPool) -> None:
    worker, done = _misuse(workers, "fork", State.SUCCEEDED)
    assert done.result == {"child_exit": 0}
    assert done.attempts == 1
    after = [enqueueing.enqueue("test.echo", {"n": n}) for n in range(5)]
    for follower in after:
        finished = wait_for_job(follower.pk, State.SUCCEEDED, workers)
        assert finished.leases.get().worker_id == "w1"
    assert worker.alive and len(worker.events("job_claimed", job_id=done.pk)) == 1
    assert_engine_invariants(context=workers.describe())
