"""Bad input on the command line is exit 2 with one line saying why (DESIGN §8), the same
on both databases, and nothing is done: from an external audit of every command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import engine, enqueueing
from jobs.management.base import decimal_number
from jobs.models import Job, JobCount, OutcomeCount, Schedule, State
from ops.models import OpsToken
from tests.conftest import REPO

from .helpers import claim_one, exit_code, failure, run, run_json

pytestmark = pytest.mark.django_db


def refused(*args: str) -> str:
    """Run a command that must refuse its input: exit 2; the one-line reason."""
    from django.core.management.base import CommandError

    with pytest.raises(CommandError) as raised:
        run(*args)
    assert raised.value.returncode == 2, raised.value
    reason = str(raised.value)
    assert reason and "\n" not in reason
    return reason


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["enqueue", "test.echo", "--args", "null"], "must be a JSON object, got null"),
        # As the API's body parser: a key given twice is not "the last one wins" (audit).
        (["enqueue", "test.echo", "--args", '{"n": 1, "n": 2}'], "the key 'n' is given more"),
        (["enqueue", "test.echo", "--args", '{"n": NaN}'], "NaN is not valid JSON"),
        (["enqueue", "test.echo", "--args", '{"n": ' + "9" * 5000 + "}"], "more than 4300 digits"),
        (
            ["enqueue", "test.flaky", "--args", "{}"],
            "missing a required keyword-only argument: 'fail_times'",
        ),
        (["enqueue", "test.echo", "--run-at", ""], "--run-at must not be empty"),
        (["enqueue", "test.echo", "--run-at", "2030-01-01T00:00:00"], "no UTC offset"),
        (["enqueue", "test.echo", "--run-at", "2030-01-01T00:00:00+25:00"], "not an ISO 8601"),
        (["enqueue", "test.echo", "--lane", ""], "--lane must not be empty"),
        (["enqueue", "test.echo", "--unique-key", " \t"], "--unique-key must not be empty"),
        (["enqueue", "test.echo", "--priority", "\u0665"], "not a whole number"),
        (["enqueue", "test.echo", "--priority", " 5"], "not a whole number"),
        (["enqueue", "test.echo", "--delay", "nan"], "not a number"),
        (["enqueue", "test.echo", "--lane", "x\udcff"], "--lane is not valid UTF-8"),
        (["show_job", "\u0663"], "not an id"),
        (["prune_jobs", "--older-than", "\u0661\u0664d"], "not a duration"),
        (["prune_jobs", "--older-than", " 14d"], "not a duration"),
        (["prune_jobs", "--older-than", "1000000d"], "100 years"),
        # An option given twice: never "the last one wins" (a read token for a write one).
        (
            ["create_ops_token", "t", "--scope", "write", "--scope", "read"],
            "--scope given more than once",
        ),
        (["enqueue", "test.echo", "--lane", "a", "--lane", "b"], "--lane given more than once"),
        (["requeue_dead", "--all", "--dry-run", "--dry-run"], "--dry-run given more than once"),
        (["create_ops_token", "t", "--scope", "read", "--expires-in", ""], "must not be empty"),
        (["create_ops_token", "t", "--scope", "read", "--expires-in", "3000000d"], "100 years"),
        (["runworker", "--burst", "--lanes", ""], "--lanes must not be empty"),
        (["runworker", "--burst", "--worker-id", "w" * 201], "at most 200"),
        (["runworker", "--burst", "--worker-id", "w\udcff"], "not valid UTF-8"),
        (["runworker", "--burst", "--worker-id", "w\x1b[2J"], "printable"),
        (["ingest_submissions", "--once", "--grace", "nan"], "not a number"),
        (["list_jobs", "--kind", "no.such"], "unknown kind 'no.such'"),
        (["list_jobs", "--lane", "nolane"], "unknown lane 'nolane'"),
        (["requeue_dead", "--kind", "no.such"], "unknown kind 'no.such'"),
        (["requeue_dead", "--lane", "nolane"], "unknown lane 'nolane'"),
        (["search", "lighthouse", "--limit", "\u0665"], "not a number"),
        (["search", "lighthouse", "--limit", " 5"], "not a number"),
        (["search", "lighthouse", "--limit", "1_0"], "not a number"),
    ],
)
def test_bad_input_is_exit_2_with_a_reason_and_nothing_done(args, reason):
    assert reason in refused(*args)
    assert not Job.objects.exists()
    assert not OpsToken.objects.exists()


def test_a_lower_case_rfc_3339_time_is_read():
    job = run_json("enqueue", "test.echo", "--run-at", "2030-01-01t10:00:00z")
    assert job["run_at"].startswith("2030-01-01T10:00:00")


def test_a_reason_too_long_for_the_column_is_bad_input_on_both_databases():
    from ingestion import reconciliation

    issue = reconciliation.record("quarantined_submission", "a.json", details={})
    assert "--by must be at most 200" in refused(
        "resolve_reconciliation_issue", str(issue.pk), "--comment", "x", "--by", "b" * 201
    )
    issue.refresh_from_db()
    assert issue.status == "open"


def test_filters_that_name_a_known_kind_or_lane_with_no_jobs_are_an_empty_answer():
    assert run_json("list_jobs", "--kind", "test.echo") == {"count": 0, "jobs": []}
    assert run_json("list_jobs", "--lane", "default") == {"count": 0, "jobs": []}
    # A kind no handler has any more (retired), but whose jobs are still there: known.
    retired = Job.objects.create(kind="retired.kind", lane="gone-lane", state=State.DEAD)
    assert run_json("list_jobs", "--kind", "retired.kind")["count"] == 1
    assert run_json("requeue_dead", "--lane", "gone-lane", "--dry-run")["requeued"] == [retired.pk]


def test_a_kind_and_lane_whose_jobs_all_succeeded_are_known_from_their_counts():
    """What a settle leaves of a retired kind in a removed lane: succeeded rows (which no
    index of states holds) and their attempt counts; the filters' check reads the counts."""
    Job.objects.create(kind="retired.kind", lane="gone-lane", state=State.SUCCEEDED)
    OutcomeCount.objects.create(
        kind="retired.kind",
        lane="gone-lane",
        outcome="succeeded",
        state="succeeded",
        bucket=0,
        count=1,
    )
    assert run_json("requeue_dead", "--kind", "retired.kind", "--dry-run")["requeued"] == []
    assert run_json("list_jobs", "--state", "dead", "--lane", "gone-lane")["count"] == 0
    JobCount.objects.create(lane="pruned-lane", state="succeeded", count=2)  # a recount's row
    assert run_json("requeue_dead", "--lane", "pruned-lane", "--dry-run")["requeued"] == []


def test_requeueing_a_running_job_says_it_is_running_not_that_it_holds_its_own_key():
    job = enqueueing.enqueue("test.echo", unique_key="report:7")
    claim_one()
    with pytest.raises(Exception) as raised:
        run("requeue_dead", str(job.pk))
    assert f"job {job.pk} is running, not dead" in str(raised.value)
    assert "held by" not in str(raised.value)


def test_run_schedule_now_refuses_a_schedule_no_longer_declared():
    Schedule.objects.create(
        name="discover:gone",
        kind="test.echo",
        every=60,
        declared=False,
        next_due_at=timezone.now() + timedelta(minutes=1),
    )
    assert exit_code("run_schedule_now", "discover:gone") == 1
    assert not Job.objects.exists()


def test_a_dead_job_still_requeues_by_kind():
    job = enqueueing.enqueue("test.permanent")
    engine.fail(claim_one(), failure(permanent=True), backoff_seconds=0)
    assert run_json("requeue_dead", "--kind", "test.permanent")["requeued"] == [job.pk]


# --- through the real command line -------------------------------------------------------


def manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "args",
    [
        ["show_job", "0"],
        ["cancel_job", "abc"],
        ["list_jobs", "--state", "nope"],
        ["enqueue", "test.echo", "--delay", "5", "--run-at", "2030-01-01T00:00:00Z"],
        ["create_ops_token", "x", "--scope", "admin"],
    ],
)
def test_a_usage_error_is_one_line_on_stderr(worker_env, args):
    done = manage(*args, env=worker_env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"manage.py {args[0]}: error: ")
    assert lines[0].endswith("(see --help)")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("args", "said"),
    [
        # Exit 1 and two lines before (helper-25 #4, #6).
        (["requeue-dead", "--all"], "unknown command 'requeue-dead' (did you mean requeue_dead?)"),
        (["help", "nosuch"], "unknown command 'nosuch' (manage.py help lists them)"),
        (["requeue_dead", "--a"], "manage.py requeue_dead: error: unrecognized arguments: --a"),
        # Ignored before: the command ran on the environment's settings (helper-25 #2).
        (["list_jobs", "--settings=does.not.exist"], "configuration error: cannot import"),
    ],
)
def test_a_misspelt_command_option_or_settings_module_is_one_line_and_exit_2(
    worker_env, args, said
):
    done = manage(*args, env=worker_env)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(said), line


@pytest.mark.django_db(transaction=True)
def test_settings_and_pythonpath_are_honoured(worker_env, tmp_path):
    (tmp_path / "othersettings.py").write_text(
        "from config.settings import *  # noqa\nHOLDFAST_LANES = {'default': {}, 'other': {}}\n"
    )
    done = manage(
        "runworker", "--lanes", "other", "--burst", f"--pythonpath={tmp_path}",
        "--settings=othersettings", env=worker_env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.django_db(transaction=True)
def test_text_the_terminal_cannot_encode_is_escaped_not_a_failure(worker_env):
    """A latin-1 stdout failed ``show_job``/``list_jobs`` half-way with exit 2 "bad input"
    at the first character it could not encode (helper-25 #5)."""
    job = enqueueing.enqueue("test.echo", {"city": "Łódź — 東京"})
    done = subprocess.run(
        [sys.executable, "manage.py", "show_job", str(job.pk)],
        cwd=REPO,
        env={**worker_env, "PYTHONIOENCODING": "latin-1"},
        capture_output=True,
        encoding="latin-1",
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "\\u0141\xf3d\\u017a \\u2014 \\u6771\\u4eac" in done.stdout, done.stdout


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("command", [["runworker", "--burst"], ["runscheduler", "--once"]])
def test_json_makes_the_log_of_a_long_running_command_json_lines(worker_env, command):
    done = manage(
        *command, "--json", env={**worker_env, "LOG_FORMAT": "console", "LOG_LEVEL": "INFO"}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines, done.stderr
    for line in lines:
        assert isinstance(json.loads(line), dict), line


@pytest.mark.django_db(transaction=True)
def test_an_invalid_worker_id_is_refused_before_anything_is_logged(worker_env):
    env = {**worker_env, "LOG_FORMAT": "console"}
    done = subprocess.run(
        [sys.executable, "manage.py", "runworker", "--burst", "--worker-id", os.fsdecode(b"w\xff")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "CommandError: --worker-id is not valid UTF-8 text"
    ], done.stderr


def test_an_unreadable_incoming_directory_is_one_line_and_exit_1(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.core.management.base import CommandError

    from ingestion.spool import Spool

    def denied(self: Spool) -> None:
        raise PermissionError(13, "Permission denied", str(self.incoming))

    monkeypatch.setattr(Spool, "listing", denied)
    with pytest.raises(CommandError) as raised:
        run("ingest_submissions", "--once", "--spool", str(tmp_path))
    assert raised.value.returncode == 1
    assert str(raised.value) == (
        f"the spool cannot be read: {tmp_path / 'incoming'}: Permission denied"
    )


def test_a_kind_filter_never_imports_a_module_outside_the_installed_apps() -> None:
    """``--kind this.x`` used to import ``this`` (printing the Zen of Python) to see
    whether it names a Django task; ``antigravity`` would start a browser."""
    import sys

    from jobs import operations

    sys.modules.pop("this", None)
    assert exit_code("requeue_dead", "--kind", "this.x") == 2
    assert "this" not in sys.modules
    assert operations.is_task("tests.testapp.tasks.add")
    assert not operations.is_task("this.x") and not operations.is_task("nodots")


def test_minus_zero_is_zero():
    """``-0`` is a number, and zero: stored as -0.0 it read "spacing -0 s" (audit)."""
    assert str(decimal_number("-0")) == "0.0"
    assert str(decimal_number("-0.0e3")) == "0.0"


def test_enqueue_into_a_lane_that_drops_prints_json_with_json(settings):
    """A documented outcome (exit 0) printed as plain text under --json: a script parsing
    the output broke on it (contract audit)."""
    settings.HOLDFAST_LANES = {"default": {"max_queued": 1, "on_full": "drop"}}
    assert run_json("enqueue", "test.echo")["state"] == "queued"
    assert run_json("enqueue", "test.echo") == {
        "id": None,
        "dropped": True,
        "reason": "the lane is full and drops new jobs",
    }
    assert run("enqueue", "test.echo").strip() == "dropped: the lane is full and drops new jobs"
    assert Job.objects.count() == 1


def test_text_from_outside_reaches_the_terminal_without_its_control_characters():
    """A spool file's name (or a fetched page's title, a job's error) printed raw: an
    escape sequence in it set the terminal's title, cleared the screen, recoloured it
    (helper-25 #3). Written as ``\\u001b``; ``--json`` decodes to the same text."""
    from ingestion import reconciliation

    subject = "nl\nx\x1b]0;pwned\x07\x1b[2J\x9b31m.json"
    reconciliation.record("quarantined_submission", subject)
    shown = run("list_reconciliation_issues")
    assert "\x1b" not in shown and "\x07" not in shown and "\x9b" not in shown
    assert "\\u001b]0;pwned\\u0007\\u001b[2J\\u009b31m.json" in shown
    [issue] = run_json("list_reconciliation_issues")["issues"]
    assert issue["subject"] == subject


@pytest.mark.django_db(transaction=True)
def test_a_refusal_echoing_its_input_writes_no_control_character(worker_env):
    done = manage("enqueue", "no.such\x1b[2J.kind", env=worker_env)
    assert done.returncode == 2, done.stderr
    assert "\x1b" not in done.stderr and "[2J.kind" in done.stderr, done.stderr
