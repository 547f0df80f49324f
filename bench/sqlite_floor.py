"""Where a SQLite job's time goes: the worker's own statements against the raw loop.

    .venv/bin/python bench/sqlite_floor.py [--jobs N] [--rounds R]

One migrated SQLite file in a temporary directory (WAL, ``synchronous=NORMAL``, as
``config/settings.py``), N queued no-op jobs per measurement, R interleaved rounds,
medians printed. Each row is jobs/s and µs a job, and its ratio to the raw loop:

* ``raw loop``: ``bench/raw.py``'s claim/complete loop (two commits a job), the bound of
  ``bench/run.py``'s SQLite worker row;
* ``statements, k per commit``: the worker's own settle and claim statements
  (``jobs.sql``: lease row, job row, attempt counter, claim) on a plain sqlite3 connection
  opened as Django opens it (foreign keys on, declared types parsed), no Django and no
  worker around them: k settled and k claimed jobs per ``BEGIN IMMEDIATE`` … ``COMMIT``.
  k = 1 is what a worker commits today, so it is the floor of the worker row; larger k
  shows what settling several jobs in one commit would buy;
* ``sql.settle_and_claim loop``: the engine's SQLite statement layer in this process,
  one job per call, no handler;
* ``worker, in process``: ``WorkerProcess(burst=True).run()`` in this process at
  ``LOG_LEVEL=WARNING`` (``bench/run.py`` times a ``manage.py runworker`` process).

The differences are the costs of each layer: statements, the engine's Python around them,
the worker's. Not a target of its own; docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.raw import Target, claim_complete_loop, insert_bulk  # noqa: E402

KIND = "bench.noop"
SETTLE = {
    "attempt": 1,
    "outcome": "succeeded",
    "error_class": "",
    "error_message": "",
    "traceback": "",
    "context": "{}",
    "state": "succeeded",
    "uncharge": 0,
    "result": None,
    "last_error": None,
    "delay_modifier": "+0.000 seconds",
    "kind": KIND,
    "lane": "default",
    "worker": "floor",
}


class _NoBarrier:
    def wait(self) -> None:
        return None


def _reset(target: Target, n: int) -> None:
    conn = target.connect()
    conn.execute("BEGIN IMMEDIATE")
    for table in ("jobs_lease", "jobs_job"):
        conn.execute(f"DELETE FROM {table}")
    conn.execute("COMMIT")
    conn.close()
    insert_bulk(target, n)
    conn = target.connect()
    conn.execute("ANALYZE jobs_job")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def _django_like(path: str) -> sqlite3.Connection:
    """A connection opened as Django's SQLite backend opens it, with Holdfast's pragmas."""
    conn = sqlite3.connect(
        path,
        isolation_level=None,
        timeout=20,
        detect_types=sqlite3.PARSE_DECLTYPES | sqlite3.PARSE_COLNAMES,
    )
    for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON"):
        conn.execute(f"PRAGMA {pragma}")
    return conn


def raw_loop(target: Target, n: int) -> float:
    _reset(target, n)
    start = time.perf_counter()
    claim_complete_loop(target, "raw", _NoBarrier())
    return time.perf_counter() - start


def statements(target: Target, n: int, per_commit: int) -> float:
    """The worker's statements, ``per_commit`` settles and claims in each commit."""
    from jobs import sql

    claim = sql._sqlite_native(sql._sqlite_claim_query(False, ""))
    lease, job, count = (
        sql._sqlite_native(q)
        for q in (sql.SQLITE_SETTLE_LEASE, sql.SQLITE_SETTLE_JOB, sql.SQLITE_COUNT_ATTEMPT)
    )
    _reset(target, n)
    conn = _django_like(target.path)
    cursor = conn.cursor()
    pending: list[tuple[int, int]] = []
    done = 0
    start = time.perf_counter()
    while True:
        cursor.execute("BEGIN IMMEDIATE")
        for job_id, token in pending:
            params: dict[str, Any] = dict(SETTLE, job_id=job_id, token=token)
            params["took"] = cursor.execute(lease, params).fetchone()[0]
            cursor.execute(job, params)
            cursor.execute(count, params)
        done += len(pending)
        pending = []
        for _ in range(per_commit):
            row = cursor.execute(claim, SETTLE).fetchone()
            if row is None:
                break
            json.loads(row[3])
            pending.append((row[0], row[6]))
        cursor.execute("COMMIT")
        if not pending:
            break
    elapsed = time.perf_counter() - start
    conn.close()
    if done != n:
        raise RuntimeError(f"settled {done} jobs of {n}")
    return elapsed


def _django_step(name: str, n: int) -> float:
    """One in-process Django measurement, run in a child (``--django NAME N``)."""
    import django

    django.setup()
    from django.db import connection

    from jobs import engine, sql
    from jobs.enqueueing import enqueue_many
    from jobs.worker import WorkerProcess

    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM jobs_lease")
        cursor.execute("DELETE FROM jobs_job")
    enqueue_many(KIND, [{"i": i} for i in range(n)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")
        cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    start = time.perf_counter()
    if name == "worker":
        WorkerProcess(worker_id="floor", burst=True).run()
    else:
        kinds = (KIND,)
        claimed = sql.claim("floor", None, None, kinds)
        while claimed is not None:
            claimed = sql.settle_and_claim(
                claimed, engine.SUCCEEDED.how, "floor", None, None, kinds
            )[1]
    return time.perf_counter() - start


def django_measure(env: dict[str, str], name: str, n: int) -> float:
    done = subprocess.run(
        [sys.executable, __file__, "--django", name, str(n)],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--django", nargs=2, metavar=("NAME", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.django:
        print(_django_step(args.django[0], int(args.django[1])))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="holdfast-floor-"))
    path = tmp / "floor.sqlite3"
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="bench.settings",
        DATABASE_URL=f"sqlite:///{path}",
        DJANGO_SECRET_KEY="holdfast-bench-not-a-secret",
        HOLDFAST_VAR_DIR=str(tmp / "var"),
        LOG_LEVEL="WARNING",
        PYTHONPATH=str(ROOT),
    )
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    os.environ.update(DJANGO_SETTINGS_MODULE="bench.settings", DATABASE_URL=env["DATABASE_URL"])
    import django

    django.setup()
    target = Target("sqlite", path=str(path))
    n = args.jobs
    rows: dict[str, Callable[[], float]] = {
        "raw loop (2 commits a job)": lambda: raw_loop(target, n),
        "statements, 1 per commit": lambda: statements(target, n, 1),
        "statements, 4 per commit": lambda: statements(target, n, 4),
        "statements, 16 per commit": lambda: statements(target, n, 16),
        "sql.settle_and_claim loop": lambda: django_measure(env, "sql", n),
        "worker, in process": lambda: django_measure(env, "worker", n),
    }
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    for round_ in range(args.rounds):
        for name, measure in rows.items():
            seconds[name].append(measure())
        print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    raw = statistics.median(seconds["raw loop (2 commits a job)"])
    print(f"SQLite {sqlite3.sqlite_version}, {n} jobs, medians of {args.rounds} rounds")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(
            f"{name:28s} {n / median:9,.0f} jobs/s {median / n * 1e6:7.1f} µs/job "
            f"{raw / median:5.2f}x raw"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
