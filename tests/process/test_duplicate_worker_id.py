"""Two workers with the same ``--worker-id``: ``runworker`` refuses an id a live worker
holds (exit 2), and twins that get past it all the same (started at the same moment, or
on two hosts) still never share a job or double an effect: fencing is by lease token,
not by worker identity."""

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

# ``runworker`` with its check of a live twin skipped: as two started at the same moment.
UNCHECKED_RUNWORKER = """
from django.core.management import call_command
from jobs.management.commands import runworker
runworker.refuse_twin = lambda worker_id: None
call_command("runworker", "--worker-id", "twin")
"""

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
    first.wait_for_event("worker_started")
    second = workers.spawn_python("twin-b", UNCHECKED_RUNWORKER, env=twin_env)
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


def test_an_id_a_live_worker_holds_is_refused_and_free_again_once_it_is_gone(
    workers: WorkerPool,
) -> None:
    first = workers.start("fixed")
    refused = workers.command("runworker", "--burst", "--worker-id", "fixed")
    assert refused.returncode == 2, refused.describe()
    assert "'fixed' is in use by a live worker" in refused.stderr, refused.describe()
    assert f"pid {first.pid}" in refused.stderr and "Traceback" not in refused.stderr
    assert first.alive, first.describe()
    # Killed and restarted at once under its fixed id (a process supervisor): its row
    # still looks live, but its process is gone, so the id is free.
    first.kill()
    job = enqueue_many("test.echo", [{"n": 1}])[0]
    again = workers.command("runworker", "--burst", "--worker-id", "fixed")
    assert again.returncode == 0, again.describe()
    assert Job.objects.get(pk=job.pk).state == State.SUCCEEDED
    # Stopped cleanly: the row says so.
    assert workers.command("runworker", "--burst", "--worker-id", "fixed").returncode == 0
