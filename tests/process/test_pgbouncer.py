"""Holdfast through a real PgBouncer in transaction mode (``HOLDFAST_PREPARED_STATEMENTS=off``):
workers, enqueue, the scheduler, every command (the engine's, the ops tokens', the
ingestion's) and the API all go through it; a killed
worker's job is reclaimed. LISTEN needs a session, so it either goes to a direct
connection (``HOLDFAST_LISTEN_DATABASE_URL``) or, without one, the workers poll.

The pool has fewer server connections than there are clients, so any session state one
client left on a server connection (a prepared statement, a LISTEN, a ``SET``) would reach
another. PgBouncer missing fails these tests (tests/support/pgbouncer.py says how to
install it, or to skip knowingly).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection

from jobs import enqueueing
from jobs.models import Job, Lease
from tests.process.helpers import job_summary, wait_for_job, wait_for_marker
from tests.support.pgbouncer import PgBouncer, PgBouncerMissing
from tests.support.workers import WorkerPool, wait_until

pytestmark = [pytest.mark.process, pytest.mark.postgres, pytest.mark.timeout(120)]


@pytest.fixture
def bouncer(transactional_db: None, tmp_path: Path) -> Iterator[PgBouncer]:
    settings = connection.settings_dict
    try:
        running = PgBouncer(
            tmp_path / "bouncer",
            server_host=settings.get("HOST") or "127.0.0.1",
            server_port=int(settings.get("PORT") or 5432),
            server_user=settings.get("USER") or "postgres",
        )
    except PgBouncerMissing as exc:
        if os.environ.get("HOLDFAST_SKIP_PGBOUNCER") == "1":
            pytest.skip(f"HOLDFAST_SKIP_PGBOUNCER=1: {exc}")
        raise
    with running:
        yield running


def pooled_env(bouncer: PgBouncer, **extra: str) -> dict[str, str]:
    return {
        "DATABASE_URL": bouncer.url(connection.settings_dict["NAME"]),
        "HOLDFAST_PREPARED_STATEMENTS": "off",
        **extra,
    }


def listening_sessions() -> int:
    """Server sessions of the test database that LISTEN (a LISTEN is their last query)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query ILIKE 'LISTEN %%'"
        )
        return cursor.fetchone()[0]


COMMANDS_AND_API = """
import io, json
from django.core.management import call_command
from django.test import Client
from jobs import enqueueing
from jobs.models import Job

def run(*args):
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()

dead = enqueueing.enqueue("test.echo", {"n": "dead"})
Job.objects.filter(pk=dead.pk).update(state="dead")
later = enqueueing.enqueue("test.echo", {"n": "later"}, delay=3600)
status = json.loads(run("queue_status", "--json"))
assert status["workers"], status
assert json.loads(run("list_jobs", "--json"))["count"] >= 2
assert json.loads(run("show_job", str(dead.pk), "--json"))["id"] == dead.pk
assert json.loads(run("requeue_dead", str(dead.pk), "--json"))["requeued"] == [dead.pk]
run("cancel_job", str(later.pk))
run("prune_jobs", "--older-than", "30d")
run("list_schedules")
for toggle in ("pause_schedule", "resume_schedule", "run_schedule_now"):
    run(toggle, "tick")
run("add_source", "pgb", "--kind", "sitemap", "--url", "https://example.test/sitemap.xml")
run("list_sources")
run("list_artifacts", "--source", "pgb")
run("list_reconciliation_issues")
run("search", "anything")
run("force_refresh", "--source", "pgb")
run("disable_source", "pgb")
run("gc_blobs", "--dry-run")
run("ingest_submissions", "--once", "--spool", SPOOL)
token = json.loads(run("create_ops_token", "probe", "--scope", "write", "--json"))["token"]
auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
client = Client()
for path in ("queue/", "dead-jobs/", f"jobs/{dead.pk}/", "health/"):
    response = client.get(f"/internal/v1/{path}", **auth)
    assert response.status_code == 200, (path, response.content)
Job.objects.filter(pk=dead.pk).update(state="dead")
json_body = {"content_type": "application/json"}  # no body; the test client's default is a form
response = client.post(f"/internal/v1/jobs/{dead.pk}/requeue/", **json_body, **auth)
assert response.status_code == 200, response.content
run("list_ops_tokens")
run("revoke_ops_token", "probe")
print("commands and API ok")
"""


def test_through_pgbouncer_with_a_direct_listen_connection(
    workers: WorkerPool, worker_env: dict[str, str], bouncer: PgBouncer, tmp_path: Path
) -> None:
    schedules = {"tick": {"kind": "test.noop", "every": 1}}
    env = pooled_env(
        bouncer,
        HOLDFAST_LISTEN_DATABASE_URL=worker_env["DATABASE_URL"],  # the server, directly
        HOLDFAST_POLL_SECONDS="60",  # only a NOTIFY wakes an idle worker in time
        HOLDFAST_TEST_SCHEDULES=json.dumps(schedules),
    )
    procs = [workers.start(f"pgb-{n}", env=env) for n in (1, 2)]
    scheduler = workers.spawn("pgb-scheduler", "runscheduler", env=env)

    def describe() -> str:
        return f"{job_summary()}\n{workers.describe()}\n{bouncer.describe()}"

    # Both workers LISTEN (new jobs, freed locks, cancels) on their direct side connection,
    # where their lease keepers also renew leases and reclaim...
    wait_until(
        lambda: all(proc.events("listening") for proc in procs), 20, interval=0.1, message=describe
    )
    # ... so a job enqueued through the pooler wakes an idle one at once (NOTIFY).
    enqueued = workers.command(
        "enqueue", "test.echo", "--args", '{"via": "cli"}', "--json", env=env
    )
    assert enqueued.returncode == 0, enqueued.describe()
    wait_for_job(enqueued.json()["id"], "succeeded", workers, timeout=10)

    workers.python(
        "from jobs import sql\n"
        "from jobs.enqueueing import enqueue_many\n"
        "sql.BULK_INSERT_CHUNK = 7  # six statements, pipelined through the pooler\n"
        "enqueue_many('test.sleep', [{'seconds': 0.02}] * 40)\n"
        "sql.COPY_THRESHOLD, sql.COPY_CHUNK = 30, 7  # ids drawn, then COPY in six writes\n"
        "enqueue_many('test.sleep', [{'seconds': 0.02}] * 40)\n",
        env=env,
    )
    wait_until(
        lambda: not Job.objects.filter(kind="test.sleep").exclude(state="succeeded").exists(),
        30,
        interval=0.1,
        message=lambda: f"not drained through the pooler\n{describe()}",
    )
    # The scheduler's slots arrive through the pooler too.
    wait_until(
        lambda: Job.objects.filter(kind="test.noop", state="succeeded").exists(),
        20,
        interval=0.1,
        message=lambda: f"no scheduled job ran\n{describe()}",
    )
    (tmp_path / "spool").mkdir()
    spool = f"SPOOL = {str(tmp_path / 'spool')!r}\n"
    done = workers.python(spool + COMMANDS_AND_API, env=env)
    assert "commands and API ok" in done.stdout, done.describe()

    # Kill the worker running a job: the other one reclaims it, all through the pooler.
    marker = tmp_path / "started"
    workers.python(
        "from jobs.enqueueing import enqueue\n"
        f"enqueue('test.sleep', {{'seconds': 30, 'marker': {str(marker)!r}}}, lease_seconds=2)\n",
        env=env,
    )
    wait_for_marker(marker, procs[0])
    victim = next(proc for proc in procs if str(proc.pid) == marker.read_text())
    survivor = next(proc for proc in procs if proc is not victim)
    victim.kill()
    job = Job.objects.get(kind="test.sleep", lease_seconds=2)
    wait_until(
        lambda: (
            Lease.objects.filter(job=job, lease_token=1, outcome="lease_expired").exists()
            and Job.objects.filter(pk=job.pk, lease_token=2, leased_by=survivor.name).exists()
        ),
        30,
        interval=0.1,
        message=lambda: f"the killed worker's job was not reclaimed\n{describe()}",
    )
    assert survivor.alive and scheduler.alive, describe()
    for proc in (survivor, scheduler):
        assert not proc.events("database_unavailable"), describe()
        assert not proc.events("background_step_failed"), describe()


def test_through_pgbouncer_without_a_listen_connection_workers_poll(
    workers: WorkerPool, bouncer: PgBouncer
) -> None:
    env = pooled_env(bouncer, HOLDFAST_POLL_SECONDS="0.2")
    procs = [workers.start(f"poll-{n}", env=env) for n in (1, 2)]
    ids = [job.pk for job in enqueueing.enqueue_many("test.sleep", [{"seconds": 0.02}] * 30)]
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, state="succeeded").count() == len(ids),
        30,
        interval=0.1,
        message=lambda: f"not drained by polling\n{job_summary(ids)}\n{workers.describe()}",
    )
    for proc in procs:
        assert proc.events("listen_disabled"), proc.describe()
        assert not proc.events("listen_unavailable") and not proc.events("database_unavailable")
        assert proc.alive
    assert listening_sessions() == 0  # nobody LISTENs through (or around) the pooler
    assert not Lease.objects.filter(job_id__in=ids).exclude(outcome="succeeded").exists()
