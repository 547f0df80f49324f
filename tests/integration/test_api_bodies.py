"""What an ops script sends is read as it was sent, or refused as JSON (docs/api.md): a
chunked body, a body on an action that takes none, a body the client stops sending; and
every answer is JSON also with DEBUG on, a POST without its trailing slash included."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from django.test import Client
from structlog.testing import capture_logs

from config.wsgi import application
from jobs import enqueueing
from jobs.models import Job, State
from ops import tokens
from ops.wsgi import ChunkedBodies
from tests.conftest import REPO

from .test_api import assert_error, call, make_dead_job, make_issue

pytestmark = pytest.mark.django_db

API = "/internal/v1/"


@pytest.fixture
def write_token() -> str:
    return tokens.create("ops-bot", "write")[1]


@pytest.fixture
def client() -> Client:
    return Client(raise_request_exception=False)


# --- chunked bodies, through the WSGI application itself --------------------------------


@pytest.fixture
def wsgi() -> Iterator[None]:
    """Requests through ``config.wsgi.application`` inside the test's transaction: as
    Django's test client does, keep the request signals from closing the connection."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


def serve(body: bytes | io.RawIOBase, token: str, path: str, terminated: bool = True):
    """POST ``body`` chunked (no Content-Length), as gunicorn hands it over (already
    de-chunked, ``wsgi.input_terminated``) or as a server that does not decode it."""
    environ: dict[str, Any] = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path,
        "SERVER_NAME": "localhost",
        "SERVER_PORT": "80",
        "HTTP_HOST": "localhost",
        "wsgi.url_scheme": "http",
        "CONTENT_TYPE": "application/json",
        "HTTP_TRANSFER_ENCODING": "chunked",
        "HTTP_AUTHORIZATION": f"Bearer {token}",
        "wsgi.input": io.BytesIO(body) if isinstance(body, bytes) else body,
        "wsgi.errors": io.StringIO(),
    }
    if terminated:
        environ["wsgi.input_terminated"] = True
    answer: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        answer["status"], answer["headers"] = int(status.split()[0]), dict(headers)

    content = b"".join(application(environ, start_response))
    assert answer["headers"]["Content-Type"] == "application/json", content[:300]
    return answer["status"], json.loads(content)


def test_a_chunked_body_is_read_as_sent(wsgi, write_token):
    dead = make_dead_job()
    status, data = serve(
        json.dumps({"ids": [dead.pk], "dry_run": True}).encode(),
        write_token,
        API + "dead-jobs/requeue/",
    )
    assert (status, data["requeued"], data["dry_run"]) == (200, [dead.pk], True)
    assert Job.objects.get(pk=dead.pk).state == State.DEAD  # a dry run: nothing changed


def test_a_chunked_body_past_the_limit_is_a_413_without_reading_all_of_it(wsgi, write_token):
    size = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    stream = io.BytesIO(b'{"comment": "' + b"x" * (size * 3) + b'"}')
    status, data = serve(stream, write_token, API + "reconciliation-issues/1/resolve/")  # type: ignore[arg-type]
    assert (status, data["code"]) == (413, "too_large")
    assert stream.tell() == size + 1  # read one byte past the limit, no more


def test_a_chunked_body_a_server_did_not_decode_is_a_411(wsgi, write_token):
    status, data = serve(b"{}", write_token, API + "dead-jobs/requeue/", terminated=False)
    assert (status, data["code"]) == (411, "length_required")
    assert "Content-Length" in data["error"]


class Stalled(io.RawIOBase):
    """A client that sends a few bytes, then nothing until the server's read timeout."""

    def __init__(self) -> None:
        self.sent = False

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if not self.sent:
            self.sent = True
            return b'{"comm'
        raise TimeoutError("timed out")


def test_a_chunked_body_the_client_stops_sending_is_a_400(wsgi, write_token):
    with capture_logs() as logs:
        status, data = serve(Stalled(), write_token, API + "reconciliation-issues/1/resolve/")  # type: ignore[arg-type]
    assert (status, data["code"]) == (400, "bad_request")
    assert [log["event"] for log in logs] == ["api_body_unreadable"]


def test_a_body_the_client_stops_sending_is_a_400_not_a_500(client, write_token):
    """With a Content-Length: the read times out inside Django (UnreadablePostError)."""
    from django.test.client import FakePayload

    class StalledPayload(FakePayload):
        def read(self, size: int = -1) -> bytes:
            raise TimeoutError("timed out")

    response = client.generic(
        "POST",
        API + "reconciliation-issues/1/resolve/",
        b'{"comment": "x"}',
        content_type="application/json",
        headers={"Authorization": f"Bearer {write_token}"},
        **{"wsgi.input": StalledPayload(b'{"comment": "x"}')},
    )
    data = assert_error(response, 400, "parse_error")
    assert "could not be read" in data["error"]


def test_without_transfer_encoding_nothing_is_read_ahead():
    seen: dict[str, Any] = {}

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        seen.update(environ)
        return []

    stream = io.BytesIO(b"{}")
    ChunkedBodies(app)({"wsgi.input": stream, "CONTENT_LENGTH": "2"}, lambda *a: None)
    assert seen["wsgi.input"] is stream and stream.tell() == 0


# --- actions that take no body -------------------------------------------------------------


@pytest.mark.parametrize("action", ["requeue", "cancel"])
@pytest.mark.parametrize(
    ("data", "content_type", "status", "code"),
    [
        ("hello", "text/plain", 415, "unsupported_media_type"),
        ("[1,2", "application/json", 400, "parse_error"),
        ('{"force": true}', "application/json", 400, "invalid"),
        ("[]", "application/json", 400, "invalid"),
        (b"x" * (2_621_440 + 1), "application/json", 413, "too_large"),
    ],
    ids=["not-json", "invalid-json", "fields", "a-list", "too-large"],
)
def test_a_body_on_an_action_that_takes_none_is_refused_and_nothing_is_done(
    client, write_token, action, data, content_type, status, code
):
    job = make_dead_job() if action == "requeue" else enqueueing.enqueue("test.echo")
    response = client.post(
        f"{API}jobs/{job.pk}/{action}/",
        data,
        content_type=content_type,
        headers={"Authorization": f"Bearer {write_token}"},
    )
    assert_error(response, status, code)
    assert Job.objects.get(pk=job.pk).state == job.state


@pytest.mark.parametrize("body", [b"", b"{}"], ids=["none", "empty-object"])
def test_no_body_or_an_empty_object_carries_the_action_out(client, write_token, body):
    job = enqueueing.enqueue("test.echo")
    response = client.post(
        f"{API}jobs/{job.pk}/cancel/",
        body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {write_token}"},
    )
    assert response.status_code == 200, response.content
    assert response.json()["state"] == State.CANCELLED


# --- strict body fields and plain messages ------------------------------------------------


def test_item_errors_are_plain_messages_not_python_reprs(client, write_token):
    response = call(client, "POST", "dead-jobs/requeue/", write_token, {"ids": ["a", 1, -5]})
    data = assert_error(response, 400, "invalid")
    assert data["fields"]["ids"] == [
        "item 0: must be a whole number, e.g. 2",
        "item 2: Ensure this value is greater than or equal to 1.",
    ]
    assert "ErrorDetail" not in response.content.decode()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"ids": [1.0]}, "ids"),
        ({"ids": ["2"]}, "ids"),
        ({"ids": [True]}, "ids"),
        ({"all": "yes"}, "all"),
        ({"dry_run": 1}, "dry_run"),
        ({"dry_run": "true"}, "dry_run"),
    ],
)
def test_requeue_body_fields_take_only_their_own_json_type(client, write_token, body, field):
    dead = make_dead_job()
    data = assert_error(call(client, "POST", "dead-jobs/requeue/", write_token, body), 400)
    assert list(data["fields"]) == [field]
    assert Job.objects.get(pk=dead.pk).state == State.DEAD


@pytest.mark.parametrize(
    ("endpoint", "body", "field"),
    [
        ("dead-jobs/requeue/", {"all": True, "dryrun": True}, "dryrun"),
        ("dead-jobs/requeue/", {"kind": "test.echo", "lanes": "default"}, "lanes"),
        ("reconciliation-issues/{issue}/resolve/", {"comment": "ok", "by": "me"}, "by"),
    ],
)
def test_a_body_field_the_endpoint_does_not_take_is_refused_and_nothing_is_done(
    client, write_token, endpoint, body, field
):
    """A typo is bad input: ``dryrun`` must not requeue every dead job for real."""
    from ingestion.models import IssueStatus, ReconciliationIssue

    dead = make_dead_job()
    issue = make_issue()
    path = endpoint.format(issue=issue.pk)
    data = assert_error(call(client, "POST", path, write_token, body), 400, "invalid")
    assert list(data["fields"]) == [field]
    assert "unknown field" in data["fields"][field][0]
    assert Job.objects.get(pk=dead.pk).state == State.DEAD
    assert ReconciliationIssue.objects.get(pk=issue.pk).status == IssueStatus.OPEN


@pytest.mark.parametrize(
    "body",
    ['{"all": false, "all": true}', '{"ids": [1], "kind": "a", "kind": "b"}'],
    ids=["top-level", "later-key"],
)
def test_a_key_given_twice_is_refused_not_last_one_wins(client, write_token, body):
    dead = make_dead_job()
    response = client.post(
        API + "dead-jobs/requeue/",
        body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {write_token}"},
    )
    data = assert_error(response, 400, "parse_error")
    assert "more than once" in data["error"]
    assert Job.objects.get(pk=dead.pk).state == State.DEAD


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_json_constants_are_refused(client, write_token, constant):
    response = client.post(
        API + "dead-jobs/requeue/",
        '{"ids": [' + constant + "]}",
        content_type="application/json",
        headers={"Authorization": f"Bearer {write_token}"},
    )
    assert constant.lstrip("-") in assert_error(response, 400, "parse_error")["error"]


def test_a_number_too_long_to_parse_is_named_without_python_internals(client, write_token):
    response = client.post(
        API + "dead-jobs/requeue/",
        '{"ids": [' + "9" * 5000 + "]}",
        content_type="application/json",
        headers={"Authorization": f"Bearer {write_token}"},
    )
    data = assert_error(response, 400, "parse_error")
    assert "more than 4300 digits" in data["error"]
    assert "sys." not in data["error"]


@pytest.mark.parametrize("since", ["2026-11-30T10:00:00Z\x00", "2026-11-30T10:00:00Z\n", " "])
def test_since_with_stray_characters_is_bad_input(client, since):
    token = tokens.create("reader", "read")[1]
    response = client.get(
        API + "dead-jobs/", {"since": since}, headers={"Authorization": f"Bearer {token}"}
    )
    data = assert_error(response, 400, "invalid")
    assert list(data["fields"]) == ["since"]


# --- JSON with DEBUG on, and the trailing slash -----------------------------------------------


@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_every_answer_is_json_whatever_debug_says(client, settings, write_token, debug):
    settings.DEBUG = debug
    job = enqueueing.enqueue("test.echo")
    auth = {"Authorization": f"Bearer {write_token}"}
    for path in ("/internal/v1/nope/", "/", "/internal/v1/jobs/abc/"):
        data = assert_error(client.get(path, headers=auth), 404, "not_found")
        assert data["error"] == f"no such endpoint: {path}"
    assert_error(client.get(API + "queue/", headers={**auth, "Host": "evil.example"}), 400)
    # A POST without the trailing slash: never redirected (its body would be lost), never
    # carried out, a 404 naming the path to use.
    missing = client.post(f"{API}jobs/{job.pk}/cancel", headers=auth)
    data = assert_error(missing, 404, "not_found")
    assert data["error"].endswith(f"(every path ends with a slash: {API}jobs/{job.pk}/cancel/)")
    assert Job.objects.get(pk=job.pk).state == State.QUEUED
    # A GET is redirected, with a JSON body.
    moved = client.get(API + "queue", headers=auth)
    assert moved.status_code == 301 and moved["Location"] == API + "queue/"
    assert moved["Content-Type"] == "application/json"
    assert json.loads(moved.content) == {"location": API + "queue/"}
    # … whose length is the body's: a stale one (0) breaks keep-alive connections.
    assert moved["Content-Length"] == str(len(moved.content))


def test_a_failing_health_probe_is_one_warning_with_its_reasons(client, caplog):
    """No live worker is the normal state between deploys: a load balancer probing every
    few seconds must not fill the error log (Django logs a 503 as an error)."""
    with caplog.at_level(logging.INFO, logger="django.request"), capture_logs() as logs:
        response = client.get(API + "health/")
    assert (response.status_code, response.json()) == (503, {"status": "failing"})
    assert not [r for r in caplog.records if r.name == "django.request"]
    failing = [log for log in logs if log["event"] == "api_health_failing"]
    assert [(log["log_level"], log["reasons"]) for log in failing] == [
        ("warning", ["no_live_worker"])
    ]


def test_the_schema_lists_the_errors_every_endpoint_can_answer(client):
    document = client.get(API + "schema/").json()
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            statuses = set(operation["responses"])
            assert {"401", "405"} <= statuses, (path, statuses)
            if method == "post":
                assert {"400", "403", "413", "415"} <= statuses, (path, statuses)


def test_the_schema_generates_without_a_warning():
    """drf-spectacular falls back silently (a warning on stderr) when a view's schema is
    lost, e.g. a decorator left on the wrong method: the endpoint then vanishes from it."""
    done = subprocess.run(
        [sys.executable, "manage.py", "spectacular", "--validate", "--fail-on-warn"],
        cwd=REPO,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize(
    ("accept", "status"),
    [
        ("application/json;q=0, text/html", 406),
        ("application/json; q=0.000", 406),
        ("application/json;q=0.5, text/html", 200),
        ("*/*;q=0", 406),
        ("*/*", 200),
    ],
)
def test_an_accept_weight_of_zero_excludes_json(client, accept, status):
    token = tokens.create("reader", "read")[1]
    response = client.get(
        API + "queue/", headers={"Authorization": f"Bearer {token}", "Accept": accept}
    )
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/json"
