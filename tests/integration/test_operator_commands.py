"""Operator commands beyond the engine's core: cancel, prune, tokens, reconciliation."""

from datetime import timedelta

import pytest
from django.utils import timezone

from ingestion import reconciliation
from jobs import StateConflict, engine, enqueueing
from jobs.models import Job, Lease, State
from ops import tokens
from ops.models import OpsToken

from .helpers import claim_one, exit_code, failure, run, run_json

pytestmark = pytest.mark.django_db


# --- cancel_job ------------------------------------------------------------------------


def test_cancel_a_queued_job_at_once():
    job = enqueueing.enqueue("test.echo")
    data = run_json("cancel_job", str(job.pk))
    assert data["state"] == "cancelled" and data["finished_at"] is not None
    assert engine.claim("w") is None
    assert "cancelled" in run("list_jobs", "--state", "cancelled")


def test_cancel_of_a_job_waiting_to_retry_says_so_and_keeps_its_last_error():
    """It said "before it ran" of a job that had run and failed (audit)."""
    job = enqueueing.enqueue("test.echo")
    assert run_json("cancel_job", str(job.pk))["last_error"] == "cancelled by cli before it ran"
    enqueueing.enqueue("test.echo", max_attempts=3)
    claimed = claim_one()
    engine.fail(claimed, failure("upstream timed out"), 60)
    data = run_json("cancel_job", str(claimed.id))
    assert data["state"] == "cancelled"
    assert data["last_error"] == (
        "cancelled by cli while it waited to run again; before: RuntimeError: upstream timed out"
    )


def test_cancel_a_running_job_requests_it_and_the_worker_learns_at_its_heartbeat():
    enqueueing.enqueue("test.echo")
    claimed = claim_one()
    text = run("cancel_job", str(claimed.id))
    assert "cancellation requested" in text
    job = Job.objects.get(pk=claimed.id)
    assert job.state == State.RUNNING and job.cancel_requested
    assert engine.heartbeat(claimed) is True
    engine.cancelled(claimed)
    job.refresh_from_db()
    assert job.state == State.CANCELLED
    assert Lease.objects.get(job=job).outcome == "cancelled"


def test_cancel_conflicts_and_bad_input():
    job = enqueueing.enqueue("test.echo")
    engine.complete(claim_one())
    assert exit_code("cancel_job", str(job.pk)) == 1  # finished: nothing to cancel
    assert exit_code("cancel_job", "999999") == 2


# --- prune_jobs ------------------------------------------------------------------------


def finished_job(state: str, days_ago: float) -> Job:
    job = enqueueing.enqueue("test.echo")
    claimed = claim_one()
    if state == State.DEAD:
        engine.fail(claimed, failure(permanent=True), 0)
    elif state == State.CANCELLED:
        engine.cancelled(claimed)
    else:
        engine.complete(claimed)
    Job.objects.filter(pk=job.pk).update(finished_at=timezone.now() - timedelta(days=days_ago))
    return job


def test_prune_deletes_old_finished_jobs_with_their_attempts_only():
    old_ok = finished_job(State.SUCCEEDED, 20)
    old_cancelled = finished_job(State.CANCELLED, 20)
    old_dead = finished_job(State.DEAD, 20)
    recent = finished_job(State.SUCCEEDED, 1)
    queued = enqueueing.enqueue("test.echo")
    data = run_json("prune_jobs", "--older-than", "14d")
    assert data == {
        "deleted": 2,
        "older_than_s": 14 * 86400.0,
        "include_dead": False,
        "dry_run": False,
        "would_delete": None,
    }
    remaining = set(Job.objects.values_list("pk", flat=True))
    assert remaining == {old_dead.pk, recent.pk, queued.pk}
    assert not Lease.objects.filter(job_id__in=[old_ok.pk, old_cancelled.pk]).exists()
    assert "pruned 1" in run("prune_jobs", "--older-than", "2w", "--include-dead")
    assert not Job.objects.filter(pk=old_dead.pk).exists()


@pytest.mark.parametrize("value", ["14", "two weeks", "-3d", "14x", ""])
def test_prune_refuses_a_bad_duration(value):
    assert exit_code("prune_jobs", f"--older-than={value}") == 2


# --- tokens ----------------------------------------------------------------------------


def test_token_is_shown_once_stored_hashed_and_revocable():
    data = run_json("create_ops_token", "deploy-bot", "--scope", "write")
    assert (data["name"], data["scope"]) == ("deploy-bot", "write")
    token = data["token"]
    row = OpsToken.objects.get(name="deploy-bot")
    assert token not in (row.digest, row.salt) and row.prefix in token
    principal = tokens.authenticate(token)
    assert principal is not None and principal.name == "deploy-bot" and principal.can_write
    assert OpsToken.objects.get(pk=row.pk).last_used_at is not None
    assert tokens.authenticate(token[:-1] + ("A" if token[-1] != "A" else "B")) is None
    assert "revoked" in run("revoke_ops_token", "deploy-bot")
    assert tokens.authenticate(token) is None
    # Rotation: the name can be issued again once the old token is revoked.
    assert run_json("create_ops_token", "deploy-bot", "--scope", "read")["token"] != token


def test_token_command_bad_input():
    run("create_ops_token", "reader", "--scope", "read")
    assert exit_code("create_ops_token", "reader", "--scope", "read") == 2  # live name
    assert exit_code("create_ops_token", "has space", "--scope", "read") == 2
    assert exit_code("revoke_ops_token", "nobody") == 2
    text = run("create_ops_token", "other", "--scope", "read")
    assert "cannot be shown again" in text and "hf_" in text


# --- reconciliation issues ---------------------------------------------------------------


def test_list_reconciliation_issues_filters_and_shapes():
    first = reconciliation.record(
        "gone_at_source", "https://example.org/a", source="example", details={"status": 410}
    )
    reconciliation.record("quarantined_submission", "lab-3.json", details={"error": "bad"})
    reconciliation.resolve(first.pk, by="alice", comment="removed upstream on purpose")
    data = run_json("list_reconciliation_issues")
    assert data["count"] == 2
    assert set(data["issues"][0]) == {
        "id", "kind", "source", "subject", "details", "status", "created_at",
        "resolved_at", "resolved_by", "comment",
    }  # fmt: skip
    resolved = run_json("list_reconciliation_issues", "--status", "resolved")["issues"]
    assert [issue["resolved_by"] for issue in resolved] == ["alice"]
    assert run_json("list_reconciliation_issues", "--source", "example")["count"] == 1
    assert run_json("list_reconciliation_issues", "--kind", "gone_at_source")["count"] == 1
    assert "removed upstream on purpose" in run("list_reconciliation_issues")


def test_resolving_twice_is_a_conflict():
    issue = reconciliation.record("gone_at_source", "https://example.org/b")
    reconciliation.resolve(issue.pk, by="alice")
    with pytest.raises(StateConflict, match="already resolved by alice"):
        reconciliation.resolve(issue.pk, by="bob")
    with pytest.raises(reconciliation.IssueNotFound):
        reconciliation.resolve(999999, by="bob")
