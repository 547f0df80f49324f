"""I5 with real scheduler processes: concurrent schedulers, restarts and downtime."""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.models import Job, Schedule
from tests.support.workers import WorkerPool, wait_until

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

EVERY_SECOND = {f"tick-{i}": {"kind": "test.noop", "every": 1} for i in range(5)}
NIGHTLY = {"nightly": {"kind": "test.echo", "cron": "0 3 * * *", "timezone": "Europe/Berlin"}}


def declare(schedules: dict) -> dict[str, str]:
    return {"HOLDFAST_TEST_SCHEDULES": json.dumps(schedules)}


@pytest.mark.postgres
def test_concurrent_schedulers_enqueue_each_slot_exactly_once(workers: WorkerPool) -> None:
    env = declare(EVERY_SECOND)
    schedulers = [workers.spawn(f"scheduler-{i}", "runscheduler", env=env) for i in range(4)]
    synced = Schedule.objects.filter(name__startswith="tick-")
    wait_until(lambda: synced.count() == len(EVERY_SECOND), 20, message="no sync")
    time.sleep(6)
    for proc in schedulers:
        proc.terminate()
    for proc in schedulers:
        assert proc.wait_exit(20) == 0, proc.describe()

    # Every slot advanced by exactly one scheduler, across all four processes' logs...
    slots = Counter(
        (event["schedule"], event["slot"])
        for proc in schedulers
        for event in proc.events("schedule_enqueued")
    )
    assert slots, "no slot was enqueued"
    assert max(slots.values()) == 1, [slot for slot, n in slots.items() if n > 1]
    # ...and each of those slots has its own job.
    keys = list(
        Job.objects.filter(unique_key__startswith="schedule:tick-").values_list(
            "unique_key", flat=True
        )
    )
    assert len(keys) == len(set(keys)) == len(slots)
    assert sum(1 for proc in schedulers if proc.events("schedule_enqueued")) >= 2  # shared


def test_restarting_a_scheduler_repeatedly_adds_nothing_and_runs_nothing_early(
    workers: WorkerPool,
) -> None:
    env = declare(NIGHTLY)
    for _ in range(8):
        result = workers.command("runscheduler", "--once", env=env)
        assert result.returncode == 0, result.describe()
    row = Schedule.objects.get(name="nightly")
    assert row.next_due_at > timezone.now()
    assert not Job.objects.filter(kind="test.echo").exists()


@pytest.mark.parametrize(("policy", "expected"), [("once", 1), ("skip", 0)])
def test_a_scheduler_down_for_three_days_catches_up_once_or_not_at_all(
    workers: WorkerPool, policy: str, expected: int
) -> None:
    env = declare({"nightly": {**NIGHTLY["nightly"], "catch_up": policy}})
    assert workers.command("runscheduler", "--once", env=env).returncode == 0
    # The scheduler was down: its last pass was three days before this one.
    Schedule.objects.filter(name="nightly").update(next_due_at=timezone.now() - timedelta(days=3))
    for _ in range(3):
        assert workers.command("runscheduler", "--once", env=env).returncode == 0
    assert Job.objects.filter(kind="test.echo").count() == expected
    assert Schedule.objects.get(name="nightly").next_due_at > timezone.now()


def test_a_worker_with_the_scheduler_runs_recurring_jobs_itself(workers: WorkerPool) -> None:
    env = declare({"heartbeat": {"kind": "test.echo", "every": 1, "args": {"from": "cron"}}})
    worker = workers.start("small-install", "--with-scheduler", env=env)
    wait_until(
        lambda: Job.objects.filter(kind="test.echo", state="succeeded").count() >= 2,
        20,
        message=worker.describe,
    )
    worker.terminate()
    assert worker.wait_exit(20) == 0, worker.describe()
    job = Job.objects.filter(kind="test.echo", state="succeeded").first()
    assert job is not None and job.args == {"from": "cron"}


@pytest.mark.parametrize("command", [("runscheduler",), ("runworker", "--with-scheduler")])
def test_a_scheduler_with_a_bad_schedule_exits_2_with_one_line(
    workers: WorkerPool, command: tuple[str, ...]
) -> None:
    """Not a worker that keeps running jobs and logs a scheduler traceback twice a second."""
    env = declare({"broken": {"kind": "test.echo", "cron": "not a cron"}})
    result = workers.command(*command, env=env)
    assert result.returncode == 2, result.describe()
    [line] = result.stderr.strip().splitlines()
    assert "schedule 'broken': bad cron 'not a cron'" in line, result.describe()
    assert Schedule.objects.count() == 0 and result.stdout == ""
