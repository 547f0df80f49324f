"""``prune_jobs`` stopped midway (Ctrl-C, a service stop's SIGTERM) in a real process: the
batches already committed are said, in one line and in the log, never a traceback or
silence; the batch in flight rolls back, and the counts stay true."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from django.db import connection

from jobs import counts
from jobs.models import Job
from tests.conftest import REPO, on_postgres

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

TOTAL = 150_000
COLUMNS = (
    "kind, lane, args, priority, state, run_at, attempts, max_attempts, lease_seconds, "
    "lease_token, cancel_requested, last_error, created_at, updated_at, finished_at, locks"
)


def fill_finished_jobs(n: int) -> None:
    """``n`` succeeded jobs that finished long ago, in one statement, then counted."""
    with connection.cursor() as cursor:
        if on_postgres():
            cursor.execute(
                f"INSERT INTO jobs_job ({COLUMNS}) SELECT 'test.echo', 'default', '{{}}', 0, "
                "'succeeded', now() - interval '30 days', 1, 3, 60, 1, false, '', now(), now(), "
                "now() - interval '30 days', '[]' FROM generate_series(1, %s)",
                [n],
            )
        else:
            cursor.execute(
                "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < %s) "
                f"INSERT INTO jobs_job ({COLUMNS}) SELECT 'test.echo', 'default', '{{}}', 0, "
                "'succeeded', '2020-01-01 00:00:00', 1, 3, 60, 1, 0, '', '2020-01-01 00:00:00', "
                "'2020-01-01 00:00:00', '2020-01-01 00:00:00', '[]' FROM c",
                [n],
            )
    counts.recount()


def interruptible() -> None:
    """Runs in the child before exec: a shell's background job (``cmd &``, as CI scripts start
    suites) inherits SIGINT ignored, and Python keeps it ignored, so Ctrl-C is put back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_prune_says_what_it_deleted(worker_env, signum):
    fill_finished_jobs(TOTAL)
    process = subprocess.Popen(
        [sys.executable, str(REPO / "manage.py"), "prune_jobs", "--older-than", "14d"],
        cwd=REPO,
        env=worker_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    deadline = time.monotonic() + 60
    while Job.objects.count() == TOTAL and time.monotonic() < deadline:
        time.sleep(0.02)  # until the first batch has committed
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    left = Job.objects.count()
    assert 0 < left < TOTAL, (left, err[-2000:])
    assert process.returncode == 128 + signum, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    name = signal.Signals(signum).name
    deleted = TOTAL - left
    assert f"interrupted by {name}; {deleted} finished job(s) were pruned before it" in err
    [logged] = [
        line for line in (json.loads(text) for text in err.splitlines() if text.startswith("{"))
        if line.get("event") == "jobs_pruned"
    ]  # fmt: skip
    assert logged["count"] == deleted
    assert logged["interrupted"] in ("KeyboardInterrupt", f"Interrupted: {name}")
    assert counts.by_lane()[("default", "succeeded")] == left  # the counts followed
