"""The database crashes under running workers (PostgreSQL, crash-like ``immediate``
restarts of a throwaway cluster): the workers survive, the queue drains, and every job's
effect is applied exactly once (I3, I4, DESIGN §3 "a worker survives a database outage").

This test never touches the test database: it runs its own cluster in ``tmp_path`` and
reads it with psycopg. It fails (never skips) when no cluster can be started.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.conftest import subprocess_env
from tests.process.helpers import assert_engine_invariants
from tests.support.pgcluster import Cluster
from tests.support.workers import WorkerPool, wait_until

pytestmark = [pytest.mark.process, pytest.mark.postgres, pytest.mark.timeout(120)]

JOBS = 40


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(tmp_path / "pg") as running:
        running.create_database("holdfast")
        yield running


def cluster_env(cluster: Cluster, tmp_path: Path) -> dict[str, str]:
    return subprocess_env(cluster.url("holdfast"), tmp_path)


class Probe:
    """Reads the cluster's tables with short-lived psycopg connections (the database
    restarts under it, so no connection is kept)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def rows(self, sql: str) -> list[tuple]:
        with psycopg.connect(self.url, connect_timeout=3) as conn:
            return conn.execute(sql).fetchall()

    def try_count(self, sql: str) -> int:
        try:
            return self.rows(sql)[0][0]
        except psycopg.OperationalError:
            return -1

    def succeeded(self) -> int:
        return self.try_count("SELECT count(*) FROM jobs_job WHERE state = 'succeeded'")


def test_workers_survive_database_crashes_and_apply_each_effect_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    env = cluster_env(cluster, tmp_path)
    probe = Probe(cluster.url("holdfast"))
    with WorkerPool(env, tmp_path / "logs") as pool:
        migrate = pool.command("migrate", "-v", "0", timeout=60)
        assert migrate.returncode == 0, migrate.describe()
        pool.python(
            "from jobs.enqueueing import enqueue_many\n"
            f"enqueue_many('test.effect', [{{'sleep': 0.15}}] * {JOBS})\n"
        )
        assert probe.rows("SELECT count(*) FROM jobs_job WHERE state = 'queued'") == [(JOBS,)]

        workers = [pool.start(f"w{i}") for i in (1, 2)]

        def describe() -> str:
            jobs = probe.rows("SELECT state, count(*) FROM jobs_job GROUP BY state")
            return f"jobs by state: {jobs}\n{pool.describe()}"

        # Crash the database twice while the workers are busy: a crash-like restart, then
        # a crash followed by an outage longer than the jobs' 2 s leases.
        threshold = 5
        for crash, outage in ((1, 0.0), (2, 3.0)):
            wait_until(
                lambda t=threshold: probe.succeeded() >= t,
                30,
                interval=0.05,
                message=lambda c=crash: f"no progress before crash {c}\n{describe()}",
            )
            cluster.stop("immediate")
            time.sleep(outage)
            cluster.start()
            assert all(worker.alive for worker in workers), pool.describe()
            threshold = max(probe.succeeded(), 0) + 5
            assert threshold < JOBS, "the queue drained before the crash: lower the job rate"

        wait_until(
            lambda: probe.succeeded() == JOBS,
            60,
            interval=0.2,
            message=lambda: f"queue not drained after the crashes\n{describe()}",
        )
        # The workers lived through it, noticed the outage and kept working.
        assert all(worker.alive for worker in workers), pool.describe()
        assert any(worker.events("database_unavailable") for worker in workers), pool.describe()

        states = probe.rows("SELECT state, count(*) FROM jobs_job GROUP BY state")
        assert states == [("succeeded", JOBS)]
        per_job = probe.rows(
            "SELECT j.id, j.lease_token, j.attempts, count(e.id), "
            "       min(e.lease_token), min(e.attempt) "
            "FROM jobs_job j LEFT JOIN testapp_effect e "
            "  ON e.job_id = j.id AND e.label = 'complete' "
            "GROUP BY j.id ORDER BY j.id"
        )
        assert len(per_job) == JOBS
        for job_id, token, attempts, effects, effect_token, effect_attempt in per_job:
            assert effects == 1, f"job {job_id} has {effects} effects\n{describe()}"
            assert (effect_token, effect_attempt) == (token, attempts), f"job {job_id}"
        assert probe.rows("SELECT count(*) FROM testapp_effect") == [(JOBS,)]
        assert (
            probe.rows(
                "SELECT j.id FROM jobs_job j WHERE (SELECT count(*) FROM jobs_lease l "
                "WHERE l.job_id = j.id AND l.outcome = 'succeeded') <> 1"
            )
            == []
        )
        assert probe.rows("SELECT count(*) FROM jobs_lease WHERE outcome = 'running'") == [(0,)]
        # A crash is nobody's failure: no attempt is recorded as failed, and a job is charged
        # only for attempts whose lease ran out during the longer outage (reclaimed).
        failed = probe.rows("SELECT job_id, error_class FROM jobs_lease WHERE outcome = 'failed'")
        assert failed == [], describe()
        overcharged = probe.rows(
            "SELECT j.id, j.attempts FROM jobs_job j WHERE j.attempts <> 1 + (SELECT count(*) "
            "FROM jobs_lease l WHERE l.job_id = j.id AND l.outcome = 'lease_expired')"
        )
        assert overcharged == [], describe()
        # I1: each attempt's lease began after the previous one was released.
        overlapping = probe.rows(
            "SELECT a.job_id, a.lease_token FROM jobs_lease a JOIN jobs_lease b "
            "  ON b.job_id = a.job_id AND b.lease_token = a.lease_token + 1 "
            "WHERE a.released_at IS NULL OR a.released_at > b.acquired_at"
        )
        assert overlapping == []
        assert_engine_invariants(probe.rows, context=describe())

        # And they still stop cleanly.
        for worker in workers:
            worker.terminate()
        for worker in workers:
            assert worker.wait_exit(timeout=15) == 0, worker.describe()


def test_a_job_that_finished_during_an_outage_longer_than_its_lease_is_settled_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The handler returns while the server is down, and the outage outlasts the lease.
    Back up, the other worker's (or its own worker's) lease keeper reconnected first and
    reclaimed the lease as a dead worker's: the job ran again, and the finished result
    was refused (``lease_lost``). Now the keeper renews while its settle waits, and a
    reclaimer that lost its connection leaves expired leases alone for a while
    (``engine.ReclaimHold``)."""
    env = cluster_env(cluster, tmp_path)
    probe = Probe(cluster.url("holdfast"))
    marker = tmp_path / "started"
    with WorkerPool(env, tmp_path / "logs") as pool:
        migrate = pool.command("migrate", "-v", "0", timeout=60)
        assert migrate.returncode == 0, migrate.describe()
        workers = [pool.start(f"w{i}") for i in (1, 2)]
        enqueue_sleep(pool, marker, seconds=2)
        wait_until(marker.exists, 20, interval=0.05, message=pool.describe)
        cluster.stop("fast")
        time.sleep(8)  # the handler returns, its lease runs out, the settle backs off (8 s)
        cluster.start()

        def describe() -> str:
            rows = probe.rows("SELECT lease_token, worker_id, outcome FROM jobs_lease")
            return f"attempts: {rows}\n{pool.describe()}"

        wait_until(lambda: succeeded_jobs(probe) == 1, 60, interval=0.2, message=describe)
        assert probe.rows("SELECT attempts, lease_token FROM jobs_job") == [(1, 1)], describe()
        assert probe.rows("SELECT outcome FROM jobs_lease") == [("succeeded",)], describe()
        assert all(worker.alive for worker in workers), pool.describe()
        assert not any(worker.events("lease_lost") for worker in workers), describe()


def test_a_worker_killed_during_an_outage_has_its_job_reclaimed_after_the_hold(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The other side of the hold: a job whose worker really died meanwhile is reclaimed
    once the survivors' hold is over (``RECLAIM_HOLD_AFTER_OUTAGE`` after their last
    failed connection), and runs again."""
    env = cluster_env(cluster, tmp_path)
    probe = Probe(cluster.url("holdfast"))
    marker = tmp_path / "started"
    with WorkerPool(env, tmp_path / "logs") as pool:
        migrate = pool.command("migrate", "-v", "0", timeout=60)
        assert migrate.returncode == 0, migrate.describe()
        victim = pool.start("victim")
        enqueue_sleep(pool, marker, seconds=3)
        wait_until(marker.exists, 20, interval=0.05, message=pool.describe)
        survivor = pool.start("survivor")
        cluster.stop("fast")
        victim.kill()
        time.sleep(4)
        cluster.start()
        back = time.monotonic()

        def describe() -> str:
            rows = probe.rows("SELECT lease_token, worker_id, outcome FROM jobs_lease")
            return f"attempts: {rows}\n{pool.describe()}"

        wait_until(lambda: succeeded_jobs(probe) == 1, 90, interval=0.2, message=describe)
        assert time.monotonic() - back < 30 + 5 + 3 + 20, describe()  # hold, reclaim, run
        assert probe.rows("SELECT attempts, lease_token FROM jobs_job") == [(2, 2)], describe()
        outcomes = probe.rows("SELECT worker_id, outcome FROM jobs_lease ORDER BY id")
        assert outcomes == [("victim", "lease_expired"), ("survivor", "succeeded")], describe()
        assert survivor.events("reclaims_held"), describe()


def enqueue_sleep(pool: WorkerPool, marker: Path, seconds: float) -> None:
    pool.python(
        "from jobs.enqueueing import enqueue\n"
        f"enqueue('test.sleep', {{'seconds': {seconds}, 'marker': {str(marker)!r}}},"
        " lease_seconds=2, max_attempts=5)\n"
    )


def succeeded_jobs(probe: Probe) -> int:
    return probe.try_count("SELECT count(*) FROM jobs_job WHERE state = 'succeeded'")
