"""Fuzz the internal API from its own OpenAPI schema (schemathesis) against a live server.

Each operation gets a bounded number of generated requests, valid ones (positive) and
schema-violating ones (negative), sent with a write token to a real server over real rows.
Every response must be a non-5xx whose status, content type, headers and body the schema
documents (schemathesis's default checks). Valid requests that name an id aim at the real
rows half of the time, so that the 200 shapes are checked too, not only the 404s.

schemathesis's own pytest integration (``schema.parametrize()``) does not run on pytest
9.2 (it sets ``node._nodeid``), so the tests drive its Hypothesis strategies directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import BaseSchema, GenerationMode

from ingestion import reconciliation
from jobs import engine, enqueueing
from jobs.models import Worker
from ops import tokens

from .helpers import claim_one, failure

MAX_EXAMPLES = 25  # per operation and mode: about 400 requests in all


@dataclass
class Rows:
    jobs: list[int]  # dead, running, queued
    issues: list[int]  # open, resolved


@pytest.fixture
def write_token(transactional_db: None) -> str:
    _, token = tokens.create("fuzzer", "write")
    return token


@pytest.fixture
def rows(transactional_db: None) -> Rows:
    dead = enqueueing.enqueue("test.fail")
    for _ in range(3):
        engine.fail(claim_one(), failure(), backoff_seconds=0)
    running = enqueueing.enqueue("test.echo")
    claim_one("w-fuzz")
    queued = enqueueing.enqueue("test.echo")
    open_issue = reconciliation.record("quarantined_submission", "a.json", details={"why": "x"})
    resolved = reconciliation.record("gone_at_source", "https://example.org/x", source="docs")
    reconciliation.resolve(resolved.pk, by="someone", comment="fixed")
    Worker.objects.create(id="w-live", host="h", pid=1)  # health/ is 200 with a live worker
    return Rows(jobs=[dead.pk, running.pk, queued.pk], issues=[open_issue.pk, resolved.pk])


@pytest.fixture
def api_schema(live_server, rows: Rows) -> BaseSchema:
    """The schema as the live server serves it (so the schema endpoint is tested too)."""
    return schemathesis.openapi.from_url(f"{live_server.url}/internal/v1/schema/")


# Every operation of the API, with its id path parameter if it has one, and whether it
# takes any input that a negative case could break. test_api.py checks the schema's paths.
OPERATIONS = [
    ("GET", "/internal/v1/queue/", None, False),
    ("GET", "/internal/v1/dead-jobs/", None, True),
    ("POST", "/internal/v1/dead-jobs/requeue/", None, True),
    ("GET", "/internal/v1/jobs/{job_id}/", "job_id", True),
    ("POST", "/internal/v1/jobs/{job_id}/requeue/", "job_id", True),
    ("POST", "/internal/v1/jobs/{job_id}/cancel/", "job_id", True),
    ("GET", "/internal/v1/reconciliation-issues/", None, True),
    ("POST", "/internal/v1/reconciliation-issues/{issue_id}/resolve/", "issue_id", True),
    ("GET", "/internal/v1/health/", None, False),
    ("GET", "/internal/v1/metrics/", None, False),
    ("GET", "/internal/v1/search/", None, True),
]
CASES = [
    pytest.param(method, path, param, mode, id=f"{method} {path} {mode.value}")
    for method, path, param, takes_input in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if takes_input or mode is GenerationMode.POSITIVE
]


def test_the_fuzzed_operations_are_all_the_schema_has(api_schema: BaseSchema) -> None:
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == {(method, path) for method, path, _, _ in OPERATIONS}


@pytest.mark.parametrize(("method", "path", "param", "mode"), CASES)
def test_every_response_is_documented_and_none_is_a_server_error(
    api_schema: BaseSchema,
    rows: Rows,
    write_token: str,
    method: str,
    path: str,
    param: str | None,
    mode: GenerationMode,
) -> None:
    operation = api_schema[path][method]
    strategy = operation.as_strategy(generation_mode=mode)
    if param is not None and mode is GenerationMode.POSITIVE:
        existing = rows.jobs if param == "job_id" else rows.issues
        aimed = [operation.as_strategy(path_parameters={param: pk}) for pk in existing]
        strategy = st.one_of(strategy, st.one_of(*aimed))
    headers = {"Authorization": f"Bearer {write_token}"}

    @given(case=strategy)
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,  # the same requests on every run: a failure here reproduces
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(headers=headers, timeout=10)

    check()
