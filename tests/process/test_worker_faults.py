"""Faults a worker must survive, or die of cleanly (I3). Real worker processes.

- A handler raising ``SystemExit``, ``KeyboardInterrupt`` or ``GeneratorExit`` fails its
  attempt with that class; the worker goes on.
- A handler that kills its worker process (a segfault, a SIGKILL as from the OOM killer,
  ``os._exit``) still ends ``dead`` after ``max_attempts``, its attempts saying the worker died.
- A job of a kind no running worker knows waits, uncharged, and is named by
  ``queue_status``; a worker that knows the kind runs it.
- If the lease keeper thread dies, the worker gives its job back uncharged and exits
  non-zero for its supervisor to restart it.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from django.db.models.functions import Now

from jobs import enqueueing
from jobs.models import Job, Lease, Outcome, State
from jobs.worker import EXIT_KEEPER_DIED
from tests.process.helpers import (
    assert_engine_invariants,
    job_summary,
    wait_for_job,
    wait_for_marker,
)
from tests.support.workers import WorkerPool, wait_until

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


def test_handlers_raising_base_exceptions_fail_their_attempts_not_the_worker(
    workers: WorkerPool,
) -> None:
    worker = workers.start("w1")
    jobs = {
        which: enqueueing.enqueue("test.raise_base", {"which": which})
        for which in ("SystemExit", "KeyboardInterrupt", "GeneratorExit")
    }
    for which, job in jobs.items():
        dead = wait_for_job(job.pk, State.DEAD, workers)
        assert dead.attempts == 2  # retried by the policy, then spent
        leases = list(dead.leases.order_by("lease_token"))
        assert [lease.outcome for lease in leases] == [Outcome.FAILED] * 2
        assert [lease.error_class for lease in leases] == [which] * 2
        assert leases[0].error_message.endswith("in attempt 1")
        assert f"raise {which}(" in leases[0].traceback
        assert dead.last_error.startswith(f"{which}: ")
    after = enqueueing.enqueue("test.echo", {"n": 1})
    assert wait_for_job(after.pk, State.SUCCEEDED, workers).result["args"] == {"n": 1}
    assert worker.alive and len(worker.events("worker_started")) == 1, worker.describe()
    worker.terminate()
    assert worker.wait_exit(20) == 0, worker.describe()
    assert_engine_invariants(context=workers.describe())


def test_a_job_that_kills_its_worker_goes_dead_after_max_attempts(workers: WorkerPool) -> None:
    """Each attempt kills the process running it (a real segfault, a SIGKILL as the OOM
    killer sends, ``os._exit``); each is reclaimed as "the worker died" (by the next
    worker, then by a scheduler pass), and the third makes it dead."""
    ways = ("segfault", "sigkill", "exit")
    job = enqueueing.enqueue("test.hard_exit", {"ways": ways})  # max_attempts=3, lease 1 s
    for n, status in ((1, -signal.SIGSEGV), (2, -signal.SIGKILL), (3, 1)):
        victim = workers.start(f"victim-{n}", wait_started=False)
        assert victim.wait_exit(30) == status, victim.describe()
    wait_until(
        lambda: Job.objects.filter(pk=job.pk, lease_expires_at__lt=Now()).exists(),
        10,
        message=lambda: job_summary([job.pk]),
    )
    reclaim = workers.command("runscheduler", "--once")
    assert reclaim.returncode == 0, reclaim.describe()
    dead = wait_for_job(job.pk, State.DEAD, workers)
    assert dead.attempts == 3
    leases = list(dead.leases.order_by("lease_token"))
    assert [(lease.worker_id, lease.outcome) for lease in leases] == [
        (f"victim-{n}", Outcome.LEASE_EXPIRED) for n in (1, 2, 3)
    ]
    for n, lease in enumerate(leases, start=1):
        assert lease.error_class == "LeaseExpired"
        assert f"worker victim-{n} stopped renewing lease {n}" in lease.error_message
        reason = f"died, stopped responding or lost the database during attempt {n}"
        assert reason in lease.error_message
    assert "died, stopped responding or lost the database during attempt 3" in dead.last_error
    assert_engine_invariants(job_ids=[job.pk], context=workers.describe())


def test_a_kind_no_running_worker_knows_waits_uncharged_until_one_does(
    workers: WorkerPool,
) -> None:
    """New code enqueued a kind before the workers that know it are deployed."""
    old = workers.start("old-code")
    # Enqueued by the new code (the test process does not know the kind either).
    job = Job.objects.create(kind="test.late_kind", args={})
    known = enqueueing.enqueue("test.echo")
    wait_for_job(known.pk, State.SUCCEEDED, workers)
    wait_until(lambda: old.events("job_claimed", job_id=known.pk), 10, message=old.describe)
    status = workers.command("queue_status", "--json")
    assert status.returncode == 0, status.describe()
    unserved = status.json()["unserved_kinds"]
    assert [(u["kind"], u["lane"], u["queued"]) for u in unserved] == [
        ("test.late_kind", "default", 1)
    ]
    worker_row = next(w for w in status.json()["workers"] if w["id"] == "old-code")
    assert "test.echo" in worker_row["kinds"] and "test.late_kind" not in worker_row["kinds"]
    job.refresh_from_db()
    assert (job.state, job.attempts, job.lease_token) == (State.QUEUED, 0, 0)
    assert not old.events("job_claimed", job_id=job.pk)

    new = workers.start("new-code", env={"HOLDFAST_TEST_LATE_KIND": "1"})
    done = wait_for_job(job.pk, State.SUCCEEDED, workers)
    assert (done.attempts, done.result) == (1, "run by new-code")
    assert workers.command("queue_status", "--json").json()["unserved_kinds"] == []
    for proc in (old, new):
        proc.terminate()
        assert proc.wait_exit(20) == 0, proc.describe()


KEEPER_FAULT = """
from django.core.management import call_command
from jobs.worker import WorkerProcess

real_tick = WorkerProcess._keeper_tick

def faulty_tick(self, *args, **kwargs):
    if self.current is not None:
        raise RuntimeError("injected fault in the lease keeper")
    return real_tick(self, *args, **kwargs)

WorkerProcess._keeper_tick = faulty_tick
call_command("runworker", "--worker-id", "keeper-dies")
"""


def test_a_worker_whose_lease_keeper_dies_gives_its_job_back_and_exits_non_zero(
    workers: WorkerPool, tmp_path: Path
) -> None:
    marker = tmp_path / "running"
    job = enqueueing.enqueue("test.sleep", {"seconds": 60, "marker": str(marker)})
    worker = workers.spawn_python("keeper-dies", KEEPER_FAULT)
    wait_for_marker(marker, worker, timeout=30)
    assert worker.wait_exit(20) == EXIT_KEEPER_DIED, worker.describe()
    assert worker.events("lease_keeper_died", error="injected fault in the lease keeper")
    job = Job.objects.get(pk=job.pk)
    assert (job.state, job.attempts, job.leased_by) == (State.QUEUED, 0, None)
    lease = Lease.objects.get(job_id=job.pk)
    assert (lease.worker_id, lease.outcome) == ("keeper-dies", Outcome.RELEASED)
    # A healthy worker (what the supervisor restarts) runs it.
    Job.objects.filter(pk=job.pk).update(args={"seconds": 0})
    healthy = workers.start("healthy", "--burst")
    assert healthy.wait_exit(30) == 0, healthy.describe()
    assert Job.objects.get(pk=job.pk).state == State.SUCCEEDED
    assert_engine_invariants(job_ids=[job.pk], context=workers.describe())
