"""``GET /internal/v1/metrics/``: Prometheus text format from the database (DESIGN §9).

The scrape is parsed with prometheus_client's own parser and compared with the rows;
the counters are checked to survive pruning and a fresh collector (a new API process).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.db.models import Sum
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from jobs import engine, enqueueing, operations
from jobs.models import Job, OutcomeCount, State, Worker
from ops import metrics, tokens

from .helpers import claim_one, expire_lease, failure

pytestmark = pytest.mark.django_db

URL = "/internal/v1/metrics/"
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


def scrape(token: str, accept: str = "text/plain") -> dict[str, dict[tuple, float]]:
    response = Client().get(URL, headers={"Authorization": f"Bearer {token}", "Accept": accept})
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            key = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[key] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


@pytest.fixture
def read_token() -> str:
    return tokens.create("prometheus", "read")[1]


def known_mix() -> None:
    """2 succeeded echo jobs, 1 dead fail job (3 failed attempts), 1 job retried once, one
    reclaimed attempt, 1 runnable and 1 delayed queued job, 1 running job."""
    for _ in range(2):
        enqueueing.enqueue("test.echo")
        engine.complete(claim_one(), {"ok": True})
    enqueueing.enqueue("test.fail")
    for _ in range(3):
        engine.fail(claim_one(), failure(), backoff_seconds=0)
    enqueueing.enqueue("test.flaky", {"fail_times": 1})
    engine.fail(claim_one(), failure(), backoff_seconds=0)
    engine.complete(claim_one(), None)
    lost = enqueueing.enqueue("test.noop")
    expire_lease(claim_one().id)
    assert engine.reclaim_expired() == [lost.pk]
    engine.complete(claim_one(), None)
    enqueueing.enqueue("test.echo", lane="default")  # runnable
    enqueueing.enqueue("test.echo", delay=3600)  # delayed: counted as queued
    enqueueing.enqueue("test.noop")
    claim_one()  # running
    enqueueing.enqueue("test.echo")  # runnable, behind the claimed one


def test_a_scrape_matches_the_database(settings, tmp_path: Path, read_token, monkeypatch):
    from ingestion import spool

    settings.HOLDFAST_SPOOL_DIR = tmp_path / "spool"
    (tmp_path / "spool" / "incoming").mkdir(parents=True)
    (tmp_path / "spool" / "failed").mkdir()
    (tmp_path / "spool" / "incoming" / "a.json").write_text("{}")
    (tmp_path / "spool" / "failed" / "b.json").write_text("{}")
    (tmp_path / "spool" / "failed" / "b.json.reason.json").write_text("{}")
    known_mix()
    Worker.objects.create(id="live-1", host="h", pid=1)
    Worker.objects.create(id="gone-1", host="h", pid=2)
    Worker.objects.filter(pk="gone-1").update(heartbeat_at=timezone.now() - timedelta(hours=1))

    # Ages count from a file's arrival (ctime), as the grace alert does: move the clock.
    monkeypatch.setattr(spool, "wall_clock", lambda: time.time() + 90)
    samples = scrape(read_token)

    for state in State:
        expected = Job.objects.filter(lane="default", state=state).count()
        assert value(samples, "holdfast_jobs", lane="default", state=state) == expected
    assert value(samples, "holdfast_jobs", lane="default", state="queued") == 3
    assert value(samples, "holdfast_jobs", lane="default", state="running") == 1
    assert value(samples, "holdfast_jobs", lane="default", state="dead") == 1
    assert value(samples, "holdfast_queue_oldest_age_seconds", lane="default") >= 0
    assert value(samples, "holdfast_workers", status="live") == 1
    assert value(samples, "holdfast_workers", status="gone") == 1
    attempts = "holdfast_job_attempts_total"
    assert value(samples, attempts, kind="test.echo", outcome="succeeded") == 2
    assert value(samples, attempts, kind="test.fail", outcome="failed") == 3
    assert value(samples, attempts, kind="test.flaky", outcome="failed") == 1
    assert value(samples, attempts, kind="test.flaky", outcome="succeeded") == 1
    assert value(samples, attempts, kind="test.noop", outcome="lease_expired") == 1
    assert value(samples, attempts, kind="test.noop", outcome="succeeded") == 1
    # The histogram: every timed attempt in the +Inf bucket, buckets cumulative.
    count = "holdfast_job_duration_seconds_count"
    assert value(samples, count, kind="test.fail") == 3
    assert value(samples, count, kind="test.noop") == 1  # the expired attempt is not timed
    inf = value(samples, "holdfast_job_duration_seconds_bucket", kind="test.echo", le="+Inf")
    assert inf == 2
    echo_buckets = [
        v
        for labels, v in samples["holdfast_job_duration_seconds_bucket"].items()
        if dict(labels)["kind"] == "test.echo"
    ]
    assert echo_buckets == sorted(echo_buckets)
    assert value(samples, "holdfast_spool_files", state="incoming") == 1
    assert value(samples, "holdfast_spool_files", state="failed") == 1
    assert 89 <= value(samples, "holdfast_spool_oldest_age_seconds") <= 120


def test_the_scrape_exports_exactly_the_documented_metrics(read_token):
    known_mix()
    response = Client().get(URL, headers={"Authorization": f"Bearer {read_token}"})
    families = {family.name for family in text_string_to_metric_families(response.text)}
    assert families == {name.removesuffix("_total") for name in metrics.METRIC_NAMES}


def test_prometheus_accept_header_gets_openmetrics(read_token):
    response = Client().get(
        URL, headers={"Authorization": f"Bearer {read_token}", "Accept": PROMETHEUS_ACCEPT}
    )
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/openmetrics-text")
    assert response.content.decode().rstrip().endswith("# EOF")


def test_metrics_need_a_token_and_answer_json_errors():
    response = Client().get(URL, headers={"Accept": "text/plain"})
    assert response.status_code == 401
    assert response["Content-Type"] == "application/json"
    assert response.json()["code"] == "not_authenticated"


def test_refused_tokens_are_counted_by_reason(read_token):
    """Refused logins reach the metrics, not only the logs (audit): any API process
    reports the same counts, from the database."""
    _, revoked = tokens.create("gone", "read")
    tokens.revoke("gone")
    for header in ["Bearer nope", "Bearer nope", f"Bearer {revoked}", "Basic eDp5", None]:
        headers = {"Authorization": header} if header else {}
        assert Client().get("/internal/v1/queue/", headers=headers).status_code == 401
    refused = scrape(read_token)["holdfast_api_auth_refusals_total"]
    assert refused == {
        (("reason", "malformed"),): 2,
        (("reason", "revoked"),): 1,
        (("reason", "not a bearer token"),): 1,
        (("reason", "no token"),): 1,
    }


def test_a_refusal_the_database_cannot_count_is_still_a_401(monkeypatch):
    """A new API process before ``migrate`` (no table yet), or a database refusing the
    write: the count is skipped and said, the answer stays a 401."""
    from ops.models import AuthRefusal

    monkeypatch.setattr(AuthRefusal._meta, "db_table", "ops_no_such_table")
    with capture_logs() as logs:
        response = Client().get("/internal/v1/queue/", headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401
    events = [entry["event"] for entry in logs]
    assert "auth_refusal_not_counted" in events and "api_auth_failed" in events


def test_counters_survive_pruning_and_a_fresh_collector(read_token):
    known_mix()
    before = scrape(read_token)["holdfast_job_attempts_total"]
    Job.objects.filter(state=State.RUNNING).update(state=State.SUCCEEDED)  # let it go too
    Job.objects.filter(state=State.SUCCEEDED).update(finished_at=timezone.now())
    assert operations.prune(timedelta(seconds=-60), include_dead=True) > 0
    assert not Job.objects.exclude(state=State.QUEUED).exists()
    after = scrape(read_token)["holdfast_job_attempts_total"]  # each scrape: a new registry
    assert after == before
    assert OutcomeCount.objects.aggregate(n=Sum("count"))["n"] == sum(before.values())


def test_a_schedule_behind_its_slot_shows_its_lag(read_token):
    from jobs.models import Schedule

    Schedule.objects.create(
        name="nightly", kind="test.noop", every=60, next_due_at=timezone.now() - timedelta(hours=1)
    )
    lag = value(scrape(read_token), "holdfast_schedule_lag_seconds", schedule="nightly")
    assert 3500 < lag < 3700


@pytest.mark.postgres
def test_a_scrape_never_reads_the_finished_history():
    """The gauges' queries go through indexes that skip finished rows, and finished jobs are
    read from their counts (the planner is told to avoid sequential scans, as it would on
    a big table)."""
    from django.db import connection

    from jobs.counts import active, ended_attempts, other_transitions
    from ops.metrics import oldest_runnable

    for _ in range(3):
        enqueueing.enqueue("test.echo")
        engine.complete(claim_one(), None)
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
    try:
        plans = [
            active().explain(),
            oldest_runnable(timezone.now()).explain(),
            ended_attempts().explain(),
            other_transitions().explain(),
        ]
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET enable_seqscan")
    for plan in plans:
        assert "Seq Scan on jobs_job " not in plan, plan
    assert "job_state_idx" in plans[0], plans[0]
    # An index of queued rows (the claim's) or the state index.
    assert any(name in plans[1] for name in ("job_state_idx", "job_runnable_idx"))
