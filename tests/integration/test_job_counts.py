"""Jobs per lane and state: ``queue_status --json`` and the scrape's ``holdfast_jobs`` agree
exactly with ``SELECT lane, state, count(*) FROM jobs_job GROUP BY 1, 2``, finished states
included, after every kind of transition (jobs.counts); and neither scans the history."""

from __future__ import annotations

import importlib
import re
import threading
import uuid
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.apps import apps as django_apps
from django.db import connection, connections, transaction
from django.db.models import Count
from django.test import Client
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jobs import counts, engine, enqueueing, operations
from jobs.models import Job, JobCount, OutcomeCount, State
from jobs.sql import Claimed
from jobs.status import queue_status
from ops import metrics, tokens

from .helpers import claim_one, expire_lease, failure, run_json

pytestmark = pytest.mark.django_db

LANES = {"default": {}, "media": {}}
WEEK = timedelta(days=7)


def rows() -> dict[tuple[str, str], int]:
    """The truth: one scan of the jobs table."""
    return {
        (lane, state): n
        for lane, state, n in Job.objects.values_list("lane", "state")
        .annotate(n=Count("id"))
        .order_by()
    }


def scraped() -> dict[tuple[str, str], float]:
    _, secret = tokens.create(f"prometheus-{uuid.uuid4().hex[:8]}", "read")
    headers = {"Authorization": f"Bearer {secret}"}
    response = Client().get("/internal/v1/metrics/", headers=headers)
    assert response.status_code == 200
    found = {}
    for family in text_string_to_metric_families(response.content.decode()):
        if family.name == "holdfast_jobs":
            for sample in family.samples:
                if sample.value:
                    found[(sample.labels["lane"], sample.labels["state"])] = sample.value
    return found


def reported() -> dict[tuple[str, str], int]:
    """queue_status --json's lanes by states, and a check that its totals add up."""
    status = run_json("queue_status")
    found = {
        (lane, state): n
        for lane, figures in status["lanes"].items()
        for state, n in figures.items()
        if state in State.values and n
    }
    for state in State.values:
        assert status["totals"][state] == sum(n for (_, s), n in found.items() if s == state)
    assert status["dead"] == status["totals"]["dead"]
    return found


def finish_old(state: str) -> None:
    """Make the finished jobs of ``state`` old enough for a prune of a week."""
    Job.objects.filter(state=state).update(finished_at=engine.db_now() - 2 * WEEK)


def test_a_known_mix_is_counted_exactly(settings) -> None:
    settings.HOLDFAST_LANES = LANES
    for lane in ("default", "media"):
        enqueueing.enqueue("test.echo", lane=lane)
        engine.complete(claim_one(lanes=[lane]))  # succeeded
    enqueueing.enqueue("test.flaky", {"fail_times": 1})
    engine.fail(claim_one(), failure(), backoff_seconds=0)  # retried: still queued
    engine.complete(claim_one())  # then succeeded
    enqueueing.enqueue("test.fail", lane="media")
    engine.fail(claim_one(), failure(permanent=True), backoff_seconds=0)  # dead
    spent = enqueueing.enqueue("test.noop", max_attempts=1, lane="media")
    expire_lease(claim_one().id)
    assert engine.reclaim_expired() == [spent.pk]  # dead by reclaim
    queued = enqueueing.enqueue("test.noop")
    operations.cancel(queued.pk)  # cancelled while queued
    enqueueing.enqueue("test.noop", lane="media")
    running = claim_one()
    operations.cancel(running.id)
    engine.cancelled(running)  # cancelled on request
    old_dead = enqueueing.enqueue("test.fail")
    engine.fail(claim_one(), failure(permanent=True), backoff_seconds=0)
    finish_old(State.SUCCEEDED)
    Job.objects.filter(pk=old_dead.pk).update(finished_at=engine.db_now() - 2 * WEEK)
    enqueueing.enqueue("test.echo")
    engine.complete(claim_one())  # a fresh success the prune keeps
    assert operations.prune(WEEK, include_dead=True) == 4  # three old successes, one old death
    again = enqueueing.enqueue("test.fail")
    engine.fail(claim_one(), failure(permanent=True), backoff_seconds=0)
    assert operations.requeue_dead(list(operations.dead_jobs([again.pk]))) == [again.pk]  # requeued
    enqueueing.enqueue("test.echo", delay=3600)  # delayed: queued
    enqueueing.enqueue("test.noop")
    claim_one()  # running

    truth = rows()
    assert truth == {
        ("default", "cancelled"): 1,
        ("default", "queued"): 2,  # the delayed one, and the requeued one or the noop
        ("default", "running"): 1,
        ("default", "succeeded"): 1,
        ("media", "cancelled"): 1,
        ("media", "dead"): 2,
    }
    assert reported() == truth
    assert scraped() == truth
    assert counts.by_lane() == truth


STEPS = [
    "enqueue",
    "claim",
    "succeed",
    "retry",
    "die",
    "release",
    "cancel_running",
    "cancel_queued",
    "reclaim",
    "requeue",
    "prune",
    "prune_dead",
    "settle_and_claim",
]


@given(
    steps=st.lists(
        st.tuples(st.sampled_from(STEPS), st.sampled_from(["default", "media"])),
        min_size=5,
        max_size=40,
    )
)
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_any_sequence_of_transitions_keeps_the_counts_exact(steps, settings) -> None:
    settings.HOLDFAST_LANES = LANES
    with transaction.atomic():
        for step, lane in steps:
            apply(step, lane)
            assert counts.by_lane() == rows(), (step, lane)
        assert reported() == rows()
        assert scraped() == rows()
        transaction.set_rollback(True)


def apply(step: str, lane: str) -> None:
    """One transition in ``lane``; steps that need a job of some state make one first.
    Jobs in lane ``media`` have one attempt, so a reclaim sends them straight to dead."""
    attempts = 1 if lane == "media" else 2
    if step == "enqueue":
        enqueueing.enqueue("test.noop", lane=lane, max_attempts=attempts)
    elif step == "cancel_queued":
        if job := Job.objects.filter(lane=lane, state=State.QUEUED).first():
            operations.cancel(job.pk)
    elif step == "reclaim":
        Job.objects.filter(state=State.RUNNING, lane=lane).update(
            lease_expires_at=engine.db_now() - timedelta(minutes=5)
        )
        engine.reclaim_expired()
    elif step == "requeue":
        operations.requeue_dead(list(operations.dead_jobs(lane=lane)))
    elif step in ("prune", "prune_dead"):
        Job.objects.filter(lane=lane, finished_at__isnull=False).update(
            finished_at=engine.db_now() - 2 * WEEK
        )
        operations.prune(WEEK, include_dead=step == "prune_dead", batch=2)
    else:
        job = engine.claim("w1", [lane])
        if job is None:
            enqueueing.enqueue("test.noop", lane=lane, max_attempts=attempts)
            job = claim_one(lanes=[lane])
        settle(step, job, lane)


def settle(step: str, job: Claimed, lane: str) -> None:
    if step == "succeed":
        engine.complete(job)
    elif step == "retry":
        engine.fail(job, failure(), backoff_seconds=0)  # dead once its attempts are spent
    elif step == "die":
        engine.fail(job, failure(permanent=True), backoff_seconds=0)
    elif step == "release":
        engine.release(job)
    elif step == "cancel_running":
        operations.cancel(job.id)
        engine.cancelled(job)
    elif step == "settle_and_claim":
        engine.settle_and_claim(job, engine.succeeded(), "w1", [lane])
    # "claim": it stays running


def test_recount_rebuilds_counts_put_apart_around_the_engine() -> None:
    for _ in range(3):
        enqueueing.enqueue("test.echo")
        engine.complete(claim_one())
    Job.objects.filter(state=State.SUCCEEDED).update(state=State.DEAD)  # SQL by hand
    assert counts.by_lane() != rows()
    assert run_json("recount_jobs") == {"lanes": {"default": {"dead": 3}}}
    assert counts.by_lane() == rows()
    # the attempts' own counts stay (they are the metrics too): the rest is a correction
    assert sorted(JobCount.objects.values_list("state", "count")) == [
        ("dead", 3),
        ("succeeded", -3),
    ]


def test_the_migration_counts_the_jobs_already_there() -> None:
    for _ in range(2):
        enqueueing.enqueue("test.echo")
        engine.complete(claim_one())
    enqueueing.enqueue("test.noop")
    engine.fail(claim_one(), failure(permanent=True), backoff_seconds=0)
    JobCount.objects.all().delete()  # as before the migration (and before 0007's table)
    OutcomeCount.objects.all().delete()
    migration = importlib.import_module("jobs.migrations.0005_i15_job_counts")
    editor = SimpleNamespace(connection=connection)  # all the data step uses of one
    migration.count_finished_jobs(django_apps, editor)
    assert counts.by_lane() == rows() == {("default", "succeeded"): 2, ("default", "dead"): 1}


@pytest.mark.postgres
def test_neither_queue_status_nor_a_scrape_scans_the_jobs_table() -> None:
    """Every query the two make on jobs_job goes through an index that skips the finished
    rows (the planner is told to avoid sequential scans, as it would on a big table)."""
    for _ in range(3):
        enqueueing.enqueue("test.echo")
        engine.complete(claim_one())
    enqueueing.enqueue("test.echo", delay=60)
    with CaptureQueriesContext(connection) as captured:
        queue_status()
        scraped()
    on_jobs = [q["sql"] for q in captured if "jobs_job" in q["sql"] and "SELECT" in q["sql"]]
    assert on_jobs
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
        try:
            for query in on_jobs:
                if query.lstrip().startswith("SELECT") and '"jobs_job"' in query:
                    cursor.execute(f"EXPLAIN {query}")
                    plan = "\n".join(line for (line,) in cursor.fetchall())
                    assert not re.search(r"Seq Scan on jobs_job\b", plan), (query, plan)
        finally:
            cursor.execute("RESET enable_seqscan")


def test_the_one_counter_migration_keeps_every_attempt_count() -> None:
    """0010 moves jobs_attemptcount's rows into jobs_outcomecount as rows of no lane and
    no state: the metrics keep their totals, the finished jobs' counts do not double."""
    enqueueing.enqueue("test.echo")
    engine.complete(claim_one())  # one attempt counted the new way
    before = counts.by_lane()
    with connection.cursor() as cursor:  # the old table, as 0003 made it
        cursor.execute(
            "CREATE TABLE jobs_attemptcount (kind varchar(200), outcome varchar(16),"
            " bucket smallint, shard smallint, count bigint, seconds double precision)"
        )
        cursor.execute(
            "INSERT INTO jobs_attemptcount VALUES ('test.echo', 'succeeded', 3, 0, 5, 1.5),"
            " ('test.echo', 'succeeded', 3, 1, 2, 0.5), ('test.fail', 'failed', 0, 0, 4, 0.2)"
        )
    migration = importlib.import_module("jobs.migrations.0010_i16_one_attempt_counter")
    migration.fold_counts(django_apps, SimpleNamespace(execute=connection.cursor().execute))
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE jobs_attemptcount")
    folded = OutcomeCount.objects.filter(lane="", state="")
    assert sorted(folded.values_list("kind", "outcome", "shard", "count")) == [
        ("test.echo", "succeeded", 0, 5),
        ("test.echo", "succeeded", 1, 2),
        ("test.fail", "failed", 0, 4),
    ]
    assert counts.by_lane() == before  # finished jobs: still what the rows hold
    scraped = {
        (s.labels["kind"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry()).decode())
        for s in family.samples
        if s.name == "holdfast_job_attempts_total"
    }
    assert scraped[("test.echo", "succeeded")] == 8  # 5 + 2 folded, 1 since
    assert scraped[("test.fail", "failed")] == 4


@pytest.mark.django_db(transaction=True)
def test_the_counts_are_read_in_one_snapshot(monkeypatch):
    """A job settling while the counts are read is counted once: the running rows and the
    finished counts were three statements apart, and the job was both (audit)."""
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    original = counts.ended_attempts

    def settle_meanwhile():
        worker = threading.Thread(target=_complete_and_close, args=(claimed,))
        worker.start()
        worker.join()
        return original()

    monkeypatch.setattr(counts, "ended_attempts", settle_meanwhile)
    assert counts.by_lane() == {("default", "succeeded"): 1}


def _complete_and_close(claimed):
    try:
        engine.complete(claimed)
    finally:
        connections.close_all()
