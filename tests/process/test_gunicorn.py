"""The API served for real: gunicorn with deploy/gunicorn.conf.py, behind a (simulated) TLS
proxy, runs the auth matrix, keeps https in pagination links, serves metrics, and logs a
refused token as JSON on stderr without its secret."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobs import engine, enqueueing
from jobs.models import Worker
from ops import tokens
from tests.conftest import REPO
from tests.integration.helpers import claim_one, failure
from tests.support.pgcluster import free_port

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

GUNICORN = str(Path(sys.executable).with_name("gunicorn"))
PROXY = {"X-Forwarded-Proto": "https", "Host": "localhost"}


class Served:
    def __init__(self, url: str, process: subprocess.Popen, log: Path) -> None:
        self.url, self.process, self.log = url, process, log

    def get(self, path: str, token: str | None = None, **headers: str) -> httpx.Response:
        return self.request("GET", path, token, **headers)

    def request(self, method: str, path: str, token: str | None = None, **headers: str):
        sent = {**PROXY, **headers}
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        return httpx.request(method, self.url + path, headers=sent, timeout=10)


@pytest.fixture
def gunicorn(worker_env: dict[str, str], tmp_path: Path) -> Iterator[Served]:
    port = free_port()
    env = {
        **worker_env,
        "HOLDFAST_API_BIND": f"127.0.0.1:{port}",
        "HOLDFAST_API_WORKERS": "2",
        "HOLDFAST_BEHIND_TLS_PROXY": "1",
        "DJANGO_DEBUG": "0",
    }
    log = tmp_path / "gunicorn.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [GUNICORN, "-c", "deploy/gunicorn.conf.py", "config.wsgi:application"],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stderr,
            stderr=stderr,
        )
    served = Served(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + 30
    while True:
        try:
            served.get("/internal/v1/schema/")
            break
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                output = log.read_text()[-3000:]
                raise AssertionError(f"gunicorn did not start:\n{output}") from None
            time.sleep(0.2)
    try:
        yield served
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_gunicorn_serves_the_auth_matrix_behind_a_tls_proxy(gunicorn: Served) -> None:
    _, read = tokens.create("reader", "read")
    _, write = tokens.create("ops-bot", "write")
    _, revoked = tokens.create("old-bot", "write")
    tokens.revoke("old-bot")
    Worker.objects.create(id="live", host="h", pid=1)
    dead = []
    for _ in range(2):
        job = enqueueing.enqueue("test.permanent")
        engine.fail(claim_one(), failure(permanent=True), backoff_seconds=0)
        dead.append(job.pk)
    queued = enqueueing.enqueue("test.echo")

    # Without a token, a bad one, a revoked one: 401, JSON, with the bearer challenge.
    for token in (None, "hf_abcdefgh_" + "z" * 43, revoked):
        response = gunicorn.get("/internal/v1/queue/", token)
        assert response.status_code == 401, response.text
        assert response.headers["Content-Type"] == "application/json"
        assert response.headers["WWW-Authenticate"] == 'Bearer realm="holdfast"'
    # Read: GET yes, POST no. Write: both.
    assert gunicorn.get("/internal/v1/queue/", read).status_code == 200
    refused = gunicorn.request("POST", f"/internal/v1/jobs/{queued.pk}/cancel/", read)
    assert refused.status_code == 403 and refused.json()["code"] == "permission_denied"
    cancelled = gunicorn.request("POST", f"/internal/v1/jobs/{queued.pk}/cancel/", write)
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    requeued = gunicorn.request("POST", f"/internal/v1/jobs/{dead[0]}/requeue/", write)
    assert requeued.status_code == 200 and requeued.json()["state"] == "queued"
    assert gunicorn.get("/internal/v1/health/").json() == {"status": "ok"}

    # Pagination links keep the client's scheme (https through the proxy), HSTS is sent.
    engine.fail(claim_one(), failure(permanent=True), backoff_seconds=0)
    page = gunicorn.get("/internal/v1/dead-jobs/?page_size=1", read)
    assert page.status_code == 200
    assert page.json()["next"].startswith("https://localhost/internal/v1/dead-jobs/")
    assert "max-age=" in page.headers["Strict-Transport-Security"]
    # Plain http (not through the proxy) is redirected to https.
    plain = httpx.get(gunicorn.url + "/internal/v1/queue/", headers={"Host": "localhost"})
    assert plain.status_code == 301 and plain.headers["Location"].startswith("https://")

    # Metrics in Prometheus's format.
    metrics = gunicorn.get("/internal/v1/metrics/", read, Accept="text/plain")
    assert metrics.status_code == 200
    names = {family.name for family in text_string_to_metric_families(metrics.text)}
    assert {"holdfast_jobs", "holdfast_job_attempts"} <= names

    # An unknown route and an error: JSON.
    missing = gunicorn.get("/nowhere/")
    assert missing.status_code == 404 and missing.headers["Content-Type"] == "application/json"

    gunicorn.process.send_signal(signal.SIGTERM)
    gunicorn.process.wait(timeout=30)
    # Every line is JSON, gunicorn's own included (docs/deployment.md pipes them into jq).
    lines = [json.loads(line) for line in gunicorn.log.read_text().splitlines()]
    assert any(line.get("logger") == "gunicorn.error" for line in lines)
    failed = [line for line in lines if line["event"] == "api_auth_failed"]
    assert [line["reason"] for line in failed] == ["no token", "unknown", "revoked"]
    text = gunicorn.log.read_text()
    for secret in (read, write, revoked):
        assert secret.split("_", 2)[2] not in text


def raw_exchange(served: Served, request: bytes, wait: float = 20) -> tuple[int, dict, float]:
    """Send ``request`` on a socket of its own; the answer's status, JSON body, and seconds."""
    host, port = served.url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Content-Type: application/json" in head, answer[:500]
    return int(head.split()[1]), json.loads(body), time.monotonic() - started


def test_gunicorn_answers_json_on_what_it_refuses_itself(gunicorn: Served) -> None:
    """A request line or headers over gunicorn's limits never reach Django: gunicorn used to
    answer them with an HTML page."""
    _, read = tokens.create("reader", "read")
    too_long = gunicorn.get("/internal/v1/dead-jobs/?lane=" + "a" * 9000, read)
    assert too_long.status_code == 400
    assert too_long.headers["Content-Type"] == "application/json"
    assert "Request Line is too large" in too_long.json()["error"]
    huge_header = gunicorn.get("/internal/v1/queue/", read, **{"X-Padding": "p" * 9000})
    assert huge_header.status_code == 431
    assert huge_header.json()["code"] == "headers_too_large"
    # A query within the API's own limit of 1,000 characters fits the request line.
    search = gunicorn.get("/internal/v1/search/?q=" + "é" * 1000, read)
    assert search.status_code == 200, search.text


def test_gunicorn_reads_a_chunked_body_as_sent(gunicorn: Served) -> None:
    _, write = tokens.create("ops-bot", "write")
    job = enqueueing.enqueue("test.permanent")
    engine.fail(claim_one(), failure(permanent=True), backoff_seconds=0)
    body = json.dumps({"ids": [job.pk], "dry_run": True}).encode()
    response = httpx.post(
        gunicorn.url + "/internal/v1/dead-jobs/requeue/",
        content=iter([body[:5], body[5:]]),  # an iterable: sent chunked, no Content-Length
        headers={**PROXY, "Authorization": f"Bearer {write}", "Content-Type": "application/json"},
        timeout=10,
    )
    assert response.request.headers.get("Transfer-Encoding") == "chunked"
    assert response.status_code == 200, response.text
    assert response.json() == {
        "requeued": [job.pk],
        "dry_run": True,
        "conflicts": [],
        "more": False,
        "last_id": job.pk,
    }


def test_a_client_that_stops_sending_holds_one_request_for_a_bounded_time(
    gunicorn: Served,
) -> None:
    """Half a body, then silence: a JSON 400 after the read timeout (a third of gunicorn's
    30 s), not an HTML 500 when the arbiter kills the worker; a stalled request line just
    closes. Meanwhile the other worker serves everyone else."""
    _, write = tokens.create("ops-bot", "write")
    head = (
        "POST /internal/v1/reconciliation-issues/1/resolve/ HTTP/1.1\r\nHost: localhost\r\n"
        "X-Forwarded-Proto: https\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {write}\r\nContent-Length: 100\r\n\r\n"
    )
    status, body, took = raw_exchange(gunicorn, head.encode() + b'{"comm')
    assert (status, body["code"]) == (400, "parse_error"), body
    assert 8 < took < 20, took
    host, port = gunicorn.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(b"GET /internal/v1/health/ HTTP/1.1\r\nHost: localhost\r\n")
        started = time.monotonic()
        assert sock.recv(100) == b""  # closed, without an answer to half a request
        assert 8 < time.monotonic() - started < 20
    gunicorn.process.send_signal(signal.SIGTERM)
    gunicorn.process.wait(timeout=30)
    lines = [json.loads(line) for line in gunicorn.log.read_text().splitlines()]
    slow = [line for line in lines if line["event"].startswith("client too slow")]
    assert [line["level"] for line in slow] == ["warning"]
    assert not [line for line in lines if line["level"] in ("error", "critical")], lines
