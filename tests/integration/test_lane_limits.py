"""Lane ``max_running``: enforced at claim time, in the database, across all workers."""

import threading
import time
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.test import override_settings

from jobs import engine, enqueueing
from jobs.models import Job, State

from .helpers import claim_one

LANES = {"default": {}, "limited": {"kinds": ["test.echo"], "max_running": 2}}

pytestmark = pytest.mark.django_db


@override_settings(HOLDFAST_LANES=LANES)
def test_a_full_lane_is_skipped_until_one_of_its_jobs_settles():
    enqueueing.enqueue_many("test.echo", [{"n": i} for i in range(5)])
    other = enqueueing.enqueue("test.noop")
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
    enqueueing.enqueue_many("test.echo", [{} for _ in range(4)])
    assert claim_one("w").lane == "limited"
    assert claim_one("w").lane == "limited"
    assert engine.claim("w") is None


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@override_settings(HOLDFAST_LANES=LANES)
def test_concurrent_claimers_never_exceed_the_limit():
    enqueueing.enqueue_many("test.echo", [{} for _ in range(20)])
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


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@override_settings(
    HOLDFAST_LANES={"default": {}, "limited": {"kinds": ["test.echo"], "max_running": 1}}
)
def test_an_unlimited_lane_claim_never_waits_on_a_limited_lane():
    """A claim of a limited lane's job holds that lane's slot until it commits; a worker
    serving every lane meanwhile claims the default lane's job without waiting (no lane
    lock), and the limited lane's next job is not claimed past the limit."""
    enqueueing.enqueue_many("test.echo", [{"n": i} for i in range(3)])
    other = enqueueing.enqueue("test.noop", priority=5)
    holding, done = threading.Event(), threading.Event()
    held: list[int] = []

    def holder() -> None:
        try:
            with transaction.atomic():  # the claim's slot row stays uncommitted
                held.append(claim_one("holder", ["limited"]).id)
                holding.set()
                done.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert holding.wait(10)
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '300ms'")
            start = time.monotonic()
            job = engine.claim("all-lanes")
            waited = time.monotonic() - start
        assert job is not None and job.id == other.pk
        assert waited < 0.3
    finally:
        done.set()
        thread.join()
    assert len(held) == 1
    assert engine.claim("all-lanes") is None  # the limited lane is full (max_running=1)
    assert Job.objects.filter(lane="limited", state=State.RUNNING).count() == 1


@pytest.mark.parametrize(
    "lanes",
    [
        {"default": {}, "q": {"max_queued": "10"}},  # every enqueue was a TypeError
        {"default": {}, "q": {"kinds": "photo.*"}},  # every job went to "q"
        {"default": {}, "q": "10"},  # an AttributeError
    ],
)
def test_a_bad_lane_setting_makes_enqueue_bad_input_naming_the_lane(lanes):
    with override_settings(HOLDFAST_LANES=lanes):
        for extra in (["--lane", "q"], []):
            with pytest.raises(CommandError) as raised:
                call_command("enqueue", "test.echo", *extra, stdout=StringIO())
            assert raised.value.returncode == 2 and "lane 'q'" in str(raised.value)
    assert Job.objects.count() == 0
