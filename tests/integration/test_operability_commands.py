"""Operator loose ends: token listing and expiry, prune --dry-run, the built-in retention,
resolve_reconciliation_issue, and enqueue's over-deep --args."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import time_machine
from django.core.management import CommandError
from django.db import transaction
from django.test import Client
from django.utils import timezone

from ingestion import reconciliation
from ingestion.models import ReconciliationIssue
from jobs import engine, enqueueing, retention, sql
from jobs.models import Job, JobEvent, Lease, OutcomeCount, State
from jobs.scheduler import SchedulerLoop
from ops import tokens
from ops.models import OpsToken

from .helpers import claim_one, exit_code, failure, run, run_json

pytestmark = pytest.mark.django_db


# --- tokens ------------------------------------------------------------------------------


def get_queue(token: str):
    return Client().get("/internal/v1/queue/", headers={"Authorization": f"Bearer {token}"})


def test_an_expired_token_is_refused_like_a_revoked_one():
    created = run_json("create_ops_token", "short", "--scope", "read", "--expires-in", "2h")
    assert created["expires_at"] is not None
    token = created["token"]
    assert get_queue(token).status_code == 200
    with time_machine.travel(timezone.now() + timedelta(hours=2, seconds=1), tick=False):
        response = get_queue(token)
        assert response.status_code == 401
        assert response.json()["code"] == "authentication_failed"
        assert tokens.check(token).reason == "expired"
        listed = {row["name"]: row for row in run_json("list_ops_tokens")["tokens"]}
        assert listed["short"]["status"] == "expired"


def test_list_ops_tokens_shows_everything_but_the_secret():
    _, live = tokens.create("reader", "read")
    _, old = tokens.create("old-bot", "write")
    tokens.revoke("old-bot")
    get_queue(live)
    listing = run_json("list_ops_tokens")
    assert listing["count"] == 2
    rows = {row["name"]: row for row in listing["tokens"]}
    assert rows["reader"]["status"] == "live" and rows["reader"]["last_used_at"] is not None
    assert rows["reader"]["prefix"] == live.split("_")[1]
    assert rows["reader"]["expires_at"] is None
    assert rows["old-bot"]["status"] == "revoked" and rows["old-bot"]["revoked_at"]
    assert set(rows["reader"]) == {
        "name",
        "scope",
        "prefix",
        "status",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    }
    human = run("list_ops_tokens")
    for text in (run("list_ops_tokens", "--json"), human):
        assert live.split("_", 2)[2] not in text and old.split("_", 2)[2] not in text
    assert "reader" in human and "revoked" in human
    header, *lines = human.splitlines()
    starts = [header.index(title) for title in ("last used", "expires", "revoked")]
    for line in lines[:-1]:  # the columns line up with their titles
        assert all(line[start - 1] == " " and line[start] != " " for start in starts), line


@pytest.mark.parametrize("duration", ["soon", "0s", "-1d", "10y"])
def test_a_bad_expires_in_is_bad_input(duration):
    assert exit_code("create_ops_token", "x", "--scope", "read", f"--expires-in={duration}") == 2
    assert not OpsToken.objects.exists()


# --- pruning and retention ---------------------------------------------------------------


def finished(state: str, age: timedelta, kind: str = "test.echo") -> Job:
    """A real finished job (claimed and settled), then aged by ``age``."""
    job = enqueueing.enqueue(kind)
    claimed = claim_one()
    if state == State.SUCCEEDED:
        engine.complete(claimed, None)
    elif state == State.CANCELLED:
        engine.cancelled(claimed)
    else:
        engine.fail(claimed, failure(permanent=True), backoff_seconds=0)
    Job.objects.filter(pk=job.pk).update(finished_at=timezone.now() - age)
    return Job.objects.get(pk=job.pk)


def test_prune_dry_run_counts_and_deletes_nothing():
    finished(State.SUCCEEDED, timedelta(days=30))
    finished(State.DEAD, timedelta(days=30))
    finished(State.SUCCEEDED, timedelta(hours=1))
    out = run_json("prune_jobs", "--older-than", "14d", "--dry-run")
    assert out["dry_run"] is True and out["would_delete"] == 1 and out["deleted"] == 0
    with_dead = run_json("prune_jobs", "--older-than", "14d", "--dry-run", "--include-dead")
    assert with_dead["would_delete"] == 2
    assert Job.objects.count() == 3
    assert "would prune 1" in run("prune_jobs", "--older-than", "14d", "--dry-run")
    assert run_json("prune_jobs", "--older-than", "14d")["deleted"] == 1
    assert Job.objects.count() == 2


def test_retention_removes_exactly_what_it_should(settings):
    settings.HOLDFAST_RETAIN_SUCCEEDED = timedelta(days=7)
    settings.HOLDFAST_RETAIN_CANCELLED = timedelta(days=1)
    settings.HOLDFAST_RETAIN_DEAD = None  # off: kept forever
    gone = [
        finished(State.SUCCEEDED, timedelta(days=8)),
        finished(State.CANCELLED, timedelta(days=2)),
    ]
    kept = [
        finished(State.SUCCEEDED, timedelta(days=6)),
        finished(State.CANCELLED, timedelta(hours=12)),
        finished(State.DEAD, timedelta(days=400)),
        enqueueing.enqueue("test.echo", delay=3600),  # queued
    ]
    enqueueing.enqueue("test.noop")
    running = claim_one()
    Job.objects.filter(pk=running.id).update(created_at=timezone.now() - timedelta(days=99))
    kept.append(Job.objects.get(pk=running.id))
    counted = list(OutcomeCount.objects.values_list("kind", "outcome", "count"))

    SchedulerLoop().run_once()  # the scheduler runs the retention pass

    assert set(Job.objects.values_list("pk", flat=True)) == {job.pk for job in kept}
    gone_ids = [job.pk for job in gone]
    assert not Lease.objects.filter(job_id__in=gone_ids).exists()
    assert not JobEvent.objects.filter(job_id__in=gone_ids).exists()
    assert list(OutcomeCount.objects.values_list("kind", "outcome", "count")) == counted


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("HOLDFAST_RETAIN_DEAD", 90),
        ("HOLDFAST_RETAIN_SUCCEEDED", "14d"),
        ("HOLDFAST_RETAIN_CANCELLED", timedelta(0)),
        ("HOLDFAST_RETAIN_DEAD", timedelta(days=-1)),
        ("HOLDFAST_RETAIN_RESOLVED_ISSUES", timedelta(days=40_000)),
    ],
)
def test_a_retention_set_wrong_in_a_settings_module_is_refused_naming_it(settings, name, value):
    """Given in Python, not the environment, the value was used as it came: an int or a
    string failed every retention pass (the table grew for ever, a traceback per pass),
    timedelta(days=-1) deleted every dead job at once (audit). ``check`` reports it, and a
    scheduler refuses to start."""
    setattr(settings, name, value)
    finished(State.DEAD, timedelta(seconds=1))
    with pytest.raises(CommandError, match=r"holdfast\.E004") as checked:
        run("check")
    assert name in str(checked.value)
    for command in (("runscheduler", "--once"), ("runworker", "--burst", "--with-scheduler")):
        assert exit_code(*command) == 2  # bad input: one line naming the setting
        with pytest.raises(CommandError, match=f"{name} must be a timedelta above 0"):
            run(*command)
    assert Job.objects.filter(state=State.DEAD).count() == 1


def test_retention_goes_in_batches_and_the_scheduler_comes_back_for_the_rest(settings):
    settings.HOLDFAST_RETAIN_SUCCEEDED = timedelta(days=1)
    for _ in range(5):
        finished(State.SUCCEEDED, timedelta(days=2))
    assert retention.prune({State.SUCCEEDED: timedelta(days=1)}, batch=2, max_batches=1) == {
        State.SUCCEEDED: 2
    }
    assert Job.objects.count() == 3
    assert retention.prune({State.SUCCEEDED: timedelta(days=1)}, batch=2) == {State.SUCCEEDED: 3}
    assert not Job.objects.exists()


def test_retention_deletes_issues_resolved_long_ago_and_never_open_ones(settings):
    """Resolved reconciliation issues piled up for ever, and every metrics scrape counted
    them all (63-127 ms at 200,000). The scheduler's retention pass now deletes those
    resolved longer ago than HOLDFAST_RETAIN_RESOLVED_ISSUES, in batches."""
    settings.HOLDFAST_RETAIN_RESOLVED_ISSUES = timedelta(days=30)
    old_open = reconciliation.record("quarantined_submission", "open.json", details={})
    long_ago = [
        reconciliation.record("quarantined_submission", f"old-{n}.json", details={})
        for n in range(3)
    ]
    lately = reconciliation.record("quarantined_submission", "lately.json", details={})
    for issue in (*long_ago, lately):
        reconciliation.resolve(issue.pk, by="test")
    ReconciliationIssue.objects.filter(pk__in=[i.pk for i in long_ago]).update(
        resolved_at=timezone.now() - timedelta(days=31)
    )
    ReconciliationIssue.objects.filter(pk=old_open.pk).update(
        created_at=timezone.now() - timedelta(days=400)
    )
    assert reconciliation.prune_resolved(2) == 2  # a batch
    SchedulerLoop().run_once()  # the scheduler's retention pass takes the rest
    assert set(ReconciliationIssue.objects.values_list("pk", flat=True)) == {
        old_open.pk,
        lately.pk,
    }
    settings.HOLDFAST_RETAIN_RESOLVED_ISSUES = None  # off
    ReconciliationIssue.objects.filter(pk=lately.pk).update(
        resolved_at=timezone.now() - timedelta(days=999)
    )
    assert reconciliation.prune_resolved(100) == 0


def test_prune_refuses_active_states():
    with pytest.raises(ValueError, match="finished"):
        retention.prune({State.QUEUED: timedelta(days=1)})


# --- reconciliation and enqueue ----------------------------------------------------------


def test_resolve_reconciliation_issue_from_the_command_line():
    issue = reconciliation.record("quarantined_submission", "a.json", details={})
    out = run_json("resolve_reconciliation_issue", str(issue.pk), "--comment", "re-sent")
    assert out["status"] == "resolved" and out["comment"] == "re-sent"
    assert out["resolved_by"].startswith("cli")
    assert ReconciliationIssue.objects.get(pk=issue.pk).status == "resolved"
    again = ("resolve_reconciliation_issue", str(issue.pk), "--comment", "x")
    assert exit_code(*again) == 1  # already resolved: a conflict
    assert exit_code("resolve_reconciliation_issue", "999999", "--comment", "x") == 2
    assert exit_code("resolve_reconciliation_issue", str(issue.pk), "--comment", "  ") == 2


def test_enqueue_args_nested_too_deeply_is_bad_input():
    deep = "[" * 10_000 + "]" * 10_000
    assert exit_code("enqueue", "test.echo", "--args", deep) == 2
    assert not Job.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("other_thread", [False, True])
def test_an_interrupt_as_a_batch_commits_is_reported_with_that_batch(monkeypatch, other_thread):
    """SIGTERM landing between a batch's commit and its count in the tally: the report
    said those jobs were not pruned (5,000 where 10,000 were, under load in CI). The
    signal now waits for the count, also while the process has another thread, which the
    kernel hands the signal to when the main thread masks it (it said 0 in CI)."""
    for _ in range(3):
        finished(State.SUCCEEDED, timedelta(days=30))
    count_jobs = sql.count_jobs

    def stop_now() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # another thread's C handler has run by now: the race, every time

    def count_then_stop(gone):
        count_jobs(gone)
        transaction.on_commit(stop_now)

    monkeypatch.setattr(sql, "count_jobs", count_then_stop)
    idle = threading.Event()
    if other_thread:  # a thread not masking the signal: the kernel may hand it there
        threading.Thread(target=idle.wait, daemon=True).start()
    try:
        with pytest.raises(CommandError) as stopped:
            run("prune_jobs", "--older-than", "14d")
    finally:
        idle.set()
    assert stopped.value.returncode == 128 + signal.SIGTERM
    assert str(stopped.value) == ("interrupted by SIGTERM; 3 finished job(s) were pruned before it")
    assert not Job.objects.exists()
