"""A lane's max_running holds across worker processes (checked from the lease windows)."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from django.test import override_settings

from jobs.enqueueing import enqueue_many
from jobs.models import Job, Lease, State
from tests.process.helpers import assert_engine_invariants
from tests.support.workers import WorkerPool, wait_until

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

LANES = {"default": {}, "serial": {"kinds": ["test.sleep"], "max_running": 1}}


def test_four_workers_run_a_max_running_1_lane_one_job_at_a_time(workers: WorkerPool) -> None:
    env = {"HOLDFAST_TEST_LANES": json.dumps(LANES)}
    procs = [workers.start(f"w{i}", env=env) for i in range(4)]
    with override_settings(HOLDFAST_LANES=LANES):  # enqueue into the workers' lanes
        jobs = enqueue_many("test.sleep", [{"seconds": 0.2} for _ in range(8)])
    ids = [job.pk for job in jobs]
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, state=State.SUCCEEDED).count() == len(ids),
        60,
        message=workers.describe,
    )
    windows = sorted(Lease.objects.filter(job_id__in=ids).values_list("acquired_at", "released_at"))
    overlaps = [(a, b) for a, b in pairwise(windows) if b[0] < a[1]]
    assert overlaps == [], overlaps
    for proc in procs:
        proc.terminate()
        assert proc.wait_exit(20) == 0, proc.describe()
    assert_engine_invariants(context=workers.describe())


PAIR = {"default": {}, "pair": {"kinds": ["test.sleep"], "max_running": 2}}


def most_at_once(windows: list[tuple]) -> int:
    """The largest number of (start, end) windows open at one moment."""
    edges = sorted([(start, 1) for start, _ in windows] + [(end, -1) for _, end in windows])
    running = peak = 0
    for _, step in edges:  # an end sorts before a start at the same instant
        running += step
        peak = max(peak, running)
    return peak


@pytest.mark.postgres
def test_eight_racing_workers_never_exceed_max_running_2(workers: WorkerPool) -> None:
    """Eight workers serving every lane race for a max_running=2 lane's two slots (rows of
    jobs_joblock taken by the claim statement, no lane lock): never three at once."""
    env = {"HOLDFAST_TEST_LANES": json.dumps(PAIR)}
    with override_settings(HOLDFAST_LANES=PAIR):
        jobs = enqueue_many("test.sleep", [{"seconds": 0.05} for _ in range(40)])
        jobs += enqueue_many("test.noop", [{} for _ in range(40)])  # unlimited lane
    procs = [workers.start(f"w{i}", env=env) for i in range(8)]
    ids = [job.pk for job in jobs]
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, state=State.SUCCEEDED).count() == len(ids),
        60,
        message=workers.describe,
    )
    windows = list(
        Lease.objects.filter(job_id__in=ids, job__lane="pair").values_list(
            "acquired_at", "released_at"
        )
    )
    assert len(windows) == 40
    assert most_at_once(windows) <= 2, sorted(windows)
    for proc in procs:
        proc.terminate()
        assert proc.wait_exit(20) == 0, proc.describe()
    assert_engine_invariants(context=workers.describe())
