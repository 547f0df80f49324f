"""Operator requeues are per job (issue 12): one job that cannot be requeued (its unique
key is held by a live job) is reported, and the others are requeued all the same; the
command exits 1, and the API answers 409, only when nothing could be requeued."""

from __future__ import annotations

import tracemalloc

import pytest
from django.db import connection
from django.test import Client

from jobs import counts, enqueueing
from jobs.models import Job, State
from ops import tokens
from tests.conftest import on_postgres

from .helpers import exit_code, run, run_json
from .test_api import call

pytestmark = pytest.mark.django_db


@pytest.fixture
def client() -> Client:
    return Client(enforce_csrf_checks=True)


@pytest.fixture
def write_token() -> str:
    return tokens.create("ops-bot", "write")[1]


@pytest.fixture
def read_token() -> str:
    return tokens.create("reader", "read")[1]


def dead(kind: str = "test.echo", unique_key: str | None = None) -> Job:
    job = enqueueing.enqueue(kind, {"n": unique_key or "plain"}, unique_key=unique_key)
    assert job is not None
    Job.objects.filter(pk=job.pk).update(state=State.DEAD, last_error="RuntimeError: boom")
    job.refresh_from_db()
    return job


def three_dead_one_blocked() -> tuple[Job, Job, Job, Job]:
    """Three dead jobs, the second of which shares its unique key with a queued job."""
    first, blocked, last = dead(), dead(unique_key="report:7"), dead(unique_key="report:8")
    holder = enqueueing.enqueue("test.echo", {"n": "again"}, unique_key="report:7")
    assert holder is not None and holder.pk != blocked.pk
    return first, blocked, last, holder


def test_one_conflict_among_several_dead_jobs_is_reported_and_the_rest_requeued():
    first, blocked, last, holder = three_dead_one_blocked()
    dry = run_json("requeue_dead", "--all", "--dry-run")
    assert dry["requeued"] == [first.pk, last.pk] and dry["dry_run"] is True
    assert [c["id"] for c in dry["conflicts"]] == [blocked.pk]
    assert Job.objects.filter(state=State.DEAD).count() == 3

    data = run_json("requeue_dead", "--all")
    assert data["requeued"] == [first.pk, last.pk] and data["dry_run"] is False
    [conflict] = data["conflicts"]
    assert conflict["id"] == blocked.pk
    assert "report:7" in conflict["reason"] and str(holder.pk) in conflict["reason"]
    states = dict(Job.objects.values_list("pk", "state"))
    assert states == {
        first.pk: State.QUEUED,
        blocked.pk: State.DEAD,
        last.pk: State.QUEUED,
        holder.pk: State.QUEUED,
    }


def test_the_text_output_names_each_conflict():
    _, blocked, _, _ = three_dead_one_blocked()
    out = run("requeue_dead", "--all")
    assert "requeued 2 job(s)" in out
    assert f"not requeued: job {blocked.pk}: its unique key 'report:7' is held by job" in out


def test_when_every_job_conflicts_nothing_is_requeued_and_it_exits_1():
    _, blocked, _, _ = three_dead_one_blocked()
    assert exit_code("requeue_dead", str(blocked.pk)) == 1
    assert exit_code("requeue_dead", str(blocked.pk), "--json") == 1
    assert Job.objects.get(pk=blocked.pk).state == State.DEAD
    # Two dead jobs with one key: the first is requeued, the second conflicts with it.
    again = dead(unique_key="report:9")
    Job.objects.filter(pk=again.pk).update(unique_key=None)
    twin = dead(unique_key="report:9")
    Job.objects.filter(pk=again.pk).update(unique_key="report:9")
    data = run_json("requeue_dead", str(again.pk), str(twin.pk))
    assert data["requeued"] == [again.pk]
    assert [c["id"] for c in data["conflicts"]] == [twin.pk]


def test_named_jobs_that_are_not_dead_are_conflicts_beside_the_requeued_ones():
    gone = dead()
    alive = enqueueing.enqueue("test.echo")
    data = run_json("requeue_dead", str(gone.pk), str(alive.pk))
    assert data["requeued"] == [gone.pk]
    assert data["conflicts"] == [
        {"id": alive.pk, "reason": f"job {alive.pk} is queued, not dead: nothing to requeue"}
    ]


def test_a_named_dead_job_outside_the_kind_or_lane_given_is_not_requeued():
    """``requeue_dead 5 --kind K``: job 5 of another kind was requeued all the same (audit)."""
    echo, noop = dead("test.echo"), dead("test.noop")
    data = run_json("requeue_dead", str(echo.pk), str(noop.pk), "--kind", "test.noop")
    assert data["requeued"] == [noop.pk]
    assert data["conflicts"] == [
        {"id": echo.pk, "reason": f"job {echo.pk} is not of --kind test.noop: not requeued"}
    ]
    echo.refresh_from_db()
    assert echo.state == State.DEAD
    assert exit_code("requeue_dead", str(echo.pk), "--lane", "default", "--kind", "test.noop") == 1


def test_the_api_requeues_no_named_dead_job_outside_the_kind_given(client, write_token):
    echo, noop = dead("test.echo"), dead("test.noop")
    body = {"ids": [echo.pk, noop.pk], "kind": "test.noop"}
    response = call(client, "POST", "dead-jobs/requeue/", write_token, body)
    assert response.status_code == 200, response.content
    data = response.json()
    assert data["requeued"] == [noop.pk]
    assert data["conflicts"] == [
        {"id": echo.pk, "reason": f"job {echo.pk} is not of kind test.noop: not requeued"}
    ]
    assert Job.objects.get(pk=echo.pk).state == State.DEAD


ERROR_CHARS = 20_000


def fill_dead_jobs(n: int) -> None:
    """``n`` dead jobs, each with a 20,000-character last error, in one statement."""
    columns = (
        "kind, lane, args, priority, state, run_at, attempts, max_attempts, lease_seconds, "
        "lease_token, cancel_requested, last_error, created_at, updated_at, finished_at, locks"
    )
    with connection.cursor() as cursor:
        if on_postgres():
            cursor.execute(
                f"INSERT INTO jobs_job ({columns}) SELECT 'test.echo', 'default', '{{}}', 0, "
                "'dead', now(), 3, 3, 60, 3, false, repeat('x', %s), now(), now(), now(), '[]' "
                "FROM generate_series(1, %s)",
                [ERROR_CHARS, n],
            )
        else:
            cursor.execute(
                "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < %s) "
                f"INSERT INTO jobs_job ({columns}) SELECT 'test.echo', 'default', '{{}}', 0, "
                "'dead', '2026-01-01 00:00:00', 3, 3, 60, 3, 0, printf('%%.*c', %s, 'x'), "
                "'2026-01-01 00:00:00', '2026-01-01 00:00:00', '2026-01-01 00:00:00', '[]' FROM c",
                [n, ERROR_CHARS],
            )
    counts.recount()


def test_requeue_all_reads_dead_jobs_in_batches_of_the_columns_it_needs():
    """3,000 dead jobs carrying 60 MB of error text: ``--all`` read every whole row into
    one list (a 65 MB peak; a million dead jobs after an incident, gigabytes) (audit)."""
    fill_dead_jobs(3000)
    tracemalloc.start()
    try:
        data = run_json("requeue_dead", "--all", "--dry-run")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(data["requeued"]) == 3000
    assert peak < 20 * 1024 * 1024, f"peak {peak / 1e6:.0f} MB"
    data = run_json("requeue_dead", "--all")
    assert len(data["requeued"]) == 3000 and data["conflicts"] == []
    assert Job.objects.filter(state=State.QUEUED).count() == 3000
    assert counts.by_lane().get(("default", "dead"), 0) == 0


def test_the_api_requeues_per_job_and_is_409_only_when_nothing_was(client, write_token):
    first, blocked, last, _ = three_dead_one_blocked()
    response = call(client, "POST", "dead-jobs/requeue/", write_token, {"all": True})
    assert response.status_code == 200, response.content
    data = response.json()
    assert data["requeued"] == [first.pk, last.pk] and data["dry_run"] is False
    assert [c["id"] for c in data["conflicts"]] == [blocked.pk]

    body = {"ids": [blocked.pk]}
    response = call(client, "POST", "dead-jobs/requeue/", write_token, body)
    assert response.status_code == 409, response.content
    data = response.json()
    assert data["code"] == "conflict" and "report:7" in data["error"]
    assert data["requeued"] == [] and [c["id"] for c in data["conflicts"]] == [blocked.pk]
    # The one-job endpoint says why, too.
    response = call(client, "POST", f"jobs/{blocked.pk}/requeue/", write_token)
    assert response.status_code == 409 and "report:7" in response.json()["error"]
    assert Job.objects.get(pk=blocked.pk).state == State.DEAD


def test_the_api_requeues_nothing_for_a_body_that_chooses_nothing(client, write_token, read_token):
    job = dead()
    response = call(client, "POST", "dead-jobs/requeue/", write_token, {})
    assert response.status_code == 200
    assert response.json() == {
        "requeued": [],
        "dry_run": False,
        "conflicts": [],
        "more": False,
        "last_id": None,
    }
    assert Job.objects.get(pk=job.pk).state == State.DEAD
    response = call(client, "POST", "dead-jobs/requeue/", write_token, {"ids": [999999]})
    assert response.status_code == 404
    response = call(client, "POST", "dead-jobs/requeue/", read_token, {"all": True})
    assert response.status_code == 403


def test_the_api_requeues_a_filter_in_bounded_batches_going_on_from_last_id(client, write_token):
    """One request stays short however many jobs died (55,000 ran past gunicorn's 30 s
    timeout: a 500, and no telling which were requeued): ``limit`` a request, oldest first,
    ``after`` the previous answer's ``last_id``; conflicts do not make a loop repeat."""
    _, blocked, _, _ = three_dead_one_blocked()
    dead_ids = sorted(Job.objects.filter(state=State.DEAD).values_list("pk", flat=True))
    seen: list[int] = []
    after = 0
    for _ in range(10):
        body = {"all": True, "limit": 1, "after": after}
        data = call(client, "POST", "dead-jobs/requeue/", write_token, body).json()
        seen += data["requeued"] + [c["id"] for c in data["conflicts"]]
        if not data["more"]:
            break
        after = data["last_id"]
    assert sorted(seen) == dead_ids and not data["more"]
    assert Job.objects.get(pk=blocked.pk).state == State.DEAD
    for bad in (
        {"all": True, "limit": 0},
        {"all": True, "limit": 5001},
        {"all": True, "after": -1},
    ):
        response = call(client, "POST", "dead-jobs/requeue/", write_token, bad)
        assert response.status_code == 400, response.content
