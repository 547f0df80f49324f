"""Two workers started with the same ``--worker-id`` by mistake: fencing is by lease
token, not by worker identity, so they still never share a job or double an effect."""

from __future__ import annotations

from collections import Counter

import pytest

from jobs.enqueueing import enqueue_many
from jobs.models import Job, Lease, State
from tests.process.helpers import (
    assert_engine_invariants,
    conflicting_spans,
    overlapping_leases,
)
from tests.support.workers import WorkerPool, wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


def test_two_workers_with_one_id_complete_every_job_once(workers: WorkerPool) -> None:
    jobs = enqueue_many("test.effect", [{"sleep": 0.05} for _ in range(40)])
    ids = [job.pk for job in jobs]
    # Lock-holding jobs too: the twins' locks are told apart by lease token, not by id.
    locked = [
        job.pk
        for job in enqueue_many(
            "test.locked", [{"resources": ["a", "b"][: n % 2 + 1]} for n in range(8)]
        )
    ]
    twin_env = {"HOLDFAST_POLL_SECONDS": "0.1"}
    first = workers.spawn("twin-a", "runworker", "--worker-id", "twin", env=twin_env)
    second = workers.spawn("twin-b", "runworker", "--worker-id", "twin", env=twin_env)
    wait_until(
        lambda: (
            Job.objects.filter(pk__in=ids + locked, state=State.SUCCEEDED).count()
            == len(ids) + len(locked)
        ),
        60,
        message=lambda: first.describe() + second.describe(),
    )
    for proc in (first, second):
        proc.terminate()
        assert proc.wait_exit(20) == 0, proc.describe()
    effects = Counter(Effect.objects.filter(label="complete").values_list("job_id", flat=True))
    assert effects == Counter(ids)  # exactly one effect per job
    assert overlapping_leases(ids) == []
    assert set(Lease.objects.filter(job_id__in=ids).values_list("worker_id", flat=True)) == {"twin"}
    # Both processes worked: the jobs were shared, not run twice by one of them.
    assert first.events("job_claimed") and second.events("job_claimed")
    assert conflicting_spans(locked) == []
    assert_engine_invariants(context=first.describe() + second.describe())
