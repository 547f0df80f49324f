"""The worker registry's retention (workers.prune_workers): bounded, and only rows whose
last heartbeat is older than the retention, stopped or not."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models.functions import Now

from jobs import engine, workers
from jobs.models import Worker
from jobs.status import GONE, LIVE, worker_liveness

pytestmark = pytest.mark.django_db


def worker(name: str, age_s: float, stopped: bool = False) -> None:
    Worker.objects.create(id=name, host="h", pid=1)
    Worker.objects.filter(pk=name).update(
        heartbeat_at=Now() - timedelta(seconds=age_s), stopped_at=Now() if stopped else None
    )


def test_pruning_takes_only_rows_past_the_retention_a_batch_at_a_time(settings):
    settings.HOLDFAST_WORKER_RETENTION_SECONDS = 3600
    for n in range(5):
        worker(f"old-{n}", 7200 + n, stopped=n % 2 == 0)
    worker("gone-recently", 600)
    worker("live", 0)
    assert workers.prune_workers(batch=2) == 2
    assert workers.prune_workers() == 3
    assert workers.prune_workers() == 0
    assert sorted(Worker.objects.values_list("pk", flat=True)) == ["gone-recently", "live"]


def test_one_rule_says_live_or_gone(settings):
    settings.HOLDFAST_LEASE_SECONDS = 10  # the floor is 30 s
    liveness = worker_liveness()
    assert liveness.stale_after == 30
    now = engine.db_now()
    assert liveness.status(now - timedelta(seconds=29)) == LIVE
    assert liveness.status(now - timedelta(seconds=31)) == GONE
