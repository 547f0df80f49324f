"""The command-line contract: JSON shapes and exit codes (DESIGN §8)."""

import pytest

from jobs import engine, enqueueing
from jobs.models import Job, State

from .helpers import claim_one, exit_code, failure, run, run_json

pytestmark = pytest.mark.django_db

JOB_FIELDS = {
    "id", "kind", "lane", "state", "args", "priority", "attempts", "max_attempts",
    "lease_token", "run_at", "unique_key", "created_at", "finished_at", "last_error",
}  # fmt: skip
LEASE_FIELDS = {
    "attempt", "lease_token", "worker_id", "acquired_at", "expires_at", "released_at",
    "outcome", "error_class", "error_message", "traceback",
}  # fmt: skip


def make_dead_job() -> Job:
    job = enqueueing.enqueue("test.fail")
    for _ in range(3):
        engine.fail(claim_one(), failure("no disk"), backoff_seconds=0)
    return Job.objects.get(pk=job.pk)


def test_enqueue_prints_the_id_or_the_job_object():
    job_id = int(run("enqueue", "test.echo", "--args", '{"a": 1}'))
    assert Job.objects.get(pk=job_id).args == {"a": 1}
    data = run_json("enqueue", "test.echo", "--priority", "4", "--unique-key", "u1")
    assert set(data) >= JOB_FIELDS
    assert (data["priority"], data["unique_key"], data["state"]) == (4, "u1", "queued")


@pytest.mark.parametrize(
    "args",
    [
        ("enqueue", "no.such.kind"),
        ("enqueue", "test.echo", "--args", "{bad"),
        ("enqueue", "test.echo", "--args", "[1, 2]"),
        ("enqueue", "test.echo", "--run-at", "tomorrow"),
        ("enqueue", "test.echo", "--run-at", "2030-01-01T00:00:00"),  # no offset
        ("enqueue", "test.echo", "--lane", "nowhere"),
        ("show_job", "999999"),
        ("requeue_dead", "999999"),
        ("requeue_dead",),
    ],
)
def test_bad_input_exits_2(args):
    assert exit_code(*args) == 2


def test_show_job_lists_every_attempt_with_its_error():
    dead = make_dead_job()
    data = run_json("show_job", str(dead.pk))
    assert set(data) >= JOB_FIELDS
    assert data["state"] == "dead"
    assert len(data["leases"]) == 3
    for number, lease in enumerate(data["leases"], start=1):
        assert set(lease) >= LEASE_FIELDS
        assert lease["attempt"] == number
        assert (lease["error_class"], lease["error_message"]) == ("RuntimeError", "no disk")
        assert "Traceback" in lease["traceback"]
    text = run("show_job", str(dead.pk))
    assert "RuntimeError: no disk" in text and "attempts (3)" in text


def test_list_jobs_filters():
    dead = make_dead_job()
    enqueueing.enqueue("test.echo")
    data = run_json("list_jobs", "--state", "dead")
    assert data["count"] == 1 and data["jobs"][0]["id"] == dead.pk
    assert run_json("list_jobs", "--kind", "test.echo")["count"] == 1
    assert "test.fail" in run("list_jobs")


def test_list_jobs_shows_each_last_error_on_one_short_line():
    job = enqueueing.enqueue("test.fail")
    for _ in range(3):
        engine.fail(claim_one(), failure("line one\nline two " + "x" * 70_000), backoff_seconds=0)
    [line] = [row for row in run("list_jobs").splitlines() if row.lstrip().startswith(str(job.pk))]
    assert "line one line two xxx" in line and line.endswith("…") and len(line) < 400
    full = run_json("list_jobs")["jobs"][0]["last_error"]
    assert "\n" in full and len(full) == 10_000  # --json keeps what was stored


def test_requeue_dead_dry_run_then_for_real():
    dead = make_dead_job()
    assert run_json("requeue_dead", "--all", "--dry-run") == {
        "requeued": [dead.pk],
        "dry_run": True,
        "conflicts": [],
    }
    assert Job.objects.get(pk=dead.pk).state == State.DEAD
    assert run_json("requeue_dead", "--kind", "test.fail") == {
        "requeued": [dead.pk],
        "dry_run": False,
        "conflicts": [],
    }
    assert Job.objects.get(pk=dead.pk).state == State.QUEUED


def test_requeue_of_a_job_that_is_not_dead_exits_1():
    job = enqueueing.enqueue("test.echo")
    assert exit_code("requeue_dead", str(job.pk)) == 1


def test_queue_status_counts_lanes_states_and_leases():
    make_dead_job()
    enqueueing.enqueue("test.echo")
    enqueueing.enqueue("test.echo", delay=3600)
    enqueueing.enqueue("test.noop")
    claim_one("w-status")
    data = run_json("queue_status")
    assert data["totals"]["dead"] == 1 and data["dead"] == 1
    assert data["totals"]["queued"] == 2 and data["totals"]["running"] == 1
    lane = data["lanes"]["default"]
    assert lane["queued"] == 2 and lane["oldest_queued_age_s"] is not None
    assert data["delayed"] == 1
    assert [lease["worker_id"] for lease in data["live_leases"]] == ["w-status"]
    assert "workers" in data and "schedules_overdue" in data
    assert "default" in run("queue_status")


def test_runworker_rejects_unknown_lanes():
    assert exit_code("runworker", "--lanes", "nope", "--burst") == 2
