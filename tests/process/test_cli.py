"""The command-line contract (DESIGN §8) end to end, in real subprocesses: ``runworker
--burst``, ``show_job --json``, ``requeue_dead`` and the exit codes of bad input."""

from __future__ import annotations

import pytest

from jobs.models import Job, State
from tests.support.workers import CommandResult, WorkerPool

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


def ok(result: CommandResult) -> CommandResult:
    assert result.returncode == 0, result.describe()
    return result


def assert_failed_attempts(detail: dict, count: int) -> None:
    leases = detail["leases"]
    assert [lease["attempt"] for lease in leases] == list(range(1, count + 1))
    assert [lease["lease_token"] for lease in leases] == list(range(1, count + 1))
    for lease in leases:
        assert lease["outcome"] == "failed"
        assert lease["worker_id"].startswith("burst-")
        assert lease["error_class"] == "RuntimeError"
        assert lease["error_message"] == f"boom (attempt {lease['attempt']})"
        assert lease["traceback"].startswith("Traceback (most recent call last):")
        assert f"RuntimeError: boom (attempt {lease['attempt']})" in lease["traceback"]
        assert lease["released_at"] is not None
        # The attempt keeps the log context bound while it ran.
        assert lease["context"]["job_id"] == detail["id"]
        assert lease["context"]["attempt"] == lease["attempt"]


def test_burst_worker_dead_job_inspection_and_requeue(workers: WorkerPool) -> None:
    # An empty queue: a burst worker exits 0 at once.
    ok(workers.command("runworker", "--burst", "--worker-id", "burst-0"))

    dead = ok(workers.command("enqueue", "test.fail", "--json")).json()
    assert (dead["state"], dead["max_attempts"]) == ("queued", 3)
    done = int(ok(workers.command("enqueue", "test.echo", "--args", '{"n": 1}')).stdout)

    burst = ok(workers.command("runworker", "--burst", "--worker-id", "burst-1"))
    assert "worker_exiting" in burst.stderr
    assert Job.objects.get(pk=done).state == State.SUCCEEDED
    assert not Job.objects.exclude(state__in=[State.SUCCEEDED, State.DEAD]).exists()

    detail = ok(workers.command("show_job", str(dead["id"]), "--json")).json()
    assert detail["state"] == "dead"
    assert detail["attempts"] == 3
    assert detail["last_error"] == "RuntimeError: boom (attempt 3)"
    assert_failed_attempts(detail, 3)

    requeued = ok(workers.command("requeue_dead", str(dead["id"])))
    assert f"requeued 1 job(s): {dead['id']}" in requeued.stdout
    assert Job.objects.get(pk=dead["id"]).state == State.QUEUED

    ok(workers.command("runworker", "--burst", "--worker-id", "burst-2"))
    detail = ok(workers.command("show_job", str(dead["id"]), "--json")).json()
    assert detail["state"] == "dead"
    assert (detail["attempts"], detail["max_attempts"]) == (6, 6)
    assert detail["last_error"] == "RuntimeError: boom (attempt 6)"
    assert_failed_attempts(detail, 6)
    assert {lease["worker_id"] for lease in detail["leases"][3:]} == {"burst-2"}

    # Operator mistakes: exit 1 for a state conflict, 2 for bad input; one line, no traceback.
    cases = {
        "unknown job": (["show_job", "999999"], 2),
        "requeue a succeeded job": (["requeue_dead", str(done)], 1),
        "unknown kind": (["enqueue", "no.such.kind"], 2),
        "bad JSON args": (["enqueue", "test.echo", "--args", "{bad"], 2),
    }
    procs = {
        name: workers.spawn(name.replace(" ", "-"), *argv) for name, (argv, _) in cases.items()
    }
    for name, (argv, expected) in cases.items():
        proc = procs[name]
        code = proc.wait_exit(timeout=30)
        stderr = proc.stderr()
        assert code == expected, f"{name}: {' '.join(argv)}\n{proc.describe()}"
        assert len(stderr.strip().splitlines()) == 1, f"{name}: stderr not one line\n{stderr}"
        assert "Traceback" not in stderr, f"{name}\n{stderr}"
        assert proc.stdout() == "", f"{name}\n{proc.describe()}"
    assert Job.objects.get(pk=done).state == State.SUCCEEDED  # untouched
    assert Job.objects.count() == 2  # the failed enqueues created nothing


@pytest.mark.parametrize(
    "args",
    [
        ("list_jobs", "--limit", "0"),
        ("list_jobs", "--limit", "9223372036854775808"),
        ("show_job", "-5"),
        ("requeue_dead", "9223372036854775808"),
        ("cancel_job", "abc"),
        ("prune_jobs", "--older-than", "99999999999999999999d"),
        ("enqueue", "test.echo", "--delay", "inf"),
        ("enqueue", "test.echo", "--run-at", "0001-01-01T00:00:00+14:00"),
        ("enqueue", "test.echo", "--args", '{"a": "\\u0000"}'),
        ("create_ops_token", "name\n", "--scope", "read"),
    ],
)
def test_out_of_range_and_malformed_input_exits_2_without_a_traceback(
    workers: WorkerPool, args: tuple[str, ...]
) -> None:
    result = workers.command(*args)
    assert result.returncode == 2, result.describe()
    assert "Traceback" not in result.stderr
