"""Database errors that are not about the job are never the job's failure (issue 12):
an error in the claim half of the fused settle-and-claim statement keeps the settle, a
prepared statement invalidated under the worker is prepared again, and a handler that
meets a lost session gives its job back uncharged."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connection
from structlog.testing import capture_logs

from jobs import engine, enqueueing, sql
from jobs.models import Job, Lease, State
from tests.conftest import database_url

from .helpers import claim_one, failure

pytestmark = pytest.mark.postgres


@pytest.fixture
def refuse_claims_of(transactional_db: None) -> Iterator[object]:
    """``refuse(job_id, times)``: the next ``times`` claims of that job fail in the claim's
    own UPDATE of the job row (a trigger; a sequence counts across the rollbacks)."""

    def refuse(job_id: int, times: int) -> None:
        with connection.cursor() as cursor:
            cursor.execute("CREATE SEQUENCE test_claim_refusals")
            cursor.execute(
                "CREATE FUNCTION test_refuse_claim() RETURNS trigger LANGUAGE plpgsql AS $$ "
                f"BEGIN IF NEW.id = {int(job_id)} AND NEW.state = 'running' "
                f"AND nextval('test_claim_refusals') <= {int(times)} THEN "
                "RAISE EXCEPTION 'claims of job % are refused', NEW.id; END IF; "
                "RETURN NEW; END $$"
            )
            cursor.execute(
                "CREATE TRIGGER test_refuse_claim BEFORE UPDATE ON jobs_job "
                "FOR EACH ROW EXECUTE FUNCTION test_refuse_claim()"
            )

    yield refuse
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER IF EXISTS test_refuse_claim ON jobs_job")
        cursor.execute("DROP FUNCTION IF EXISTS test_refuse_claim()")
        cursor.execute("DROP SEQUENCE IF EXISTS test_claim_refusals")


def test_an_error_in_the_claim_half_keeps_the_settle(refuse_claims_of) -> None:
    finished = enqueueing.enqueue("test.echo", {"n": 1}, priority=1)
    following = enqueueing.enqueue("test.echo", {"n": 2})
    job = claim_one("w1")
    assert job.id == finished.pk
    refuse_claims_of(following.pk, 1)

    assert engine.settle_and_claim(job, engine.succeeded({"ok": True}), "w1", None) is None

    finished.refresh_from_db()
    following.refresh_from_db()
    assert (finished.state, finished.attempts) == (State.SUCCEEDED, 1)
    assert finished.result == {"ok": True}
    assert Lease.objects.get(job=finished).outcome == "succeeded"
    assert (following.state, following.attempts) == (State.QUEUED, 0)
    # The next claim is not refused any more and takes it.
    assert claim_one("w1").id == following.pk


def test_a_worker_whose_claims_are_refused_settles_and_goes_on(refuse_claims_of, run_worker):
    finished = enqueueing.enqueue("test.echo", {"n": 1}, priority=1)
    following = enqueueing.enqueue("test.echo", {"n": 2})
    refuse_claims_of(following.pk, 2)  # the fused claim, then the worker's next claim

    assert run_worker(worker_id="w1") == 2

    for job in (finished, following):
        job.refresh_from_db()
        assert (job.state, job.attempts) == (State.SUCCEEDED, 1), job.last_error
        assert list(Lease.objects.filter(job=job).values_list("outcome", flat=True)) == [
            "succeeded"
        ]


def alter_from_another_session(statement: str) -> None:
    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as other:
        other.execute(statement)


@pytest.fixture
def restore_kind_column(transactional_db: None) -> Iterator[None]:
    yield
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE jobs_job ALTER COLUMN kind TYPE varchar(200)")


def test_a_prepared_statement_a_migration_invalidated_is_prepared_again(
    restore_kind_column: None, settings
) -> None:
    settings.HOLDFAST_PREPARED_STATEMENTS = True
    jobs = [enqueueing.enqueue("test.echo", {"n": n}, priority=-n) for n in range(3)]
    job = claim_one("w1")
    job = engine.settle_and_claim(job, engine.succeeded(), "w1", None)  # prepares the fused one
    assert job is not None and job.id == jobs[1].pk
    alter_from_another_session("ALTER TABLE jobs_job ALTER COLUMN kind TYPE varchar(300)")

    job = engine.settle_and_claim(job, engine.succeeded(), "w1", None)
    assert job is not None and job.id == jobs[2].pk
    for done in jobs[:2]:
        done.refresh_from_db()
        assert (done.state, done.attempts) == (State.SUCCEEDED, 1)


def test_with_prepared_statements_off_nothing_is_prepared(transactional_db, settings) -> None:
    settings.HOLDFAST_PREPARED_STATEMENTS = False
    connection.close()  # a fresh session: nothing prepared by earlier tests
    enqueueing.enqueue("test.echo", {"n": 1})
    engine.settle_and_claim(claim_one("w1"), engine.succeeded(), "w1", None)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements")
        assert cursor.fetchone() == (0,)
    assert connection.connection.prepare_threshold is None


def test_database_faults_are_told_from_errors_of_the_data(transactional_db: None) -> None:
    def error_of(statement: str) -> Exception:
        with pytest.raises(Exception) as raised, connection.cursor() as cursor:
            cursor.execute(statement)
        return raised.value

    assert sql.fault(error_of("SELECT 1/0")) is None
    assert sql.fault(error_of("SELECT * FROM no_such_table")) is None
    assert sql.fault(error_of("EXECUTE no_such_statement")) == "prepared"
    with connection.cursor() as cursor:
        cursor.execute("SET default_transaction_read_only = on")
    try:
        assert sql.fault(error_of("CREATE TABLE nope (id int)")) == "connection"  # failover
    finally:
        connection.close()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    assert sql.fault(error_of("SELECT 1")) == "connection"  # a restart, or a terminated session
    connection.close()


@pytest.mark.django_db
def test_a_handler_that_meets_a_database_fault_gives_its_job_back_uncharged() -> None:
    job = enqueueing.enqueue("test.echo", {"n": 1})
    claimed = claim_one("w1")
    verdict = engine.interrupted(claimed, failure("server closed the connection"), 0.0)
    engine.settle(claimed, verdict)
    job.refresh_from_db()
    assert (job.state, job.attempts) == (State.QUEUED, 0)
    lease = Lease.objects.get(job=job)
    assert (lease.outcome, lease.error_class) == ("released", "RuntimeError")
    # A job whose every attempt meets one still ends: after max_attempts of them, charged.
    Job.objects.filter(pk=job.pk).update(max_attempts=1)
    claimed = claim_one("w1")
    assert engine.interrupted(claimed, failure(), 0.0).how.outcome == "failed"


def read_only_session() -> None:
    """This thread's session refuses writes, as a standby not yet promoted (or a demoted
    primary) does in a failover; a new session (after ``connection.close()``) accepts them."""
    with connection.cursor() as cursor:
        cursor.execute("SET default_transaction_read_only = on")


def test_the_scheduler_waits_out_a_server_that_refuses_writes(transactional_db: None) -> None:
    """The refusal is an ``InternalError`` (SQLSTATE 25006), not one of Django's two
    connection errors: ``runscheduler`` exited with it where the workers waited."""
    from jobs.scheduler import SchedulerLoop

    stop = threading.Event()
    loop = SchedulerLoop(stop)
    read_only_session()
    timer = threading.Timer(1.5, stop.set)
    timer.start()
    try:
        with capture_logs() as logs:
            loop.run()  # returns when stopped; raised the refusal before
    finally:
        timer.cancel()
    waited = [e for e in logs if e["event"] == "database_unavailable"]
    assert waited and "read-only" in waited[0]["error"], logs
    assert loop._synced  # the next pass, on a new session, went through


def test_the_api_answers_503_while_the_server_refuses_writes(transactional_db: None) -> None:
    from django.test import Client

    from ops import tokens

    _, token = tokens.create("failover-bot", "write")
    job = enqueueing.enqueue("test.echo", {"n": 1})
    read_only_session()

    def cancel() -> Any:
        return Client().generic(
            "POST",
            f"/internal/v1/jobs/{job.pk}/cancel/",
            "",
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}"},
        )

    try:
        response = cancel()
        assert response.status_code == 503, response.content  # was a 500 with a traceback
        assert response.json()["code"] == "database_unavailable"
        assert Job.objects.get(pk=job.pk).state == State.QUEUED
        # The session on the "standby" was given up: the next request gets a new one
        # (writable here, as after the failover), not a 503 until the process restarts.
        assert cancel().status_code == 200
    finally:
        connection.close()
    assert Job.objects.get(pk=job.pk).state == State.CANCELLED
