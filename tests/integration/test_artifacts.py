"""Fetching artifacts from a real HTTP site on 127.0.0.1, refreshing them, and the commands.

Each fetch runs as a real ``ingestion.fetch_artifact`` job in an in-process burst worker,
so retries, dead jobs and fenced writes are the engine's own.
"""

from __future__ import annotations

import errno
import hashlib
import tracemalloc
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.core.management import CommandError
from django.db.models import F
from django.utils import timezone
from structlog.testing import capture_logs

from demo.site import FixtureSite
from ingestion import artifacts as artifacts_module
from ingestion import blobs
from ingestion.artifacts import FETCH_KIND, enqueue_fetches
from ingestion.models import Artifact, IssueKind, ReconciliationIssue, Source
from ingestion.search import INDEX_ARTIFACT
from jobs import enqueue, refresh
from jobs.models import Job, State

from .helpers import exit_code, run, run_json

DOC = "/docs/a.html"

pytestmark = pytest.mark.usefixtures("blob_dir")


@pytest.fixture
def site() -> Iterator[FixtureSite]:
    with FixtureSite(slow_seconds=3.0) as site:
        site.add(DOC, "A", "first text")
        yield site


@pytest.fixture
def source(site: FixtureSite, transactional_db: None) -> Source:
    return make_source(site, "local")


def make_source(site: FixtureSite, name: str, **fields: object) -> Source:
    return Source.objects.create(
        allow_private=True,
        name=name,
        kind="sitemap",
        url=site.url("/sitemap.xml"),
        schedule="0 3 * * *",
        spacing_seconds=0,
        **fields,
    )


def artifact_at(source: Source, path: str) -> Artifact:
    return Artifact.objects.create(source=source, url=source.url.replace("/sitemap.xml", path))


def fetch(run_worker, artifact: Artifact) -> Job:
    """Enqueue a fetch of ``artifact``, run the worker until idle; the fetch job, reloaded."""
    [artifact_id] = enqueue_fetches(Artifact.objects.filter(pk=artifact.pk))
    run_worker()
    artifact.refresh_from_db()
    return Job.objects.filter(kind=FETCH_KIND, args__artifact_id=artifact_id).latest("pk")


def issues_of(artifact: Artifact, kind: str) -> list[ReconciliationIssue]:
    return list(ReconciliationIssue.objects.filter(kind=kind, subject=artifact.url).order_by("pk"))


def index_jobs(artifact: Artifact) -> list[Job]:
    return list(Job.objects.filter(kind=INDEX_ARTIFACT, args__artifact_id=artifact.pk))


# --- fetching --------------------------------------------------------------------------


@pytest.mark.parametrize("refresh_days", [28, 3])
def test_a_fetch_stores_the_body_by_sha256_with_its_metadata(site, run_worker, refresh_days):
    source = make_source(site, "local", refresh_days=refresh_days)
    artifact = artifact_at(source, DOC)
    job = fetch(run_worker, artifact)

    document = site.documents[DOC]
    digest = hashlib.sha256(document.body).hexdigest()
    assert job.state == State.SUCCEEDED
    assert job.result["outcome"] == "stored"
    assert (artifact.state, artifact.sha256, artifact.size) == (
        "fetched",
        digest,
        len(document.body),
    )
    assert blobs.read(digest) == document.body
    assert artifact.http_status == 200
    assert artifact.content_type.startswith("text/html")
    assert artifact.etag == document.etag
    assert artifact.last_modified.endswith("GMT")
    assert artifact.refresh_after - artifact.fetched_at == timedelta(days=refresh_days)
    [index] = index_jobs(artifact)
    assert index.unique_key == f"index:{artifact.pk}:{digest}"
    assert index.args == {"artifact_id": artifact.pk}


def test_a_second_fetch_is_conditional_and_a_304_only_moves_the_refresh_clock(
    site, source, run_worker
):
    artifact = artifact_at(source, DOC)
    fetch(run_worker, artifact)
    Artifact.objects.filter(pk=artifact.pk).update(
        fetched_at=F("fetched_at") - timedelta(days=1),
        refresh_after=F("refresh_after") - timedelta(days=1),
    )
    artifact.refresh_from_db()
    before = artifact

    job = fetch(run_worker, Artifact.objects.get(pk=artifact.pk))
    after = Artifact.objects.get(pk=artifact.pk)
    last_request = site.requests_to(DOC)[-1]
    assert last_request.headers["if-none-match"] == before.etag
    assert last_request.headers["if-modified-since"] == before.last_modified
    assert job.result["outcome"] == "unchanged"
    assert after.http_status == 304
    assert after.refresh_after > before.refresh_after
    assert after.fetched_at > before.fetched_at
    assert after.refresh_after - after.fetched_at == timedelta(days=28)
    unchanged = ("sha256", "size", "etag", "last_modified", "content_type", "state")
    assert [getattr(after, f) for f in unchanged] == [getattr(before, f) for f in unchanged]
    assert len(index_jobs(artifact)) == 1  # no re-indexing of the same body


def test_a_changed_body_gets_a_new_hash_and_is_indexed_again(site, source, run_worker):
    artifact = artifact_at(source, DOC)
    fetch(run_worker, artifact)
    first = artifact.sha256
    site.change(DOC, "second text")

    job = fetch(run_worker, artifact)
    assert job.result["outcome"] == "stored"
    assert artifact.sha256 == hashlib.sha256(site.documents[DOC].body).hexdigest() != first
    assert blobs.exists(first) and blobs.exists(artifact.sha256)
    keys = sorted(job.unique_key for job in index_jobs(artifact))
    assert keys == sorted(
        [f"index:{artifact.pk}:{first}", f"index:{artifact.pk}:{artifact.sha256}"]
    )
    assert not ReconciliationIssue.objects.exists()  # nothing listed a lastmod: no verdict


@pytest.mark.parametrize("on_full", ["drop", "reject"])
def test_a_body_a_full_index_lane_leaves_unindexed_is_fetched_again_soon(
    site, source, run_worker, settings, on_full
):
    """Refused (LaneFull), the index job rolled the fetch back: the body was downloaded
    again attempt after attempt. Dropped, the new body went unindexed until the next
    refresh, weeks later. Now the fetch commits and is due again in an hour, and that
    fetch (a 304) enqueues the index job (audit)."""
    artifact = artifact_at(source, DOC)
    index_lane = {"kinds": [INDEX_ARTIFACT], "max_queued": 1, "on_full": on_full}
    settings.HOLDFAST_LANES = {"default": {}, "index": index_lane}
    filler = enqueue(INDEX_ARTIFACT, {"artifact_id": 10**9}, delay=3600)
    job = fetch(run_worker, artifact)
    assert (job.state, job.attempts, job.result["outcome"]) == (State.SUCCEEDED, 1, "stored")
    assert artifact.sha256 and artifact.indexed_sha256 == "" and index_jobs(artifact) == []
    due_in = artifact.refresh_after - timezone.now()
    assert timedelta(minutes=59) < due_in <= artifacts_module.INDEX_RETRY
    assert len(site.requests_to(DOC)) == 1

    Job.objects.filter(pk=filler.pk).delete()  # the lane has room again
    Artifact.objects.filter(pk=artifact.pk).update(refresh_after=timezone.now())
    assert artifacts_module.refresh_due(10) == 1
    run_worker()
    artifact.refresh_from_db()
    assert artifact.indexed_sha256 == artifact.sha256
    assert [job.state for job in index_jobs(artifact)] == [State.SUCCEEDED]


@pytest.mark.parametrize("status", [404, 410])
def test_404_and_410_mark_the_artifact_gone_with_one_issue(source, run_worker, status):
    artifact = artifact_at(source, f"/status/{status}")
    job = fetch(run_worker, artifact)
    assert job.state == State.SUCCEEDED  # the source answered; nothing to retry
    assert (artifact.state, artifact.http_status, artifact.refresh_after) == ("gone", status, None)
    [issue] = issues_of(artifact, IssueKind.GONE_AT_SOURCE)
    assert issue.status == "open" and issue.source == "local"
    assert issue.details["http_status"] == status
    assert issue.details["job_id"] == job.pk
    assert issue.details["artifact_id"] == artifact.pk

    fetch(run_worker, artifact)  # still gone: the same issue stays open, no second one
    assert len(issues_of(artifact, IssueKind.GONE_AT_SOURCE)) == 1


def test_a_500_is_retried_with_backoff(source, run_worker):
    artifact = artifact_at(source, "/status/500")
    job = fetch(run_worker, artifact)
    assert (job.state, job.attempts) == (State.QUEUED, 1)
    assert job.run_at > timezone.now()
    assert "answered HTTP 500" in job.last_error
    assert artifact.state == "discovered"
    assert "answered HTTP 500" in artifact.last_error  # for list_artifacts
    assert not ReconciliationIssue.objects.exists()


def test_the_last_attempt_at_a_transient_failure_puts_the_fetch_off_with_an_issue(
    source, run_worker
):
    artifact = artifact_at(source, "/status/503")
    enqueue(FETCH_KIND, {"artifact_id": artifact.pk}, max_attempts=1)
    run_worker()
    job = Job.objects.get(kind=FETCH_KIND)
    artifact.refresh_from_db()
    assert job.state == State.SUCCEEDED and job.result["outcome"] == "failing"
    assert (artifact.state, artifact.failures) == ("discovered", 1)
    assert timedelta(minutes=55) < artifact.refresh_after - timezone.now() < timedelta(hours=1)
    [issue] = issues_of(artifact, IssueKind.FETCH_FAILING)
    assert issue.details["reason"].startswith("RetryableStatus")
    assert issue.details["http_status"] == 503
    assert not issues_of(artifact, IssueKind.PERMANENT_FETCH_FAILURE)


def _raw_answer(head: bytes, body: bytes):
    """A reply written byte for byte: ``head`` (status line and headers), then ``body``."""

    def answer(handler) -> None:
        handler.wfile.write(head + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    return answer


@pytest.mark.parametrize("header", [b'ETag: "caf\xc3\xa9"', b"Last-Modified: Mon, 01 Jan 2024\xa0"])
def test_a_validator_that_cannot_be_sent_back_is_not_kept(site, source, run_worker, header):
    """httpx reads a non-ASCII header value, but cannot send it: kept as the next
    conditional GET's validator, it failed every later refresh of the artifact (audit)."""
    site.raw["/odd"] = _raw_answer(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n" + header, b"hello"
    )
    artifact = artifact_at(source, "/odd")
    assert fetch(run_worker, artifact).state == State.SUCCEEDED
    assert (artifact.etag, artifact.last_modified) == ("", "")
    # One stored by an earlier version is not sent either: the refresh is a plain GET.
    Artifact.objects.filter(pk=artifact.pk).update(etag='"caf\xe9"', last_modified="\xa0")
    artifact.refresh_from_db()
    assert artifacts_module.conditional_headers(artifact) == {}
    assert fetch(run_worker, artifact).state == State.SUCCEEDED


def _disk_full(target: object, data: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_blob_store_is_transient_and_the_last_attempt_puts_the_fetch_off(
    source, run_worker, monkeypatch
):
    """The blob store's disk is full: ours, and transient. It used to kill the job on the
    last attempt and leave a new artifact with nothing scheduled, never fetched (audit)."""
    monkeypatch.setattr(blobs, "write_durably", _disk_full)
    artifact = artifact_at(source, DOC)
    first = fetch(run_worker, artifact)
    assert (first.state, first.attempts) == (State.QUEUED, 1)  # retried, with backoff
    assert "No space left on device" in first.last_error
    Job.objects.filter(pk=first.pk).delete()
    enqueue(FETCH_KIND, {"artifact_id": artifact.pk}, max_attempts=1)
    run_worker()
    last = Job.objects.filter(kind=FETCH_KIND).latest("pk")
    artifact.refresh_from_db()
    assert last.state == State.SUCCEEDED and last.result["outcome"] == "failing"
    assert artifact.failures == 1 and artifact.refresh_after is not None
    assert artifacts_module.stale().filter(pk=artifact.pk).count() == 0  # due in an hour
    [issue] = issues_of(artifact, IssueKind.FETCH_FAILING)
    assert "No space left on device" in issue.details["reason"]


@pytest.mark.parametrize("status", [204, 206])
def test_a_2xx_without_the_whole_body_never_replaces_a_good_one(site, source, run_worker, status):
    artifact = artifact_at(source, DOC)
    assert fetch(run_worker, artifact).state == State.SUCCEEDED
    good = artifact.sha256
    site.replies[DOC] = (status, "text/plain", b"" if status == 204 else b"<h")
    job = fetch(run_worker, artifact)
    assert job.state == State.DEAD and f"HTTP {status}" in job.last_error
    assert (artifact.state, artifact.sha256) == ("fetched", good)


@pytest.mark.parametrize("status", [429, 503])
def test_a_long_retry_after_puts_the_fetch_off_until_then(site, source, run_worker, status):
    """Retry-After: 3600 is honoured: one request, then nothing until the hour is over
    (eight retries within ten minutes hammered a site asking for a pause)."""
    site.replies["/busy"] = (status, "text/plain", b"busy\n", {"Retry-After": "3600"})
    artifact = artifact_at(source, "/busy")
    with capture_logs() as logs:
        job = fetch(run_worker, artifact)
    assert (job.state, job.attempts) == (State.SUCCEEDED, 1)
    assert job.result["outcome"] == "deferred" and job.result["retry_after"] == 3600
    # Its log line is written (the call raised TypeError: artifact_id passed twice).
    [line] = [e for e in logs if e["event"] == "artifact_fetch_deferred"]
    assert (line["artifact_id"], line["retry_after"]) == (artifact.pk, 3600)
    assert not [e for e in logs if e["event"] == "handler_raised_after_complete"]
    assert len(site.requests_to("/busy")) == 1
    assert timedelta(minutes=59) < artifact.refresh_after - timezone.now() <= timedelta(hours=1)
    assert "Retry-After" in artifact.last_error
    assert artifact.state == "discovered" and not ReconciliationIssue.objects.exists()


def test_a_site_that_asks_for_a_pause_every_time_gets_an_issue(site, source, run_worker):
    """Each long Retry-After put the fetch off a day at most, for ever, and nothing said
    so. From the third in a row a fetch_failing issue does; a fetch that succeeds ends
    the count and resolves it."""
    site.replies["/busy"] = (503, "text/plain", b"busy\n", {"Retry-After": "86400"})
    artifact = artifact_at(source, "/busy")
    for deferrals in (1, 2, 3, 4):
        assert fetch(run_worker, artifact).result["outcome"] == "deferred"
        assert artifact.failures == deferrals
        issues = issues_of(artifact, IssueKind.FETCH_FAILING)
        assert len(issues) == (0 if deferrals < 3 else 1)
    [issue] = issues
    assert "Retry-After" in issue.details["reason"] and issue.details["deferrals"] == 3
    site.replies["/busy"] = (200, "text/plain", b"back\n", {})
    assert fetch(run_worker, artifact).result["outcome"] != "deferred"
    assert artifact.failures == 0
    issue.refresh_from_db()
    assert issue.status == "resolved"


def test_a_short_retry_after_holds_the_sources_next_request(site, source, run_worker):
    site.replies["/busy"] = (429, "text/plain", b"busy\n", {"Retry-After": "30"})
    artifact = artifact_at(source, "/busy")
    job = fetch(run_worker, artifact)
    assert (job.state, job.attempts) == (State.QUEUED, 1)  # the engine retries it
    source.refresh_from_db()
    assert timedelta(seconds=25) < source.next_request_at - timezone.now() <= timedelta(seconds=30)


def test_a_403_is_permanent_dead_job_and_an_issue(source, run_worker):
    artifact = artifact_at(source, "/status/403")
    job = fetch(run_worker, artifact)
    assert (job.state, job.attempts) == (State.DEAD, 1)
    assert (artifact.state, artifact.http_status) == ("failed", 403)
    [issue] = issues_of(artifact, IssueKind.PERMANENT_FETCH_FAILURE)
    assert issue.details["http_status"] == 403
    assert issue.details["job_id"] == job.pk


def test_an_oversized_body_fails_the_artifact_with_an_issue(source, run_worker, settings):
    settings.HOLDFAST_FETCH_MAX_BYTES = 1000
    artifact = artifact_at(source, "/huge")
    job = fetch(run_worker, artifact)
    assert job.state == State.DEAD
    assert artifact.state == "failed"
    assert "TooLarge" in artifact.last_error
    [issue] = issues_of(artifact, IssueKind.PERMANENT_FETCH_FAILURE)
    assert issue.details["error"] == "TooLarge"


def test_a_slow_answer_is_a_transient_failure(source, run_worker, settings):
    settings.HOLDFAST_FETCH_TIMEOUT_SECONDS = 0.5
    artifact = artifact_at(source, "/slow")
    job = fetch(run_worker, artifact)
    assert (job.state, job.attempts) == (State.QUEUED, 1)
    assert "timed out" in job.last_error
    assert artifact.state == "discovered"
    assert not ReconciliationIssue.objects.exists()


# --- refreshing ------------------------------------------------------------------------


def artifacts_refresher() -> refresh.Refresher:
    [found] = [item for item in refresh.registered() if item.name == "artifacts"]
    return found


def queued_fetches() -> set[int]:
    return {
        job.args["artifact_id"] for job in Job.objects.filter(kind=FETCH_KIND, state=State.QUEUED)
    }


def test_nothing_is_refreshed_before_its_28_days_pass(source, run_worker):
    artifact = artifact_at(source, DOC)
    fetch(run_worker, artifact)
    refresher = artifacts_refresher()
    assert refresher.func(refresher.batch) == 0

    travel_back = timedelta(days=27, hours=23)  # "27 days and 23 hours later"
    Artifact.objects.filter(pk=artifact.pk).update(refresh_after=F("refresh_after") - travel_back)
    assert refresher.func(refresher.batch) == 0

    Artifact.objects.filter(pk=artifact.pk).update(
        refresh_after=F("refresh_after") - timedelta(hours=2)
    )
    assert refresher.func(refresher.batch) == 1
    assert queued_fetches() == {artifact.pk}
    assert Job.objects.get(kind=FETCH_KIND, state=State.QUEUED).unique_key == f"fetch:{artifact.pk}"
    run_worker()
    artifact.refresh_from_db()
    assert artifact.refresh_after > timezone.now() + timedelta(days=27)  # the clock moved on


def test_the_refresh_batch_follows_the_due_backlog_oldest_first(source, monkeypatch):
    """The batch is the whole backlog, at least ``batch`` and at most REFRESH_MAX_BATCH:
    a fixed batch of 100 per 300 s (~806k per 28 days) cannot keep 5M artifacts current."""
    monkeypatch.setattr(artifacts_module, "REFRESH_MAX_BATCH", 150)
    monkeypatch.setattr(artifacts_module, "IDS_PER_QUERY", 40)  # several transactions a run
    refresher = artifacts_refresher()
    long_ago = timezone.now() - timedelta(days=60)
    Artifact.objects.bulk_create(
        Artifact(
            source=source,
            url=f"{source.url}/due/{i}",
            state="fetched",
            refresh_after=long_ago + timedelta(minutes=i),
        )
        for i in range(207)
    )
    Artifact.objects.create(
        source=source,
        url=f"{source.url}/fresh",
        state="fetched",
        refresh_after=timezone.now() + timedelta(days=1),
    )
    due = list(Artifact.objects.filter(url__contains="/due/").order_by("refresh_after"))

    assert refresher.func(refresher.batch) == 150  # more than the batch of 100: the backlog
    assert queued_fetches() == {a.pk for a in due[:150]}
    assert refresher.func(refresher.batch) == 57  # the rest, not the same ones again
    assert refresher.func(refresher.batch) == 0  # everything due is queued exactly once
    assert queued_fetches() == {a.pk for a in due}
    assert Job.objects.filter(kind=FETCH_KIND).count() == len(due)


def test_the_default_refresh_ceiling_keeps_five_million_artifacts_current():
    per_run_needed = 5_000_000 / (28 * 24 * 3600) * 300  # ~620 due per 300 s run
    assert 10 * per_run_needed < artifacts_module.REFRESH_MAX_BATCH


def test_a_disabled_sources_due_artifacts_do_not_starve_the_others(site, source):
    refresher = artifacts_refresher()
    disabled = make_source(site, "retired", enabled=False)
    long_ago = timezone.now() - timedelta(days=60)
    Artifact.objects.bulk_create(
        Artifact(source=disabled, url=f"{disabled.url}/due/{i}", state="fetched",
                 refresh_after=long_ago)
        for i in range(refresher.batch)
    )  # fmt: skip
    enabled = Artifact.objects.create(
        source=source, url=f"{source.url}/due", state="fetched", refresh_after=long_ago
    )
    assert refresher.func(refresher.batch) == 1
    assert queued_fetches() == {enabled.pk}


def test_an_artifact_whose_refresh_died_is_not_picked_again_by_the_next_run(source, run_worker):
    artifact = artifact_at(source, DOC)
    fetch(run_worker, artifact)
    Artifact.objects.filter(pk=artifact.pk).update(refresh_after=timezone.now())
    # No date is that many days away: the refresh dies of OverflowError, an error no code
    # path expects, and leaves the artifact as it was (fetched, and due).
    Source.objects.filter(pk=source.pk).update(refresh_days=999_999_999)
    refresher = artifacts_refresher()
    assert refresher.func(refresher.batch) == 1
    Job.objects.filter(kind=FETCH_KIND, state=State.QUEUED).update(max_attempts=1)
    run_worker()
    job = Job.objects.filter(kind=FETCH_KIND).latest("pk")
    assert job.state == State.DEAD and "OverflowError" in job.last_error
    artifact.refresh_from_db()
    assert artifact.state == "fetched"
    assert artifact.refresh_after > timezone.now() + timedelta(hours=23)  # due in a day
    assert refresher.func(refresher.batch) == 0


# --- commands --------------------------------------------------------------------------


def test_force_refresh_enqueues_by_artifact_source_or_staleness(site, source):
    a, b = artifact_at(source, DOC), artifact_at(source, "/docs/b.html")
    other = make_source(site, "other")
    artifact_at(other, "/docs/c.html")

    assert run_json("force_refresh", "--artifact", str(a.pk)) == {
        "enqueued": 1,
        "artifact_ids": [a.pk],
        "already_queued": 0,
    }
    assert run_json("force_refresh", "--source", "local")["artifact_ids"] == [b.pk]  # a queued
    assert run("force_refresh", "--source", "local").strip() == (
        "enqueued 0 fetch(es) (2 already queued or running)"
    )
    assert run_json("force_refresh", "--stale")["enqueued"] == 0  # none fetched and due
    Artifact.objects.filter(source=other).update(
        state="fetched", refresh_after=timezone.now() - timedelta(minutes=1)
    )
    assert run_json("force_refresh", "--stale")["enqueued"] == 1
    assert {job.unique_key for job in Job.objects.filter(kind=FETCH_KIND)} == {
        f"fetch:{pk}" for pk in Artifact.objects.values_list("pk", flat=True)
    }


def test_force_refresh_enqueues_in_bounded_batches(site, source, monkeypatch, settings):
    """83,573 stale artifacts took 328 MB in one enqueue_many and one transaction (scale
    audit): batches of IDS_PER_QUERY are committed one by one, in bounded memory."""
    Artifact.objects.bulk_create(
        Artifact(source=source, url=f"{site.url('/docs/')}{n}.html") for n in range(8_000)
    )
    tracemalloc.start()
    try:
        data = run_json("force_refresh", "--source", "local")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert data["enqueued"] == 8_000 and data["already_queued"] == 0
    assert data["artifact_ids"] == sorted(Artifact.objects.values_list("pk", flat=True))
    assert peak < 10 * 1024 * 1024, peak  # in one enqueue_many, 8,000 jobs peaked at 18.5 MB

    # A lane that fills midway: what was enqueued stays, the command says so (exit 1).
    Job.objects.filter(kind=FETCH_KIND).delete()
    monkeypatch.setattr(artifacts_module, "IDS_PER_QUERY", 2_000)
    settings.HOLDFAST_LANES = {"default": {"max_queued": 5_000}}
    with pytest.raises(CommandError) as refused:
        run("force_refresh", "--source", "local")
    assert refused.value.returncode == 1
    assert "the fetch lane is full: 4000 fetch(es) enqueued before it filled" in str(refused.value)
    assert Job.objects.filter(kind=FETCH_KIND).count() == 4_000


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("--stale", "--source", "local"),
        ("--artifact", "999999"),
        ("--source", "nowhere"),
    ],
)
def test_force_refresh_bad_input_exits_2(source, args):
    assert exit_code("force_refresh", *args) == 2
    assert not Job.objects.exists()


def test_list_artifacts_shows_state_hash_and_refresh_after(site, source, run_worker):
    fetched = artifact_at(source, DOC)
    fetch(run_worker, fetched)
    artifact_at(make_source(site, "other"), "/docs/b.html")

    data = run_json("list_artifacts")
    assert data["count"] == 2
    by_source = {row["source"]: row for row in data["artifacts"]}
    row = by_source["local"]
    assert (row["id"], row["state"], row["sha256"]) == (fetched.pk, "fetched", fetched.sha256)
    assert row["refresh_after"] == fetched.refresh_after.isoformat()
    assert by_source["other"]["state"] == "discovered" and by_source["other"]["sha256"] is None

    assert [r["id"] for r in run_json("list_artifacts", "--source", "local")["artifacts"]] == [
        fetched.pk
    ]
    assert run_json("list_artifacts", "--state", "discovered")["artifacts"][0]["source"] == "other"
    assert run_json("list_artifacts", "--limit", "1")["count"] == 1
    text = run("list_artifacts", "--source", "local")
    assert fetched.url in text and fetched.sha256[:12] in text
    assert exit_code("list_artifacts", "--source", "nowhere") == 2
