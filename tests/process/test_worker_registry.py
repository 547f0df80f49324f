"""Workers come and go cleanly (issue 12): a SIGKILLed worker's row shows ``gone`` once
its heartbeat is older than the cutoff (not "stale" for ever), and a live worker's lease
keeper prunes it after ``HOLDFAST_WORKER_RETENTION_SECONDS``. Time travels by moving the
dead worker's last heartbeat back; the workers themselves are real processes."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db.models.functions import Now

from jobs.models import Worker
from jobs.status import worker_liveness
from ops.views import worker_health
from tests.support.workers import WorkerPool, wait_until

from ..integration.helpers import run_json

pytestmark = pytest.mark.process


def age_heartbeat(worker_id: str, seconds: float) -> None:
    Worker.objects.filter(pk=worker_id).update(heartbeat_at=Now() - timedelta(seconds=seconds))


def statuses() -> dict[str, str]:
    return {w["id"]: w["status"] for w in run_json("queue_status")["workers"]}


def test_a_killed_workers_row_is_gone_after_the_cutoff_and_pruned_after_retention(
    workers: WorkerPool,
) -> None:
    keeper = workers.start("keeper", env={"HOLDFAST_WORKER_RETENTION_SECONDS": "600"})
    victim = workers.start("victim")
    assert statuses() == {"keeper": "live", "victim": "live"}
    victim.kill()

    # Just inside the cutoff it is still live; past it, gone (and stale, the older field).
    stale_after = worker_liveness().stale_after
    age_heartbeat("victim", stale_after - 10)
    assert statuses()["victim"] == "live"
    age_heartbeat("victim", stale_after + 1)
    listed = {w["id"]: w for w in run_json("queue_status")["workers"]}
    assert (listed["victim"]["status"], listed["victim"]["stale"]) == ("gone", True)
    assert (listed["keeper"]["status"], listed["keeper"]["stale"]) == ("live", False)
    assert worker_health() | {"stale_after_s": None} == {
        "live": 1,
        "gone": 1,
        "stale": 1,
        "stale_after_s": None,
    }

    # Gone but within the retention: the keeper's passes (every second here) leave it.
    time.sleep(2.5)
    assert Worker.objects.filter(pk="victim").exists() and keeper.alive
    # Past the retention: pruned by the next pass, and the keeper's own row stays.
    age_heartbeat("victim", 601)
    wait_until(
        lambda: not Worker.objects.filter(pk="victim").exists(),
        15,
        interval=0.1,
        message=lambda: f"the gone worker's row was not pruned\n{keeper.describe()}",
    )
    assert keeper.events("workers_pruned")
    assert list(Worker.objects.values_list("pk", flat=True)) == ["keeper"]
    assert statuses() == {"keeper": "live"}
