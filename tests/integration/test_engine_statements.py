"""The engine's own statements never change the handler's transaction, and a worker
back from an outage gives back claims it never heard of."""

from __future__ import annotations

import pytest
from django.db import OperationalError, connection

from jobs import engine
from jobs.context import JobContext
from jobs.models import Job, Lease, Outcome, State

from .helpers import claim_one


def settings_now() -> tuple[str, str, str]:
    with connection.cursor() as cursor:
        values = []
        for name in ("synchronous_commit", "lock_timeout", "statement_timeout"):
            cursor.execute(f"SHOW {name}")
            values.append(cursor.fetchone()[0])
    return tuple(values)  # type: ignore[return-value]


@pytest.mark.postgres
@pytest.mark.parametrize("own_connection", [False, True], ids=["bare", "own-connection"])
@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_inside_ctx_atomic_leaves_the_transactions_settings_alone(own_connection):
    engine.enqueue("test.echo")
    claimed = claim_one()
    ctx = JobContext(claimed, "w1", own_connection=own_connection)
    before = settings_now()
    with ctx.atomic():
        inside = settings_now()
        ctx.heartbeat()
        assert settings_now() == inside == before  # synchronous_commit, lock_timeout...
    assert settings_now() == before
    ctx.heartbeat()  # outside a transaction: its settings are its own statement's only
    assert settings_now() == before
    assert Job.objects.get().heartbeat_at is not None


@pytest.mark.django_db(transaction=True)
def test_after_an_outage_a_worker_gives_back_a_claim_it_never_heard_of(run_worker, monkeypatch):
    """The claim committed but its acknowledgement was lost with the connection: the job
    is leased to this worker, which never ran it. Reconnected, the worker releases it
    (uncharged) before claiming again, then runs it as attempt 1."""
    job = engine.enqueue("test.echo")
    real_claim = engine.claim
    lost: list[object] = []

    def claim_losing_the_ack(*args, **kwargs):
        if not lost:
            lost.append(real_claim(*args, **kwargs))  # committed...
            raise OperationalError("server closed the connection unexpectedly")  # ...no ack
        return real_claim(*args, **kwargs)

    monkeypatch.setattr(engine, "claim", claim_losing_the_ack)
    assert run_worker(worker_id="w-lost") == 1
    job = Job.objects.get(pk=job.pk)
    assert (job.state, job.attempts, job.lease_token) == (State.SUCCEEDED, 1, 2)
    outcomes = list(
        Lease.objects.filter(job=job).order_by("lease_token").values_list("lease_token", "outcome")
    )
    assert outcomes == [(1, Outcome.RELEASED), (2, Outcome.SUCCEEDED)]
