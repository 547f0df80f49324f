"""Workers killed or frozen while their jobs hold resource locks (issue #6).

A worker SIGSTOPped past its lease keeps its locks only until the reclaim; after SIGCONT
its stale attempt can write nothing, and no other job ran on its resources before the
reclaim released them.

Randomized concurrency: lock-holding jobs, several workers, random SIGKILLs.

Many ``test.locked`` jobs, each holding a random subset of a small resource pool, some in
a lane with a ``max_running``, run on several worker processes while the test SIGKILLs
busy workers at random moments and starts replacements. Whatever the schedule: nothing
deadlocks (the queue drains before a deadline), no two jobs sharing a resource ever run
at once (I8, from the ``Span`` rows), the lane never runs more than its limit (sampled
while it runs, and from the lease windows afterwards), and the engine's record keeps its
invariants (no duplicate completion, no lost event, no lock left behind).

The random choices come from one seed, printed at the start (pytest shows it with a
failure) and named in every failure message. Replay a run with
``HOLDFAST_CHAOS_SEED=<seed>``; process timing still varies between runs.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.db import connection
from django.db.models import Count
from django.test import override_settings

from jobs import counts
from jobs.enqueueing import enqueue
from jobs.models import Job, JobEvent, Lease, Outcome, State
from tests.process.helpers import (
    assert_engine_invariants,
    concurrent_jobs_per_worker,
    conflicting_spans,
    job_summary,
    most_leases_at_once,
    overlapping_leases,
    stop_outside_transaction,
    wait_for_job,
)
from tests.support.workers import WorkerPool, WorkerProc, wait_until
from tests.testapp.models import Span

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

SEED_VARIABLE = "HOLDFAST_CHAOS_SEED"
RESOURCES = [f"r{n}" for n in range(5)]
LIMITED = "limited"
MAX_RUNNING = 2
LANES = {"default": {}, LIMITED: {"max_running": MAX_RUNNING}}
DRAIN_SECONDS = 60.0  # a stall this long means a deadlock (or a stranded lock)


def test_a_worker_frozen_past_its_lease_loses_its_locks_only_through_the_reclaim(
    workers: WorkerPool,
) -> None:
    frozen_job = enqueue("test.locked", {"resources": ["r1", "r2"], "seconds": 1.5})
    frozen = workers.start("frozen")
    wait_until(
        lambda: Span.objects.filter(job_id=frozen_job.pk).exists(),
        15,
        message=frozen.describe,
    )
    stop_outside_transaction(frozen)  # asleep in the handler, holding r1 and r2

    waiting = enqueue("test.locked", {"resources": ["r2"], "seconds": 0.05})
    workers.start("rescuer")
    wait_for_job(waiting.pk, State.SUCCEEDED, workers)
    wait_for_job(frozen_job.pk, State.SUCCEEDED, workers)
    frozen.cont()
    frozen.wait_for_event("lease_lost", job_id=frozen_job.pk, lease_token=1, during="handler")

    # The stale attempt's span never ended: its completion was fenced out.
    spans = dict(Span.objects.filter(job_id=frozen_job.pk).values_list("lease_token", "ended_at"))
    assert spans.keys() == {1, 2} and spans[1] is None and spans[2] is not None
    reclaimed = JobEvent.objects.get(job_id=frozen_job.pk, event="reclaimed", lease_token=1)
    assert Span.objects.get(job_id=waiting.pk).started_at >= reclaimed.at
    ids = [frozen_job.pk, waiting.pk]
    assert conflicting_spans(ids) == [], workers.describe()
    assert_engine_invariants(context=workers.describe())


@dataclass(frozen=True)
class Scale:
    jobs: int
    workers: int
    kills: int


# SQLite serializes every writer: a smaller run there.
SCALES = {"postgresql": Scale(jobs=120, workers=4, kills=5), "sqlite": Scale(40, 3, 3)}


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get(SEED_VARIABLE) or random.SystemRandom().randrange(2**32))
    print(f"chaos seed: {SEED_VARIABLE}={value}")
    return value


@dataclass
class Chaos:
    """The run's schedule (from the seed) and what it saw while the workers ran."""

    seed: int
    pool: WorkerPool
    rng: random.Random = field(init=False)
    live: list[WorkerProc] = field(default_factory=list)
    kills: int = 0
    most_running: int = 0  # the most running jobs sampled at once in the limited lane
    samples: int = 0
    started: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def replay(self) -> str:
        return f"(replay with {SEED_VARIABLE}={self.seed})"

    def start_worker(self, wait: bool) -> None:
        self.started += 1
        env = {"HOLDFAST_TEST_LANES": json.dumps(LANES)}
        self.live.append(self.pool.start(f"w{self.started}", env=env, wait_started=wait))

    def job_args(self) -> dict[str, Any]:
        return {
            "resources": self.rng.sample(RESOURCES, self.rng.randint(1, 3)),
            "seconds": round(self.rng.uniform(0.02, 0.15), 3),
        }

    def sample(self) -> int:
        """Record the limited lane's running count; return how many jobs are unfinished."""
        by_lane_state = Job.objects.values_list("lane", "state").annotate(n=Count("id")).order_by()
        unfinished = 0
        for lane, state, n in by_lane_state:
            if state == State.RUNNING and lane == LIMITED:
                self.most_running = max(self.most_running, n)
            if state != State.SUCCEEDED:
                unfinished += n
        self.samples += 1
        return unfinished

    def kill_a_busy_worker(self) -> bool:
        """SIGKILL a random live worker if it is running a job now; start its successor."""
        victim = self.rng.choice(self.live)
        if not Job.objects.filter(state=State.RUNNING, leased_by=victim.name).exists():
            return False
        victim.kill()
        self.kills += 1
        self.live.remove(victim)
        self.start_worker(wait=False)
        return True


def test_random_lock_sets_under_random_kills_never_overlap_stall_or_exceed_a_lane(
    workers: WorkerPool, seed: int
) -> None:
    chaos = Chaos(seed, workers)
    scale = SCALES[connection.vendor]
    with override_settings(HOLDFAST_LANES=LANES):  # enqueue into the workers' lanes
        ids = [
            enqueue(
                "test.locked",
                chaos.job_args(),
                lane=LIMITED if chaos.rng.random() < 0.3 else None,
            ).pk
            for _ in range(scale.jobs)
        ]
    limited = list(Job.objects.filter(pk__in=ids, lane=LIMITED).values_list("pk", flat=True))
    for _ in range(scale.workers):
        chaos.start_worker(wait=False)

    deadline = time.monotonic() + DRAIN_SECONDS
    next_kill = time.monotonic() + chaos.rng.uniform(0.5, 1.5)
    while chaos.sample():
        now = time.monotonic()
        if now >= deadline:
            stuck = Job.objects.exclude(state=State.SUCCEEDED).values_list("pk", flat=True)
            raise AssertionError(
                f"not drained after {DRAIN_SECONDS:.0f} s (deadlock?) {chaos.replay()}\n"
                f"{job_summary(stuck)}\n{workers.describe()}"
            )
        if chaos.kills < scale.kills and now >= next_kill and chaos.kill_a_busy_worker():
            next_kill = now + chaos.rng.uniform(0.3, 1.5)
        time.sleep(0.02)

    context = f"{chaos.replay()}\n{workers.describe()}"
    assert chaos.kills >= 1, f"no worker was killed mid-job {context}"
    assert all(proc.alive for proc in chaos.live), context
    assert Counter(Job.objects.filter(pk__in=ids).values_list("state", flat=True)) == {
        State.SUCCEEDED: len(ids)
    }, context
    assert Lease.objects.filter(job_id__in=ids, outcome=Outcome.LEASE_EXPIRED).exists(), context
    assert conflicting_spans(ids) == [], context
    assert 1 <= chaos.most_running <= MAX_RUNNING, f"{chaos.most_running=} {context}"
    assert most_leases_at_once(limited) <= MAX_RUNNING, context
    assert overlapping_leases(ids) == [], context
    assert concurrent_jobs_per_worker(ids) == [], context
    assert_engine_invariants(job_ids=ids, context=context)
    # The finished jobs' counts, kept by concurrent settles and reclaims, match the rows.
    truth = Job.objects.values_list("lane", "state").annotate(n=Count("id")).order_by()
    assert counts.by_lane() == {(lane, state): n for lane, state, n in truth}, context
    print(
        f"chaos: {len(ids)} jobs, {chaos.kills} kills, {chaos.started} workers, "
        f"{chaos.samples} samples, at most {chaos.most_running} running in {LIMITED!r}"
    )
