"""A lane's max_running holds across worker processes (checked from the lease windows)."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from django.test import override_settings

from jobs.engine import enqueue_many
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
