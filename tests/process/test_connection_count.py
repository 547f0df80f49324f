"""A worker process holds at most two PostgreSQL connections (docs/deployment.md): its
main thread's, and the lease keeper's side connection, on which its heartbeats, reclaim,
LISTEN (wake-ups and cancels) and, with ``--with-scheduler``, the scheduler run.

32 real ``runworker`` processes with a small lease and a short idle poll, some running a
job, some idle, some with the scheduler; each process's backends are counted in
``pg_stat_activity`` by ``application_name`` (libpq takes it from ``PGAPPNAME``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from django.db import connection

from jobs import enqueueing
from jobs.models import Job, State, Worker
from tests.support.workers import WorkerPool, wait_until

pytestmark = [pytest.mark.process, pytest.mark.postgres, pytest.mark.timeout(120)]

WORKERS = 32
BUSY = 8  # jobs that keep a worker running while the count is taken
APP = "hf-conn-{n}"


def backends() -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE 'hf-conn-%%' "
            "GROUP BY application_name"
        )
        return dict(cursor.fetchall())


def test_32_workers_hold_two_connections_each(workers: WorkerPool, tmp_path: Path) -> None:
    schedules = {"tick": {"kind": "test.noop", "every": 1}}
    env = {
        "HOLDFAST_POLL_SECONDS": "0.5",
        "HOLDFAST_LEASE_SECONDS": "3",
        "HOLDFAST_TEST_SCHEDULES": json.dumps(schedules),
    }
    jobs = [
        enqueueing.enqueue("test.sleep", {"seconds": 40, "marker": str(tmp_path / f"m{n}")})
        for n in range(BUSY)
    ]
    procs = []
    for n in range(WORKERS):
        extra = ("--with-scheduler",) if n % 8 == 0 else ()  # four run the scheduler too
        procs.append(
            workers.start(
                f"conn-{n}", *extra, env={**env, "PGAPPNAME": APP.format(n=n)}, wait_started=False
            )
        )

    def describe() -> str:
        return f"backends: {backends()}\n{workers.describe()}"

    wait_until(
        lambda: Worker.objects.filter(pk__startswith="conn-", stopped_at=None).count() == WORKERS,
        60,
        interval=0.2,
        message=describe,
    )
    wait_until(
        lambda: (
            Job.objects.filter(pk__in=[j.pk for j in jobs], state=State.RUNNING).count() == BUSY
        ),
        30,
        interval=0.2,
        message=describe,
    )
    # Every process has opened its side connection (it LISTENs: `listening` logged).
    wait_until(
        lambda: all(proc.events("listening") for proc in procs), 30, interval=0.2, message=describe
    )
    seen: dict[str, int] = {}
    for _ in range(10):  # the highest count of each process over about 2 s
        for name, count in backends().items():
            seen[name] = max(seen.get(name, 0), count)
        time.sleep(0.2)
    assert set(seen) == {APP.format(n=n) for n in range(WORKERS)}, describe()
    assert all(count == 2 for count in seen.values()), seen
    assert sum(seen.values()) == 2 * WORKERS
    # The scheduler's ticks run (on 2 busy cores a tick can still be settling here).
    wait_until(
        lambda: Job.objects.filter(kind="test.noop", state=State.SUCCEEDED).exists(),
        30,
        interval=0.2,
        message=describe,
    )
    for proc in procs:
        assert proc.alive, proc.describe()
        assert not proc.events("background_step_failed"), proc.describe()
