"""The internal HTTP API (DESIGN §9): auth matrix, operator actions, filters, errors.

Every request goes through Django's test client with CSRF checks enforced and no cookies,
as an ops script would call it: a POST that works here has no CSRF dependency.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from django.test import Client
from django.utils import timezone
from structlog.testing import capture_logs

from ingestion import reconciliation
from ingestion.models import ReconciliationIssue
from jobs import engine, enqueueing, operations
from jobs.models import Job, State, Worker
from jobs.serialization import job_detail_dict, job_dict, lease_dict
from jobs.status import queue_status
from ops import serializers, tokens
from ops.models import AuthRefusal

from .helpers import claim_one, failure

pytestmark = pytest.mark.django_db

API = "/internal/v1/"


# --- builders ----------------------------------------------------------------------------


def make_dead_job(message: str = "no disk", **enqueue: Any) -> Job:
    """A real dead job: test.fail allows 3 attempts, each claimed and failed."""
    job = enqueueing.enqueue("test.fail", **enqueue)
    for attempt in range(3):
        engine.fail(claim_one(), failure(f"{message} ({attempt + 1})"), backoff_seconds=0)
    job.refresh_from_db()
    assert job.state == State.DEAD
    return job


def make_succeeded_job() -> Job:
    job = enqueueing.enqueue("test.echo")
    engine.complete(claim_one(), {"ok": True})
    job.refresh_from_db()
    return job


def make_issue(kind: str = "quarantined_submission", source: str = "", subject: str = "a.json"):
    return reconciliation.record(kind, subject, source=source, details={"reason": "bad JSON"})


@dataclass
class Tokens:
    read: str
    write: str
    revoked: str


@pytest.fixture
def api_tokens() -> Tokens:
    _, read = tokens.create("reader", "read")
    _, write = tokens.create("ops-bot", "write")
    _, revoked = tokens.create("old-bot", "write")
    tokens.revoke("old-bot")
    return Tokens(read=read, write=write, revoked=revoked)


@pytest.fixture
def client() -> Client:
    return Client(enforce_csrf_checks=True)


def call(
    client: Client,
    method: str,
    path: str,
    token: str | None = None,
    body: Any = None,
    authorization: str | None = None,
    **extra: Any,
):
    headers = dict(extra.pop("headers", {}))
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if authorization is not None:
        headers["Authorization"] = authorization
    if method == "GET":
        return client.get(API + path, headers=headers, **extra)
    data = json.dumps(body) if body is not None else ""
    content_type = extra.pop("content_type", "application/json")
    return client.generic(method, API + path, data, content_type=content_type, headers=headers)


def assert_error(response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/json"
    data = response.json()
    assert isinstance(data["error"], str) and data["error"]
    assert "\n" not in data["error"]
    if code is not None:
        assert data["code"] == code
    return data


# --- the auth matrix ---------------------------------------------------------------------


@dataclass
class World:
    dead: Job
    queued: Job
    issue: ReconciliationIssue


@pytest.fixture
def world() -> World:
    return World(dead=make_dead_job(), queued=enqueueing.enqueue("test.echo"), issue=make_issue())


# (method, path template, body); every endpoint that needs a token.
ENDPOINTS = [
    ("GET", "queue/", None),
    ("GET", "dead-jobs/", None),
    ("GET", "jobs/{dead}/", None),
    ("POST", "jobs/{dead}/requeue/", None),
    ("POST", "dead-jobs/requeue/", {"all": True}),
    ("POST", "jobs/{queued}/cancel/", None),
    ("GET", "reconciliation-issues/", None),
    ("POST", "reconciliation-issues/{issue}/resolve/", {"comment": "re-sent by the lab"}),
]
ENDPOINT_IDS = [f"{method} {path}" for method, path, _ in ENDPOINTS]


def endpoint_path(template: str, world: World) -> str:
    return template.format(dead=world.dead.pk, queued=world.queued.pk, issue=world.issue.pk)


def assert_unchanged(world: World) -> None:
    assert Job.objects.get(pk=world.dead.pk).state == State.DEAD
    assert Job.objects.get(pk=world.queued.pk).state == State.QUEUED
    assert ReconciliationIssue.objects.get(pk=world.issue.pk).status == "open"


@pytest.mark.parametrize(("method", "template", "body"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_no_token_is_401_with_a_bearer_challenge(client, world, method, template, body):
    response = call(client, method, endpoint_path(template, world), body=body)
    data = assert_error(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"] == 'Bearer realm="holdfast"'
    assert "jobs" not in data and "totals" not in data
    assert_unchanged(world)


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer not-a-token",
        "Bearer hf_abcdefgh_" + "x" * 43,  # well-formed, never issued
        "Bearer",
        "Token hf_abcdefgh_" + "x" * 43,
        "Basic b3BzOnNlY3JldA==",  # no basic auth on this API
    ],
    ids=["malformed", "unknown", "empty", "other-scheme", "basic-auth"],
)
@pytest.mark.parametrize(("method", "template", "body"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_a_bad_token_is_401(client, world, api_tokens, method, template, body, authorization):
    response = call(
        client, method, endpoint_path(template, world), body=body, authorization=authorization
    )
    assert_error(response, 401, "authentication_failed")
    assert response["WWW-Authenticate"] == 'Bearer realm="holdfast"'
    assert_unchanged(world)


@pytest.mark.parametrize(("method", "template", "body"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_a_revoked_token_is_401(client, world, api_tokens, method, template, body):
    response = call(client, method, endpoint_path(template, world), api_tokens.revoked, body=body)
    data = assert_error(response, 401, "authentication_failed")
    assert "revoked" in data["error"]
    assert response["WWW-Authenticate"] == 'Bearer realm="holdfast"'
    assert_unchanged(world)


@pytest.mark.parametrize(("method", "template", "body"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_a_read_token_may_get_but_not_post(client, world, api_tokens, method, template, body):
    with capture_logs() as logs:
        response = call(client, method, endpoint_path(template, world), api_tokens.read, body=body)
    if method == "GET":
        assert response.status_code == 200, response.content
    else:
        data = assert_error(response, 403, "permission_denied")
        assert "read" in data["error"]
        assert "WWW-Authenticate" not in response
        refused = [entry for entry in logs if entry["event"] == "api_forbidden"]
        assert [(e["token"], e["method"]) for e in refused] == [("reader", "POST")]
        # An operator with LOG_LEVEL=WARNING sees it, and whence it came (it was info).
        assert refused[0]["log_level"] == "warning" and refused[0]["client"]
        assert AuthRefusal.objects.get(reason="insufficient scope").count == 1
    assert_unchanged(world)


@pytest.mark.parametrize(("method", "template", "body"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_a_write_token_may_get_and_post(client, world, api_tokens, method, template, body):
    response = call(client, method, endpoint_path(template, world), api_tokens.write, body=body)
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == "application/json"


def test_a_token_use_is_recorded_as_last_used(client, api_tokens):
    from ops.models import OpsToken

    assert OpsToken.objects.get(name="reader").last_used_at is None
    assert call(client, "GET", "queue/", api_tokens.read).status_code == 200
    assert OpsToken.objects.get(name="reader").last_used_at is not None


@pytest.fixture
def live_worker() -> Worker:
    return Worker.objects.create(id="live", host="h", pid=1)


def test_health_without_a_token_says_only_up(client, world, live_worker):
    response = call(client, "GET", "health/")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.parametrize("which", ["revoked", "garbage"])
def test_health_with_a_bad_token_is_401_and_reveals_nothing(client, api_tokens, which):
    token = api_tokens.revoked if which == "revoked" else "garbage"
    response = call(client, "GET", "health/", token)
    data = assert_error(response, 401, "authentication_failed")
    assert set(data) == {"error", "code"}
    assert response["WWW-Authenticate"] == 'Bearer realm="holdfast"'


@pytest.mark.parametrize("which", ["read", "write"])
def test_health_with_a_token_gives_details(client, api_tokens, which, live_worker):
    response = call(client, "GET", "health/", getattr(api_tokens, which))
    assert response.status_code == 200
    data = response.json()
    assert data["status"] == "ok" and data["database"] == "ok" and data["reasons"] == []
    assert set(data["workers"]) == {"live", "gone", "stale", "stale_after_s"}
    assert set(data["spool"]) == {"pending", "oldest_age_s"}


def test_health_posts_are_not_allowed(client, api_tokens):
    response = call(client, "POST", "health/", api_tokens.write)
    assert_error(response, 405, "method_not_allowed")


# --- requeue and cancel on real rows -----------------------------------------------------


def test_requeue_a_dead_job_puts_it_back_in_the_queue_and_logs_the_token(client, api_tokens):
    dead = make_dead_job()
    with capture_logs() as logs:
        response = call(client, "POST", f"jobs/{dead.pk}/requeue/", api_tokens.write)
    assert response.status_code == 200, response.content
    data = response.json()
    assert data["id"] == dead.pk and data["state"] == "queued"
    assert data["finished_at"] is None
    assert data["max_attempts"] > data["attempts"] == 3
    assert Job.objects.get(pk=dead.pk).state == State.QUEUED
    assert engine.claim("w2") is not None, "the requeued job is runnable again"
    events = [entry for entry in logs if entry["event"] == "job_requeued"]
    assert [(e["job_id"], e["by"]) for e in events] == [(dead.pk, "ops-bot")]


@pytest.mark.parametrize("state", ["queued", "running", "succeeded"])
def test_requeue_a_job_that_is_not_dead_is_409(client, api_tokens, state):
    if state == "succeeded":
        job = make_succeeded_job()
    else:
        job = enqueueing.enqueue("test.echo")
        if state == "running":
            claim_one()
    response = call(client, "POST", f"jobs/{job.pk}/requeue/", api_tokens.write)
    data = assert_error(response, 409, "conflict")
    assert data["error"] == f"job {job.pk} is {state}, not dead: nothing to requeue"
    assert Job.objects.get(pk=job.pk).state == state


def test_requeue_twice_is_a_conflict_the_second_time(client, api_tokens):
    dead = make_dead_job()
    assert call(client, "POST", f"jobs/{dead.pk}/requeue/", api_tokens.write).status_code == 200
    response = call(client, "POST", f"jobs/{dead.pk}/requeue/", api_tokens.write)
    assert_error(response, 409, "conflict")


def test_cancel_a_queued_job_cancels_it_at_once(client, api_tokens):
    job = enqueueing.enqueue("test.echo")
    with capture_logs() as logs:
        response = call(client, "POST", f"jobs/{job.pk}/cancel/", api_tokens.write)
    assert response.status_code == 200, response.content
    data = response.json()
    assert (data["state"], data["cancel_requested"]) == ("cancelled", True)
    assert data["finished_at"] is not None
    assert "ops-bot" in data["last_error"]
    assert Job.objects.get(pk=job.pk).state == State.CANCELLED
    assert engine.claim("w2") is None
    events = [entry for entry in logs if entry["event"] == "job_cancelled"]
    assert [(e["job_id"], e["by"]) for e in events] == [(job.pk, "ops-bot")]


def test_cancel_a_running_job_requests_cancellation(client, api_tokens):
    job = enqueueing.enqueue("test.echo")
    claimed = claim_one("w1")
    with capture_logs() as logs:
        response = call(client, "POST", f"jobs/{job.pk}/cancel/", api_tokens.write)
    assert response.status_code == 200, response.content
    data = response.json()
    assert (data["state"], data["cancel_requested"]) == ("running", True)
    assert data["leased_by"] == "w1"
    row = Job.objects.get(pk=job.pk)
    assert (row.state, row.cancel_requested, row.lease_token) == (
        "running",
        True,
        claimed.lease_token,
    )
    events = [entry for entry in logs if entry["event"] == "job_cancel_requested"]
    assert [(e["job_id"], e["by"]) for e in events] == [(job.pk, "ops-bot")]


@pytest.mark.parametrize("state", ["succeeded", "dead", "cancelled"])
def test_cancel_a_finished_job_is_409(client, api_tokens, state):
    if state == "succeeded":
        job = make_succeeded_job()
    elif state == "dead":
        job = make_dead_job()
    else:
        job = operations.cancel(enqueueing.enqueue("test.echo").pk)
    response = call(client, "POST", f"jobs/{job.pk}/cancel/", api_tokens.write)
    data = assert_error(response, 409, "conflict")
    assert data["error"] == f"job {job.pk} is {state}: it has finished, nothing to cancel"
    assert Job.objects.get(pk=job.pk).state == state


@pytest.mark.parametrize(
    ("method", "suffix"), [("GET", ""), ("POST", "requeue/"), ("POST", "cancel/")]
)
@pytest.mark.parametrize("job_id", [999_999, 0, 2**63 - 1, 10**30])
def test_an_unknown_job_is_404(client, api_tokens, method, suffix, job_id):
    response = call(client, method, f"jobs/{job_id}/{suffix}", api_tokens.write)
    data = assert_error(response, 404, "not_found")
    assert str(job_id) in data["error"]


def test_job_detail_shows_every_attempt_with_its_error(client, api_tokens):
    dead = make_dead_job("disk full")
    response = call(client, "GET", f"jobs/{dead.pk}/", api_tokens.read)
    assert response.status_code == 200
    data = response.json()
    assert data == json.loads(json.dumps(job_detail_dict(dead)))
    assert [lease["attempt"] for lease in data["leases"]] == [1, 2, 3]
    assert [lease["error_message"] for lease in data["leases"]] == [
        "disk full (1)",
        "disk full (2)",
        "disk full (3)",
    ]
    assert {lease["error_class"] for lease in data["leases"]} == {"RuntimeError"}
    assert data["leases"][0]["traceback"].startswith("Traceback")
    assert data["last_error"]


# --- dead jobs: filters and pagination ---------------------------------------------------


@pytest.fixture
def lanes(settings):
    settings.HOLDFAST_LANES = {"default": {}, "batch": {}}


def list_dead(client, token: str, query: str = "") -> dict[str, Any]:
    response = call(client, "GET", f"dead-jobs/{query}", token)
    assert response.status_code == 200, response.content
    return response.json()


def test_dead_jobs_are_listed_newest_first_with_their_last_error(client, api_tokens):
    first, second = make_dead_job("one"), make_dead_job("two")
    enqueueing.enqueue("test.echo")  # not dead: not listed
    data = list_dead(client, api_tokens.read)
    assert data["count"] == 2
    assert [job["id"] for job in data["jobs"]] == [second.pk, first.pk]
    assert data["jobs"][0] == json.loads(json.dumps(job_dict(second)))
    assert "two (3)" in data["jobs"][0]["last_error"]
    assert (data["page"], data["next"], data["previous"]) == (1, None, None)


def test_dead_jobs_filter_by_lane_and_kind(client, api_tokens, lanes):
    in_default = make_dead_job()
    in_batch = make_dead_job(lane="batch")
    data = list_dead(client, api_tokens.read, "?lane=batch")
    assert [job["id"] for job in data["jobs"]] == [in_batch.pk]
    data = list_dead(client, api_tokens.read, "?lane=default&kind=test.fail")
    assert [job["id"] for job in data["jobs"]] == [in_default.pk]
    assert list_dead(client, api_tokens.read, "?kind=test.echo")["count"] == 0
    response = call(client, "GET", "dead-jobs/?lane=nowhere", api_tokens.read)
    assert response.status_code == 404 and "nowhere" in response.json()["error"]


def test_dead_jobs_filter_by_time_of_death(client, api_tokens):
    old, new = make_dead_job(), make_dead_job()
    Job.objects.filter(pk=old.pk).update(finished_at=datetime(2026, 1, 1, 12, tzinfo=UTC))
    Job.objects.filter(pk=new.pk).update(finished_at=datetime(2026, 3, 1, 12, tzinfo=UTC))
    since = "?since=2026-02-01T00:00:00Z"
    assert [job["id"] for job in list_dead(client, api_tokens.read, since)["jobs"]] == [new.pk]
    # The same instant written with another offset selects the same jobs.
    since = "?since=2026-03-01T14:00:00%2B02:00"
    assert [job["id"] for job in list_dead(client, api_tokens.read, since)["jobs"]] == [new.pk]
    since = "?since=2026-03-01T14:00:01%2B02:00"
    assert list_dead(client, api_tokens.read, since)["count"] == 0


def page_of(url: str) -> int:
    return int(parse_qs(urlsplit(url).query)["page"][0])


def test_dead_jobs_are_paginated_in_a_stable_order(client, api_tokens):
    jobs = [make_dead_job() for _ in range(5)]
    newest_first = [job.pk for job in reversed(jobs)]
    page1 = list_dead(client, api_tokens.read, "?page_size=2")
    assert page1["count"] == 5 and page1["page"] == 1 and page1["page_size"] == 2
    assert [job["id"] for job in page1["jobs"]] == newest_first[:2]
    assert page1["previous"] is None
    next_url = urlsplit(page1["next"])
    assert next_url.path == "/internal/v1/dead-jobs/"
    assert parse_qs(next_url.query) == {"page": ["2"], "page_size": ["2"]}
    page2 = client.get(page1["next"], headers={"Authorization": f"Bearer {api_tokens.read}"})
    assert [job["id"] for job in page2.json()["jobs"]] == newest_first[2:4]
    page3 = list_dead(client, api_tokens.read, "?page_size=2&page=3")
    assert [job["id"] for job in page3["jobs"]] == newest_first[4:]
    assert page3["next"] is None
    assert page_of(page3["previous"]) == 2
    past = list_dead(client, api_tokens.read, "?page_size=2&page=9")
    assert past["jobs"] == [] and past["next"] is None and page_of(past["previous"]) == 3


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("?since=yesterday", "since"),
        ("?since=2026-11-30T10:00:00", "since"),  # no UTC offset
        ("?since=2026-11-30", "since"),
        ("?since=0001-01-01T00:00:00%2B01:00", "since"),  # before year 1 in UTC
        ("?page=two", "page"),
        ("?page=2.0", "page"),
        ("?page=0", "page"),
        ("?page=-1", "page"),
        ("?page=" + "9" * 30, "page"),
        ("?page_size=0", "page_size"),
        ("?page_size=201", "page_size"),
        ("?lane=", "lane"),
        ("?kind=a%00b", "kind"),
        ("?lane=" + "x" * 101, "lane"),
        ("?state=dead", "state"),  # not a filter of this endpoint
        ("?lane=a&lane=b", "lane"),
        ("?format=json", "format"),
    ],
)
def test_dead_jobs_bad_filter_is_400_naming_the_field(client, api_tokens, query, field):
    response = call(client, "GET", f"dead-jobs/{query}", api_tokens.read)
    data = assert_error(response, 400, "invalid")
    assert list(data["fields"]) == [field]
    assert data["error"].startswith(f"{field}: ")


# --- reconciliation issues ---------------------------------------------------------------


def list_issues(client, token: str, query: str = "") -> dict[str, Any]:
    response = call(client, "GET", f"reconciliation-issues/{query}", token)
    assert response.status_code == 200, response.content
    return response.json()


def test_issues_are_listed_newest_first_and_filtered(client, api_tokens):
    quarantined = make_issue("quarantined_submission", subject="lab-1.json")
    gone = make_issue("gone_at_source", source="docs", subject="https://example.org/a")
    resolved = make_issue("gone_at_source", source="blog", subject="https://example.org/b")
    reconciliation.resolve(resolved.pk, by="someone", comment="moved")
    data = list_issues(client, api_tokens.read)
    assert data["count"] == 3
    assert [i["id"] for i in data["issues"]] == [resolved.pk, gone.pk, quarantined.pk]
    gone.refresh_from_db()
    assert data["issues"][1] == json.loads(json.dumps(reconciliation.issue_dict(gone)))
    ids = [i["id"] for i in list_issues(client, api_tokens.read, "?status=open")["issues"]]
    assert ids == [gone.pk, quarantined.pk]
    ids = [i["id"] for i in list_issues(client, api_tokens.read, "?kind=gone_at_source")["issues"]]
    assert ids == [resolved.pk, gone.pk]
    ids = [i["id"] for i in list_issues(client, api_tokens.read, "?source=docs")["issues"]]
    assert ids == [gone.pk]
    page = list_issues(client, api_tokens.read, "?page_size=1&page=2")
    assert [i["id"] for i in page["issues"]] == [gone.pk] and page["count"] == 3


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("?status=closed", "status"),
        ("?status=", "status"),
        ("?kind=nonsense", "kind"),
        ("?source=a%00b", "source"),
        ("?page=abc", "page"),
        ("?page_size=1e3", "page_size"),
        ("?subject=x", "subject"),
    ],
)
def test_issues_bad_filter_is_400_naming_the_field(client, api_tokens, query, field):
    response = call(client, "GET", f"reconciliation-issues/{query}", api_tokens.read)
    data = assert_error(response, 400, "invalid")
    assert list(data["fields"]) == [field]


def test_resolve_an_issue_records_the_token_and_the_comment(client, api_tokens):
    issue = make_issue()
    with capture_logs() as logs:
        response = call(
            client,
            "POST",
            f"reconciliation-issues/{issue.pk}/resolve/",
            api_tokens.write,
            body={"comment": "  re-sent by the lab  "},
        )
    assert response.status_code == 200, response.content
    data = response.json()
    assert data["status"] == "resolved"
    assert (data["resolved_by"], data["comment"]) == ("ops-bot", "re-sent by the lab")
    assert data["resolved_at"] is not None
    issue.refresh_from_db()
    assert (issue.status, issue.resolved_by) == ("resolved", "ops-bot")
    events = [entry for entry in logs if entry["event"] == "reconciliation_issue_resolved"]
    assert [(e["issue_id"], e["by"]) for e in events] == [(issue.pk, "ops-bot")]


def test_resolving_a_resolved_issue_is_409(client, api_tokens):
    issue = make_issue()
    reconciliation.resolve(issue.pk, by="reader", comment="first")
    response = call(
        client,
        "POST",
        f"reconciliation-issues/{issue.pk}/resolve/",
        api_tokens.write,
        body={"comment": "second"},
    )
    data = assert_error(response, 409, "conflict")
    assert data["error"] == f"issue {issue.pk} was already resolved by reader"
    issue.refresh_from_db()
    assert (issue.resolved_by, issue.comment) == ("reader", "first")


def test_resolving_an_unknown_issue_is_404(client, api_tokens):
    response = call(
        client,
        "POST",
        "reconciliation-issues/999999/resolve/",
        api_tokens.write,
        body={"comment": "gone"},
    )
    data = assert_error(response, 404, "not_found")
    assert "999999" in data["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "comment"),
        ({"comment": ""}, "comment"),
        ({"comment": "   "}, "comment"),
        ({"comment": None}, "comment"),
        ({"comment": 42}, "comment"),
        ({"comment": ["a"]}, "comment"),
        ({"comment": {"text": "a"}}, "comment"),
        ({"comment": "a\x00b"}, "comment"),
        ({"comment": "x" * 10_001}, "comment"),
        (["comment"], "body"),
        ("comment", "body"),
    ],
)
def test_resolve_with_a_bad_body_is_400_naming_the_field(client, api_tokens, body, field):
    issue = make_issue()
    response = call(
        client, "POST", f"reconciliation-issues/{issue.pk}/resolve/", api_tokens.write, body=body
    )
    data = assert_error(response, 400, "invalid")
    assert list(data["fields"]) == [field]
    assert ReconciliationIssue.objects.get(pk=issue.pk).status == "open"


def test_resolve_with_a_lone_surrogate_is_400(client, api_tokens):
    issue = make_issue()
    response = client.post(
        f"{API}reconciliation-issues/{issue.pk}/resolve/",
        b'{"comment": "\\ud800"}',
        content_type="application/json",
        headers={"Authorization": f"Bearer {api_tokens.write}"},
    )
    data = assert_error(response, 400, "invalid")
    assert list(data["fields"]) == ["comment"]


def test_resolve_with_malformed_json_is_400(client, api_tokens):
    issue = make_issue()
    response = client.post(
        f"{API}reconciliation-issues/{issue.pk}/resolve/",
        b'{"comment": ',
        content_type="application/json",
        headers={"Authorization": f"Bearer {api_tokens.write}"},
    )
    assert_error(response, 400, "parse_error")


def test_resolve_with_a_form_body_is_415(client, api_tokens):
    issue = make_issue()
    response = client.post(
        f"{API}reconciliation-issues/{issue.pk}/resolve/",
        {"comment": "form"},
        headers={"Authorization": f"Bearer {api_tokens.write}"},
    )
    assert_error(response, 415, "unsupported_media_type")


# --- health ------------------------------------------------------------------------------


def test_health_counts_live_and_gone_workers(client, api_tokens, settings):
    settings.HOLDFAST_LEASE_SECONDS = 60
    Worker.objects.create(id="fresh", host="h", pid=1)
    Worker.objects.create(id="silent", host="h", pid=2)
    Worker.objects.create(id="gone", host="h", pid=3, stopped_at=timezone.now())
    Worker.objects.filter(pk="silent").update(heartbeat_at=timezone.now() - timedelta(minutes=5))
    workers = call(client, "GET", "health/", api_tokens.read).json()["workers"]
    assert workers == {"live": 1, "gone": 1, "stale": 1, "stale_after_s": 60.0}
    settings.HOLDFAST_LEASE_SECONDS = 10  # the floor is 30 s
    assert call(client, "GET", "health/", api_tokens.read).json()["workers"]["stale_after_s"] == 30


def spool_clock(monkeypatch, seconds: float) -> None:
    """Move the spool's wall clock on: every file in it is ``seconds`` older. Ages count
    from a file's arrival (its ctime), which no producer can set back (``cp -p``)."""
    from ingestion import spool

    monkeypatch.setattr(spool, "wall_clock", lambda: time.time() + seconds)


def test_health_reports_the_spool_backlog(
    client, api_tokens, settings, tmp_path: Path, monkeypatch
):
    settings.HOLDFAST_SPOOL_DIR = tmp_path / "spool"
    spool = call(client, "GET", "health/", api_tokens.read).json()["spool"]
    assert spool == {"pending": 0, "oldest_age_s": None}, "no incoming/ directory yet"
    incoming = tmp_path / "spool" / "incoming"
    incoming.mkdir(parents=True)
    assert call(client, "GET", "health/", api_tokens.read).json()["spool"]["pending"] == 0
    for name in ["a.json", "b.json", "c.json.tmp", "d.txt"]:
        (incoming / name).write_text("{}")
    now = time.time()
    os.utime(incoming / "b.json", (now - 9999, now - 9999))  # an old mtime (cp -p): not old
    (incoming / "dir.json").mkdir()
    spool_clock(monkeypatch, 120)
    spool = call(client, "GET", "health/", api_tokens.read).json()["spool"]
    assert spool["pending"] == 2
    assert 119 <= spool["oldest_age_s"] <= 130


# --- the database out of reach -----------------------------------------------------------


@pytest.fixture
def database_down(transactional_db, settings, tmp_path):
    """Point the default connection at a database that cannot be reached, then restore it."""
    from django.db import connection

    saved = dict(connection.settings_dict)
    connection.close()
    if connection.vendor == "postgresql":
        connection.settings_dict.update(HOST="127.0.0.1", PORT=1)  # nothing listens there
    else:
        connection.settings_dict["NAME"] = str(tmp_path / "no-such-dir" / "db.sqlite3")
    yield
    connection.close()
    connection.settings_dict.clear()
    connection.settings_dict.update(saved)


@pytest.fixture
def committed_tokens(transactional_db) -> Tokens:
    _, read = tokens.create("reader", "read")
    _, write = tokens.create("ops-bot", "write")
    return Tokens(read=read, write=write, revoked="")


def test_health_is_503_down_when_the_database_is_unreachable(client, committed_tokens, request):
    request.getfixturevalue("database_down")
    # Whatever the token (docs/api.md): one too malformed to need the database included.
    for token in (None, committed_tokens.read, "garbage"):
        response = call(client, "GET", "health/", token)
        assert response.status_code == 503
        assert response.json() == {"status": "down"}, "the token cannot be checked: no details"


@pytest.mark.parametrize(("method", "path"), [("GET", "queue/"), ("POST", "jobs/1/cancel/")])
def test_every_endpoint_is_503_json_when_the_database_is_unreachable(
    client, committed_tokens, request, method, path
):
    request.getfixturevalue("database_down")
    response = call(client, method, path, committed_tokens.write)
    assert_error(response, 503, "database_unavailable")


# --- errors, routing, schema -------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/internal/v1/nope/",
        "/internal/v1/jobs/abc/",
        "/internal/v1/jobs/-1/",
        "/internal/v2/queue/",
        "/",
    ],
)
def test_unknown_urls_are_json_404(client, api_tokens, path):
    response = client.get(path, headers={"Authorization": f"Bearer {api_tokens.read}"})
    data = assert_error(response, 404, "not_found")
    assert "no such endpoint" in data["error"]


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "jobs/1/cancel/"), ("DELETE", "jobs/1/"), ("PUT", "queue/"), ("POST", "queue/")],
)
def test_wrong_methods_are_json_405(client, api_tokens, method, path):
    response = call(client, method, path, api_tokens.write)
    assert_error(response, 405, "method_not_allowed")
    assert response["Allow"]


def test_unknown_query_parameters_are_refused_everywhere(client, api_tokens):
    for path in ["queue/", "health/", f"jobs/{enqueueing.enqueue('test.echo').pk}/"]:
        data = assert_error(call(client, "GET", f"{path}?verbose=1", api_tokens.read), 400)
        assert list(data["fields"]) == ["verbose"]


def test_a_bad_token_is_refused_before_the_query_is_checked(client):
    response = call(client, "GET", "dead-jobs/?page=x", "garbage")
    assert_error(response, 401)


def test_an_unexpected_error_is_a_json_500_not_an_html_page(rf):
    from config import urls
    from ops.exceptions import server_error

    assert urls.handler500 == "ops.exceptions.server_error"
    response = server_error(rf.get("/internal/v1/queue/"))
    assert response.status_code == 500
    assert json.loads(response.content) == {
        "error": "internal server error",
        "code": "server_error",
    }


def test_the_schema_is_public_json_openapi_3(client):
    response = client.get(API + "schema/", headers={"Authorization": "Bearer garbage"})
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    document = response.json()
    assert document["openapi"].startswith("3.")
    assert set(document["paths"]) == {
        "/internal/v1/queue/",
        "/internal/v1/metrics/",
        "/internal/v1/dead-jobs/",
        "/internal/v1/dead-jobs/requeue/",
        "/internal/v1/jobs/{job_id}/",
        "/internal/v1/jobs/{job_id}/requeue/",
        "/internal/v1/jobs/{job_id}/cancel/",
        "/internal/v1/reconciliation-issues/",
        "/internal/v1/reconciliation-issues/{issue_id}/resolve/",
        "/internal/v1/health/",
        "/internal/v1/search/",
    }
    assert document["components"]["securitySchemes"]["bearerToken"]["scheme"] == "bearer"


# --- the schema's shapes are the shapes served -------------------------------------------


def fields_of(serializer_class) -> set[str]:
    return set(serializer_class().fields)


def test_schema_serializers_name_the_fields_the_api_serves():
    dead = make_dead_job()
    claim_one_after = enqueueing.enqueue("test.echo")
    claim_one("w1")
    Worker.objects.create(id="w1", host="h", pid=1)
    issue = make_issue()
    assert fields_of(serializers.JobResponse) == set(job_dict(dead))
    assert fields_of(serializers.JobDetailResponse) == set(job_detail_dict(dead))
    assert fields_of(serializers.LeaseResponse) == set(lease_dict(dead.leases.first()))
    assert fields_of(serializers.IssueResponse) == set(reconciliation.issue_dict(issue))
    status = queue_status()
    assert fields_of(serializers.QueueResponse) == set(status)
    assert fields_of(serializers.LaneFigures) == set(status["lanes"]["default"])
    assert fields_of(serializers.WorkerFigures) == set(status["workers"][0])
    assert fields_of(serializers.LiveLease) == set(status["live_leases"][0])
    assert status["live_leases"][0]["job_id"] == claim_one_after.pk


def test_post_needs_no_cookie_and_no_csrf_token(api_tokens):
    """DRF's views are csrf_exempt and only bearer tokens authenticate: no CSRF surface."""
    job = enqueueing.enqueue("test.echo")
    strict = Client(enforce_csrf_checks=True)
    assert not strict.cookies
    response = strict.post(
        f"{API}jobs/{job.pk}/cancel/",
        content_type="application/json",
        headers={"Authorization": f"Bearer {api_tokens.write}"},
    )
    assert response.status_code == 200
    assert not response.cookies


def test_queue_gives_the_queue_status_figures(client, api_tokens):
    make_dead_job()
    enqueueing.enqueue("test.echo")
    data = call(client, "GET", "queue/", api_tokens.read).json()
    assert set(data) == set(queue_status())
    assert (data["totals"]["dead"], data["totals"]["queued"], data["dead"]) == (1, 1, 1)
    assert data["lanes"]["default"]["queued"] == 1
    assert data["lanes"]["default"]["oldest_queued_age_s"] >= 0
    now = datetime.fromisoformat(data["now"])
    assert abs((now - timezone.now()).total_seconds()) < 60
    # No worker serves test.echo yet: the API names the kind, as queue_status does.
    assert [(u["kind"], u["queued"]) for u in data["unserved_kinds"]] == [("test.echo", 1)]


# --- health's reasons --------------------------------------------------------------------


def health(client, token: str | None = None):
    return call(client, "GET", "health/", token)


def test_health_is_503_when_no_worker_is_live(client, api_tokens, settings):
    settings.HOLDFAST_LEASE_SECONDS = 60
    Worker.objects.create(id="silent", host="h", pid=2)
    Worker.objects.filter(pk="silent").update(heartbeat_at=timezone.now() - timedelta(minutes=5))
    response = health(client)
    assert (response.status_code, response.json()) == (503, {"status": "failing"})
    detailed = health(client, api_tokens.read)
    assert detailed.status_code == 503
    reasons = detailed.json()["reasons"]
    assert [reason["code"] for reason in reasons] == ["no_live_worker"]
    assert "1 registered worker(s) gone" in reasons[0]["detail"]
    Worker.objects.filter(pk="silent").update(heartbeat_at=timezone.now())
    assert health(client).status_code == 200


def test_health_is_503_when_the_spool_is_overdue_or_the_ingester_stuck(
    client, api_tokens, settings, tmp_path: Path, monkeypatch
):
    Worker.objects.create(id="live", host="h", pid=1)
    settings.HOLDFAST_SPOOL_DIR = tmp_path / "spool"
    settings.HOLDFAST_SPOOL_STUCK_SECONDS = 300
    settings.HOLDFAST_SPOOL_GRACE_SECONDS = 3600
    incoming = tmp_path / "spool" / "incoming"
    incoming.mkdir(parents=True)
    waiting = incoming / "a.json"
    waiting.write_text("{}")
    assert health(client).status_code == 200, "a fresh file: the ingester has time"
    spool_clock(monkeypatch, 400)
    response = health(client, api_tokens.read)
    assert response.status_code == 503
    assert [reason["code"] for reason in response.json()["reasons"]] == ["ingester_stuck"]
    spool_clock(monkeypatch, 4000)
    response = health(client, api_tokens.read)
    codes = [reason["code"] for reason in response.json()["reasons"]]
    assert codes == ["spool_overdue", "ingester_stuck"]
    assert health(client).json() == {"status": "failing"}, "no token: no reasons"
    waiting.unlink()
    assert health(client).status_code == 200
