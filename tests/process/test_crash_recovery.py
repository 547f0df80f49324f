"""Workers that die or freeze mid-job: leases expire, jobs are reclaimed (I3), stale
attempts cannot write (I2), effects land exactly once (I4). Real ``runworker`` processes."""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from jobs.enqueueing import enqueue, enqueue_many
from jobs.models import Job, Lease, Outcome, State
from tests.process.helpers import (
    assert_engine_invariants,
    concurrent_jobs_per_worker,
    conflicting_spans,
    job_summary,
    overlapping_leases,
    stop_outside_transaction,
    wait_for_job,
    wait_for_lease_outcome,
    wait_for_marker,
)
from tests.support.workers import WorkerPool, WorkerProc, wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


def effects_of(job_id: int) -> list[tuple[str, int, int]]:
    return list(
        Effect.objects.filter(job_id=job_id)
        .order_by("pk")
        .values_list("label", "attempt", "lease_token")
    )


def test_sigkill_mid_job_is_reclaimed_and_completed_by_another_worker(
    workers: WorkerPool, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    job = enqueue("test.progress_then_sleep", {"sleep": 3, "marker": str(marker)})
    victim = workers.start("victim")
    wait_for_marker(marker, victim)
    victim.wait_for_event("job_claimed", job_id=job.pk, lease_token=1)

    assert victim.kill() == -signal.SIGKILL
    running = Job.objects.get(pk=job.pk)
    assert running.state == State.RUNNING  # nobody holds it now, but the lease still does
    assert running.leased_by == "victim"

    rescuer = workers.start("rescuer")
    wait_for_job(job.pk, State.SUCCEEDED, workers, timeout=20)

    job.refresh_from_db()
    assert job.attempts == 2, job_summary([job.pk])
    assert job.lease_token == 2
    assert job.result == "done"
    leases = {lease.lease_token: lease for lease in Lease.objects.filter(job_id=job.pk)}
    assert set(leases) == {1, 2}
    assert leases[1].worker_id == "victim"
    assert leases[1].outcome == Outcome.LEASE_EXPIRED
    assert leases[1].error_class == "LeaseExpired"
    assert leases[1].released_at is not None
    assert leases[2].worker_id == "rescuer"
    assert leases[2].outcome == Outcome.SUCCEEDED
    # The killed attempt died while sleeping: every effect belongs to the second one.
    assert effects_of(job.pk) == [("progress", 2, 2), ("complete", 2, 2)]
    assert rescuer.events("lease_reclaimed", job_id=job.pk, lease_token=1)
    assert rescuer.alive
    assert_engine_invariants(context=workers.describe())


def _freeze_past_lease(
    workers: WorkerPool, tmp_path: Path, kind: str, sleep: float
) -> tuple[Job, WorkerProc, WorkerProc]:
    """A worker claims a job and is SIGSTOPped (lease keeper included) mid-handler;
    a second worker reclaims the job once the frozen lease expires and completes it.
    Returns the job (succeeded), the frozen worker (still stopped) and the rescuer."""
    marker = tmp_path / "started"
    job = enqueue(kind, {"sleep": sleep, "marker": str(marker)})
    frozen = workers.start("frozen")
    wait_for_marker(marker, frozen)
    stop_outside_transaction(frozen)

    rescuer = workers.start("rescuer")
    wait_for_lease_outcome(job.pk, 1, Outcome.LEASE_EXPIRED, workers, timeout=15)
    wait_for_job(job.pk, State.SUCCEEDED, workers, timeout=20)
    assert frozen.alive and frozen.stopped
    job.refresh_from_db()
    assert job.lease_token == 2
    assert job.attempts == 2
    return job, frozen, rescuer


def test_sigstopped_worker_cannot_write_after_its_lease_was_reclaimed(
    workers: WorkerPool, tmp_path: Path
) -> None:
    """The frozen attempt's ``ctx.atomic()`` progress write (and so its completion) is
    rejected after SIGCONT; only the successful attempt's effects exist."""
    job, frozen, rescuer = _freeze_past_lease(workers, tmp_path, "test.progress_then_sleep", 2.5)
    before = effects_of(job.pk)
    assert before == [("progress", 2, 2), ("complete", 2, 2)]

    frozen.cont()
    rejected = frozen.wait_for_event("lease_lost", timeout=15, job_id=job.pk, during="handler")
    assert rejected["lease_token"] == 1

    # The stale attempt wrote nothing: no effect with its token, no second completion.
    assert effects_of(job.pk) == before
    assert not Effect.objects.filter(job_id=job.pk, lease_token=1).exists()
    assert Effect.objects.filter(job_id=job.pk, label="complete").count() == 1
    job.refresh_from_db()
    assert job.state == State.SUCCEEDED
    assert job.lease_token == 2
    assert job.result == "done"
    leases = dict(Lease.objects.filter(job_id=job.pk).values_list("lease_token", "outcome"))
    assert leases == {1: Outcome.LEASE_EXPIRED, 2: Outcome.SUCCEEDED}
    assert not frozen.events("job_succeeded", lease_token=1)
    # The worker survives losing its lease and goes on serving the queue.
    follow_up = enqueue("test.echo", {"after": "sigcont"})
    wait_for_job(follow_up.pk, State.SUCCEEDED, workers)
    assert frozen.alive and rescuer.alive
    assert_engine_invariants(context=workers.describe())


def test_sigstopped_worker_cannot_complete_after_its_lease_was_reclaimed(
    workers: WorkerPool, tmp_path: Path
) -> None:
    """A handler that returns normally: the worker's own completion write is fenced too."""
    job, frozen, rescuer = _freeze_past_lease(workers, tmp_path, "test.slow_return", 2.5)
    assert job.result == {"pid": rescuer.pid, "lease_token": 2}

    frozen.cont()
    rejected = frozen.wait_for_event(
        "lease_lost", timeout=15, job_id=job.pk, during="job_succeeded"
    )
    assert rejected["lease_token"] == 1
    job.refresh_from_db()
    assert job.state == State.SUCCEEDED
    assert job.result == {"pid": rescuer.pid, "lease_token": 2}  # not overwritten
    leases = dict(Lease.objects.filter(job_id=job.pk).values_list("lease_token", "outcome"))
    assert leases == {1: Outcome.LEASE_EXPIRED, 2: Outcome.SUCCEEDED}
    assert frozen.alive
    assert_engine_invariants(context=workers.describe())


def _eventually(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _mid_job(proc: WorkerProc) -> bool:
    """True if the last lifecycle event ``proc`` logged is a claim (it is running a job)."""
    lifecycle = {"job_claimed", "job_succeeded", "job_retry_scheduled", "job_dead", "lease_lost"}
    events = [e["event"] for e in proc.events() if e.get("event") in lifecycle]
    return bool(events) and events[-1] == "job_claimed"


def test_random_sigkills_under_load_apply_every_effect_exactly_once(
    workers: WorkerPool,
) -> None:
    rng = random.Random(20261130)
    total = 80
    # Lock-holding jobs first in line: a kill mid-job leaves their locks to the reclaimer.
    resource_sets = [["x"], ["x", "y"], ["y"]]
    locked_jobs = enqueue_many(
        "test.locked", [{"resources": resource_sets[n % 3], "seconds": 0.2} for n in range(12)]
    )
    locked = [job.pk for job in locked_jobs]
    jobs = enqueue_many("test.effect", [{"sleep": 0.2} for _ in range(total)])
    ids = [job.pk for job in jobs]

    serial = 0

    def start_worker(wait: bool) -> WorkerProc:
        nonlocal serial
        serial += 1
        return workers.start(f"w{serial}", wait_started=wait)

    live = [start_worker(wait=True) for _ in range(3)]
    kills = 0
    deadline = time.monotonic() + 40
    while kills < 10 and time.monotonic() < deadline:
        if Job.objects.filter(pk__in=ids, state=State.QUEUED).count() < 10:
            break
        victim = rng.choice(live)
        # Kill it while it runs a job (a random moment inside the handler or its commit).
        if not _eventually(lambda v=victim: _mid_job(v), 3):
            continue
        time.sleep(rng.uniform(0.0, 0.2))
        victim.kill()
        kills += 1
        live.remove(victim)
        live.append(start_worker(wait=False))
        time.sleep(rng.uniform(0.1, 0.4))

    def unfinished() -> list[int]:
        pending = Job.objects.filter(pk__in=ids).exclude(state=State.SUCCEEDED)
        return list(pending.values_list("pk", flat=True))

    wait_until(
        lambda: not unfinished(),
        45,
        interval=0.2,
        message=lambda: (
            f"queue not drained after {kills} kills\n"
            f"{job_summary(unfinished())}\n{workers.describe()}"
        ),
    )

    assert kills >= 5, f"only {kills} kills happened before the queue drained"
    assert all(proc.alive for proc in live), workers.describe()
    states = Counter(Job.objects.filter(pk__in=ids).values_list("state", flat=True))
    assert states == {State.SUCCEEDED: total}

    completes = Counter(
        Effect.objects.filter(job_id__in=ids, label="complete").values_list("job_id", flat=True)
    )
    assert completes == dict.fromkeys(ids, 1), "a job's effect is missing or duplicated"
    assert Effect.objects.filter(job_id__in=ids).count() == total
    # Each effect was written by the attempt that completed the job, under its token.
    for job_id, attempts, token in Job.objects.filter(pk__in=ids).values_list(
        "pk", "attempts", "lease_token"
    ):
        effect = Effect.objects.get(job_id=job_id)
        assert (effect.attempt, effect.lease_token) == (attempts, token), job_summary([job_id])
        outcomes = Counter(Lease.objects.filter(job_id=job_id).values_list("outcome", flat=True))
        assert outcomes[Outcome.SUCCEEDED] == 1
        assert outcomes[Outcome.RUNNING] == 0
        assert sum(outcomes.values()) == attempts
    assert overlapping_leases(ids) == []
    assert concurrent_jobs_per_worker(ids) == []
    # The kills landed mid-job: some attempts were recovered by lease expiry.
    assert Lease.objects.filter(job_id__in=ids, outcome=Outcome.LEASE_EXPIRED).exists()
    wait_until(
        lambda: Job.objects.filter(pk__in=locked, state=State.SUCCEEDED).count() == len(locked),
        20,
        message=lambda: f"{job_summary(locked)}\n{workers.describe()}",
    )
    assert conflicting_spans(locked) == []
    assert_engine_invariants(context=workers.describe())
