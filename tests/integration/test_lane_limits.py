"""Lane ``max_running``: enforced at claim time, in the database, across all workers."""

import threading

import pytest
from django.db import connection
from django.test import override_settings

from jobs import engine
from jobs.models import Job, State

from .helpers import claim_one

LANES = {"default": {}, "limited": {"kinds": ["test.echo"], "max_running": 2}}

pytestmark = pytest.mark.django_db


@override_settings(HOLDFAST_LANES=LANES)
def test_a_full_lane_is_skipped_until_one_of_its_jobs_settles():
    engine.enqueue_many("test.echo", [{"n": i} for i in range(5)])
    other = engine.enqueue("test.noop")
    first, second = claim_one("a", ["limited"]), claim_one("b", ["limited"])
    assert engine.claim("c", ["limited"]) is None  # two running: the lane is full
    assert engine.claim("c").id == other.pk  # other lanes still run
    engine.complete(first)
    third = claim_one("c", ["limited"])
    assert third.lane == "limited"
    assert Job.objects.filter(lane="limited", state=State.RUNNING).count() == 2
    # Settling one job and claiming the next in one commit counts the settling job as
    # running (the count precedes the statement): conservative, never over the limit.
    limits = {"limited": 2}
    assert engine.settle_and_claim(second, engine.succeeded(), "b", ["limited"], limits) is None
    assert claim_one("b", ["limited"]).lane == "limited"
    assert Job.objects.filter(lane="limited", state=State.RUNNING).count() == 2


@override_settings(HOLDFAST_LANES=LANES)
def test_the_limit_holds_for_a_worker_serving_every_lane():
    engine.enqueue_many("test.echo", [{} for _ in range(4)])
    assert claim_one("w").lane == "limited"
    assert claim_one("w").lane == "limited"
    assert engine.claim("w") is None


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@override_settings(HOLDFAST_LANES=LANES)
def test_concurrent_claimers_never_exceed_the_limit():
    engine.enqueue_many("test.echo", [{} for _ in range(20)])
    claimed: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def claimer(name: str) -> None:
        try:
            start.wait()
            job = engine.claim(name, ["limited"])
            if job is not None:
                with lock:
                    claimed.append(job.id)
        finally:
            connection.close()

    threads = [threading.Thread(target=claimer, args=(f"t{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(claimed) == 2
    assert Job.objects.filter(state=State.RUNNING).count() == 2
