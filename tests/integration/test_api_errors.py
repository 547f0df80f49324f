"""Every error status of the internal API is JSON (DESIGN §9), also those Django raises
before a view runs; the logs of a 500 and a 401 reach stderr with DEBUG off."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from django.conf import settings
from django.test import Client
from structlog.testing import capture_logs

from jobs import enqueueing
from ops import tokens, views
from tests.conftest import REPO

pytestmark = pytest.mark.django_db

API = "/internal/v1/"
DEEP = "[" * 10_000 + "]" * 10_000


@pytest.fixture
def write_token() -> str:
    return tokens.create("ops-bot", "write")[1]


@pytest.fixture
def read_token() -> str:
    return tokens.create("reader", "read")[1]


def boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a bug in the view")


def request(method: str, path: str, token: str | None = None, **extra: Any):
    headers = dict(extra.pop("headers", {}))
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    client = Client(raise_request_exception=False)
    return client.generic(method, path, headers=headers, **extra)


def assert_json_error(response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"] == "application/json", response.content[:300]
    data = json.loads(response.content)
    assert isinstance(data["error"], str) and data["error"] and "\n" not in data["error"]
    if code is not None:
        assert data["code"] == code
    return data


ISSUE_RESOLVE = API + "reconciliation-issues/1/resolve/"
TOO_MANY = "&".join(f"p{i}=1" for i in range(settings.DATA_UPLOAD_MAX_NUMBER_FIELDS + 1))
BIG = b'{"comment": "' + b"x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1) + b'"}'

# (status, method, path, token kind (None: no token), extra request arguments)
MATRIX = [
    (400, "GET", API + "dead-jobs/?bogus=1", "read", {}),
    (400, "GET", API + "health/?" + TOO_MANY, None, {}),  # TooManyFieldsSent, no token
    (400, "GET", API + "queue/?" + TOO_MANY, "read", {}),
    (400, "GET", API + "health/", None, {"headers": {"Host": "evil.example"}}),  # DisallowedHost
    (400, "GET", API + "queue/", "read", {"headers": {"Host": "evil.example"}}),
    (400, "POST", ISSUE_RESOLVE, "write", {"data": DEEP, "content_type": "application/json"}),
    (401, "GET", API + "queue/", None, {}),
    (401, "GET", API + "health/", "bad", {}),
    (403, "POST", ISSUE_RESOLVE, "read", {"data": "{}", "content_type": "application/json"}),
    (404, "GET", API + "no-such-thing/", None, {}),
    (404, "GET", "/elsewhere/", "read", {}),
    (404, "GET", API + "jobs/999999/", "read", {}),
    (405, "DELETE", API + "health/", None, {}),
    (405, "PUT", API + "queue/", "write", {}),
    (406, "GET", API + "health/", None, {"headers": {"Accept": "text/html"}}),
    (406, "GET", API + "queue/", "read", {"headers": {"Accept": "text/html"}}),
    (413, "POST", ISSUE_RESOLVE, "write", {"data": BIG, "content_type": "application/json"}),
    (415, "POST", ISSUE_RESOLVE, "write", {"data": "comment=x", "content_type": "text/plain"}),
]


@pytest.mark.parametrize(
    ("status", "method", "path", "who", "extra"),
    MATRIX,
    ids=[
        f"{s}-{m}-{'token' if w else 'anonymous'}-{i}" for i, (s, m, _, w, _) in enumerate(MATRIX)
    ],
)
def test_every_error_status_is_json(status, method, path, who, extra, read_token, write_token):
    enqueueing.enqueue("test.echo")
    from ingestion import reconciliation

    reconciliation.record("quarantined_submission", "a.json", details={})
    token = {"read": read_token, "write": write_token, "bad": "hf_bad", None: None}[who]
    assert_json_error(request(method, path, token, **extra), status)


@pytest.mark.parametrize("who", ["read", None])
def test_a_500_is_json_with_and_without_a_token(monkeypatch, read_token, who):
    monkeypatch.setattr(views, "queue_status", boom)
    monkeypatch.setattr(views, "spool_health", boom)
    path = API + ("queue/" if who else "health/")
    if who is None:  # health/ without a token reads nothing but the database: break that
        monkeypatch.setattr(views.HealthView, "get", lambda self, request: boom())
    response = request("GET", path, read_token if who else None)
    assert_json_error(response, 500, "server_error")


LOG_SCRIPT = """
import django, sys
django.setup()
from django.test import Client
from structlog.testing import capture_logs
from ops import tokens, views
from tests.conftest import REPO

def boom(*args, **kwargs):
    raise RuntimeError("a bug in the view")

views.queue_status = boom
read = tokens.create("reader", "read")[1]
revoked = tokens.create("old-bot", "read")[1]
tokens.revoke("old-bot")
client = Client(raise_request_exception=False)
for token in (read, revoked, "hf_abcdefgh_" + "y" * 43):
    client.get("/internal/v1/queue/", headers={"Authorization": f"Bearer {token}"})
print(read)
print(revoked)
"""


def test_logs_with_debug_off_hold_the_500_traceback_and_the_401(worker_env):
    """Through the real LOGGING set-up, in a process of its own: JSON lines on stderr."""
    env = {**worker_env, "DJANGO_DEBUG": "0", "LOG_LEVEL": "INFO"}
    done = subprocess.run(
        [sys.executable, "-c", LOG_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    read, revoked = done.stdout.split()
    err = done.stderr
    lines = [json.loads(line) for line in err.splitlines()]  # every line is JSON
    errors = [line for line in lines if line.get("logger") == "django.request"]
    server_errors = [line for line in errors if line.get("status") == 500]
    assert len(server_errors) == 1, err[-2000:]
    assert server_errors[0]["level"] == "error"
    assert "Traceback" in server_errors[0]["exception"]
    assert "RuntimeError: a bug in the view" in server_errors[0]["exception"]
    failed = [line for line in lines if line["event"] == "api_auth_failed"]
    assert [(line["reason"], line["token_prefix"]) for line in failed] == [
        ("revoked", revoked.split("_")[1]),
        ("unknown", "abcdefgh"),
    ]
    assert all(line["client"] == "127.0.0.1" and line["level"] == "warning" for line in failed)
    assert [line["status"] for line in errors if line["level"] == "warning"] == [401, 401]
    for token in (read, revoked, "y" * 43):
        assert token.split("_", 2)[-1] not in err


def test_an_unknown_kind_or_lane_filter_is_refused_not_an_empty_page(read_token, write_token):
    """As ``requeue_dead``/``list_jobs`` exit 2: a typo in a filter must not read as "no
    dead jobs". Known kinds and lanes with nothing dead stay an empty page (200)."""
    data = assert_json_error(request("GET", API + "dead-jobs/?kind=test.ecoh", read_token), 404)
    assert "test.ecoh" in data["error"]
    data = assert_json_error(request("GET", API + "dead-jobs/?lane=defualt", read_token), 404)
    assert "defualt" in data["error"]
    body = {"data": json.dumps({"kind": "test.ecoh"}), "content_type": "application/json"}
    data = assert_json_error(request("POST", API + "dead-jobs/requeue/", write_token, **body), 404)
    assert "test.ecoh" in data["error"]
    body = {"data": json.dumps({"lane": "defualt"}), "content_type": "application/json"}
    data = assert_json_error(request("POST", API + "dead-jobs/requeue/", write_token, **body), 404)
    assert "defualt" in data["error"]
    # Also past `after`, as a script's next batch asks: it was an empty 200 (audit).
    body = {
        "data": json.dumps({"kind": "test.ecoh", "after": 5}),
        "content_type": "application/json",
    }
    data = assert_json_error(request("POST", API + "dead-jobs/requeue/", write_token, **body), 404)
    assert "test.ecoh" in data["error"]

    # A module of an installed app that fails to import (auth's admin.py, without the
    # admin app: LookupError) is not a task: it was a 500 (helper-25 #1).
    for module in ("django.contrib.auth.admin", "rest_framework.authtoken.admin"):
        path = f"dead-jobs/?kind={module}.X"
        data = assert_json_error(request("GET", API + path, read_token), 404)
        assert f"{module}.X" in data["error"]

    for path in ("dead-jobs/?kind=test.echo", "dead-jobs/?lane=default&kind=test.echo"):
        response = request("GET", API + path, read_token)
        assert response.status_code == 200 and response.json()["jobs"] == []
    body = {"data": json.dumps({"kind": "test.echo"}), "content_type": "application/json"}
    response = request("POST", API + "dead-jobs/requeue/", write_token, **body)
    assert response.status_code == 200 and response.json()["requeued"] == []


@pytest.mark.parametrize(
    ("query", "field", "says"),
    [
        ("kind=%ff", "query", "not valid UTF-8"),
        ("q=caf%e9", "query", "not valid UTF-8"),
        ("page=-1", "page", "greater than or equal to 1"),
        ("page=0", "page", "greater than or equal to 1"),
        ("page=" + "9" * 25, "page", "less than or equal to"),
        ("page=1.5", "page", "whole number"),
    ],
)
def test_a_bad_query_value_is_named_as_what_it_is(read_token, query, field, says):
    """%ff is not read as U+FFFD (a filter on a replacement character); -1 is a whole
    number below the bound, not "not a whole number"."""
    data = assert_json_error(request("GET", API + f"dead-jobs/?{query}", read_token), 400)
    assert data["code"] == "invalid"
    assert says in data["fields"][field][0], data


# --- found by an audit of the API (each was a 500, a wrong status, or a refusal unseen) ----


@pytest.mark.parametrize("path", ["dead-jobs/requeue/", "reconciliation-issues/1/resolve/"])
def test_a_body_field_named_by_a_lone_surrogate_is_a_400(write_token, path):
    """JSON's ``"\\ud800"`` as a key: named back in the error, UTF-8 could not encode it."""
    body = b'{"comment": "ok", "\\ud800": 1}'
    response = request("POST", API + path, write_token, data=body, content_type="application/json")
    data = assert_json_error(response, 400, "invalid")
    assert "\\ud800" in data["fields"]


@pytest.mark.parametrize("query", ["version=%0A", "version=a%0D%0AX-Injected:%20yes", "lang=fr"])
def test_the_schema_takes_no_query_parameter(query):
    """drf-spectacular copied ``?version=`` into a header: a newline there was a 500."""
    data = assert_json_error(request("GET", API + "schema/?" + query), 400, "invalid")
    assert "unknown parameter" in data["error"]
    response = request("GET", API + "schema/")
    assert response.status_code == 200 and "X-Injected" not in response
    assert response["Content-Disposition"] == 'inline; filename="Holdfast internal API.json"'


@pytest.mark.parametrize("path", ["queue/", "health/", "dead-jobs/"])
def test_a_refused_token_is_logged_whatever_the_accept_header(path):
    """DRF negotiates the content type before it reads the token: ``Accept: text/html``
    got a 406 and the refused token was never logged nor counted."""
    with capture_logs() as logs:
        response = request(
            "GET", API + path, "hf_aaaaaaaa_" + "a" * 43, headers={"Accept": "text/html"}
        )
    assert_json_error(response, 401, "authentication_failed")
    assert [e["reason"] for e in logs if e["event"] == "api_auth_failed"] == ["unknown"]


@pytest.mark.parametrize("method", ["PUT", "PATCH", "DELETE"])
def test_a_method_no_endpoint_takes_is_a_405_for_a_read_token_too(read_token, method):
    response = request(method, API + "queue/", read_token)
    assert_json_error(response, 405)
    assert response["Allow"] == "GET, HEAD, OPTIONS"
    assert_json_error(request("POST", API + "dead-jobs/requeue/", read_token), 403)


@pytest.mark.django_db(transaction=True)
def test_a_request_behind_a_held_row_lock_answers_503_before_gunicorn_would_kill_it(
    write_token, monkeypatch
):
    """PostgreSQL: a requeue behind a row lock (a frozen session holding the dead job)
    waited until gunicorn killed the worker at 30 s: a 500, and the API hung meanwhile
    (helper-26 #1). The request's lock waits end first: a 503 to retry."""
    import time

    import psycopg
    from django.db import connection

    from ops import middleware
    from tests.conftest import database_url

    from .test_api import make_dead_job

    if connection.vendor != "postgresql":
        pytest.skip("SQLite: the busy timeout (20 s) ends the wait, answered 503 already")
    monkeypatch.setattr(middleware, "API_LOCK_TIMEOUT_MS", 300)
    dead = make_dead_job()
    with psycopg.connect(database_url(connection.settings_dict)) as holder:
        holder.execute("SELECT 1 FROM jobs_job WHERE id = %s FOR UPDATE", [dead.pk])
        started = time.monotonic()
        response = request("POST", API + f"jobs/{dead.pk}/requeue/", write_token)
        waited = time.monotonic() - started
    assert_json_error(response, 503, "database_unavailable")
    assert waited < 10, waited
    response = request("POST", API + f"jobs/{dead.pk}/requeue/", write_token)
    assert response.status_code == 200, response.content  # the lock gone, it goes through


def test_a_head_answer_keeps_the_length_and_drops_the_body():
    """Django's WSGI handler sent the body of a HEAD answer (gunicorn too): a keep-alive
    client would read it as the next answer (helper-26 #4)."""
    from django.http import HttpResponse
    from django.test import RequestFactory

    from ops.middleware import HeadWithoutBody

    answer = HeadWithoutBody(lambda request: HttpResponse(b'{"ok": true}'))
    head = answer(RequestFactory().head(API + "queue/"))
    assert (head.content, head["Content-Length"]) == (b"", "12")
    get = answer(RequestFactory().get(API + "queue/"))
    assert get.content == b'{"ok": true}'
    # Through the project's own WSGI stack (the test client strips HEAD bodies itself).
    from io import BytesIO

    from config.wsgi import application

    started: list[tuple[str, list[tuple[str, str]]]] = []
    environ = {  # an answer that reads no row: the handler's request_started closes the
        "REQUEST_METHOD": "HEAD",  # test's connection
        "PATH_INFO": API + "no-such-thing/",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "wsgi.input": BytesIO(),
        "wsgi.url_scheme": "http",
    }
    body = b"".join(application(environ, lambda status, headers: started.append((status, headers))))
    [(status, headers)] = started
    assert (status[:3], body) == ("404", b""), (started, body)
    assert int(dict(headers)["Content-Length"]) > 0  # the GET's length, as RFC 9110 allows


def test_a_host_not_allowed_is_a_warning_without_a_traceback():
    """Django logs each at error with its traceback: any scanner filled the error stream
    operators alert on (helper-26 #2). It is a client's 400, a warning like the others."""
    import logging
    import sys

    from django.core.exceptions import DisallowedHost

    try:
        raise DisallowedHost("Invalid HTTP_HOST header: 'scanner.example'.")
    except DisallowedHost:
        exc_info = sys.exc_info()
    from jobs.log import ClientFaultAsWarning

    [handler] = [  # the stderr handler of django.security, where its children propagate
        h
        for h in logging.getLogger("django.security").handlers
        if any(isinstance(f, ClientFaultAsWarning) for f in h.filters)
    ]
    record = logging.LogRecord(
        "django.security.DisallowedHost", logging.ERROR, __file__, 1, "%s", (exc_info[1],), exc_info
    )
    assert handler.filter(record)
    assert (record.levelname, record.exc_info) == ("WARNING", None)
    line = handler.format(record)
    assert "Traceback" not in line and "scanner.example" in line


def test_the_schema_refuses_the_blank_strings_the_server_refuses(read_token):
    """The patterns said only "no NUL": a client checking its requests against the
    schema sent a lane, kind or comment of white space alone and met a 400 (schemathesis
    ST202, helper-26 #5). Python's whitespace is what the server trims."""
    import re

    schema = request("GET", API + "schema/", read_token, headers={"Accept": "application/json"})
    assert schema.status_code == 200, schema.content[:200]
    patterns: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                patterns.add(node["pattern"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(schema.content))
    assert patterns
    spaces = "".join(chr(c) for c in range(0x110000) if chr(c).isspace())
    for pattern in patterns:
        for blank in [" ", "\u3000", "\x85", "\x0b", spaces]:
            assert re.fullmatch(pattern, blank) is None, (pattern, blank)
        for text in ["default", " a ", "x\u3000y", "é"]:
            assert re.fullmatch(pattern, text), (pattern, text)
        assert re.fullmatch(pattern, "a\x00b") is None
