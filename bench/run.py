"""Holdfast's benchmark: one command, its own scratch databases, one table of figures.

    .venv/bin/python bench/run.py [--db sqlite|postgres|both] [--jobs N] [--quick]
                                  [--claim-scale F] [--history N]

For each database it creates a scratch database (PostgreSQL: ``holdfast_bench`` on the
server of ``BENCH_DATABASE_URL``, default ``postgres://postgres@127.0.0.1:5432``; SQLite: a
file in a temporary directory), migrates it with ``manage.py migrate``, and measures:

* enqueue rate: ``jobs.enqueueing.enqueue`` one job per transaction, and ``enqueue_many``;
  next to raw inserts of the same rows (one per commit; ``COPY``/``executemany`` in bulk);
* processed jobs/s of a no-op handler with 1 and 2 real ``manage.py runworker --burst``
  processes, next to the raw claim/complete bound (``bench/raw.py``) with as many
  processes, measured in the same run on the same table, and on a minimal table of its
  own (one partial index, only the columns the loop needs) as a second bound;
* PostgreSQL only: row writes and WAL bytes per job of the one-process runs, the backends
  of one running worker process, and the claim of one runnable job on an empty queue
  against behind jobs blocked by a held lock, in a full lane, or delayed;
* with ``--history N`` (PostgreSQL, off by default): claim, ``queue_status``, a metrics
  scrape and ``prune_jobs`` batches with N finished jobs in the tables.

Throughput is read from the timestamps the run wrote into the rows, not from process wall
time, so Python and Django start-up are excluded: the window runs from the moment the
last worker made its first claim (every worker is running) to the last finish (the
queue is drained), and the figure is the jobs finished in that window divided by its
length. With one worker that is first claim to last finish. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from bench.raw import (  # noqa: E402
    MINIMAL_TABLE,
    Target,
    claim_complete_loop,
    insert_bulk,
    insert_single,
    seed_minimal,
)

DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432/holdfast_bench"
WORKER_TIMEOUT = 600

# Targets from the issue (PostgreSQL only).
TARGET_ONE_WORKER = 0.8  # x the raw bound with one process
TARGET_SCALING = 1.8  # two workers x one worker
TARGET_SCALING_OF_RAW = 0.9  # issue 16: two workers' scaling x the raw loop's, same run
TARGET_ENQUEUE_MANY = 100_000  # jobs/s (issue 16; 50,000 before)
TARGET_WAKE_P50_MS = 50.0  # an idle PostgreSQL worker claims a new job within this (p50)
WAKE_SAMPLES = 40
# Issue 16 (PostgreSQL only).
TARGET_ONE_WORKER_MINIMAL = 1.0  # x the minimal-table raw bound with one process
TARGET_CLAIM_WAITING = 1.5  # claim cost with non-runnable jobs waiting, x the empty queue
TARGET_CLAIM_HISTORY = 1.2  # claim cost with finished history, x the empty table
TARGET_READ_MS = 100.0  # queue_status, a metrics scrape
TARGET_BACKENDS = 2  # PostgreSQL connections per worker process
TARGET_WRITES_CUT = 0.30  # row writes and WAL bytes per job: at least this much below today's
TARGET_ENQUEUE_ONE = 0.8  # enqueue(), one job per transaction, x the raw INSERT + COMMIT loop
TARGET_INFO_LOGGING = 0.8  # one worker at LOG_LEVEL=INFO x the same worker at WARNING
TARGET_SQLITE_ENQUEUE_MANY = 0.5  # SQLite enqueue_many x raw executemany (all databases' targets)
TARGET_SQLITE_WORKER = 0.6  # issue 16: one SQLite worker x the SQLite raw loop
# Today's figures (issue 16's baseline: the engine as of the issue-12 merge, b0a35e7).
# Row writes per job is a count, the same on any machine (job u2, lease i1 u1, jobevent i2,
# attemptcount u1; dropping indexes does not change it). WAL bytes per job: 2,587, measured
# by this row at 277930e (the engine this write work started from, after the
# indexes migration 0006_i16; it wrote one row more per job than at the filing,
# the jobcount upsert, so the baseline is a little higher than the filing's would be).
BASELINE_ROW_WRITES = 7.0
BASELINE_WAL_BYTES: float | None = 2587.0


# --- databases -------------------------------------------------------------------------


@dataclass
class Database:
    vendor: str  # postgres | sqlite
    url: str  # DATABASE_URL for Django processes
    target: Target  # for the raw drivers
    version: str = ""
    notes: str = ""


def _pg_urls() -> tuple[str, str, str]:
    """(scratch database URL, maintenance URL, scratch database name)."""
    parts = urlsplit(os.environ.get("BENCH_DATABASE_URL", "").strip() or DEFAULT_SERVER)
    name = parts.path.lstrip("/") or "holdfast_bench"
    if "bench" not in name:
        raise SystemExit(
            f"BENCH_DATABASE_URL names database {name!r}; the benchmark drops and recreates "
            "it, so its name must contain 'bench'"
        )
    scheme = "postgresql" if parts.scheme in ("postgres", "postgresql") else parts.scheme
    scratch = urlunsplit((scheme, parts.netloc, "/" + name, parts.query, ""))
    maintenance = urlunsplit((scheme, parts.netloc, "/postgres", parts.query, ""))
    return scratch, maintenance, name


@contextmanager
def postgres_database(keep: bool) -> Iterator[Database]:
    scratch, maintenance, name = _pg_urls()
    with psycopg.connect(maintenance, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        db = Database("postgres", scratch, Target("postgres", dsn=scratch))
        with psycopg.connect(scratch, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]
            sync = conn.execute("SHOW synchronous_commit").fetchone()[0]
            fsync = conn.execute("SHOW fsync").fetchone()[0]
            autovacuum = conn.execute("SHOW autovacuum").fetchone()[0]
        db.version = f"PostgreSQL {version.split()[0]}"
        db.notes = f"synchronous_commit={sync}, fsync={fsync}, autovacuum={autovacuum}"
        yield db
    finally:
        if not keep:
            with psycopg.connect(maintenance, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def sqlite_database(tmp: Path) -> Iterator[Database]:
    path = tmp / "bench.sqlite3"
    db = Database("sqlite", f"sqlite:///{path}", Target("sqlite", path=str(path)))
    db.version = f"SQLite {sqlite3.sqlite_version}"
    db.notes = "WAL, synchronous=NORMAL"
    yield db


def reset(db: Database, analyze_after_seed: int = 0) -> None:
    """Empty the job tables; with ``analyze_after_seed``, then queue that many no-op jobs."""
    conn = db.target.connect()
    try:
        if db.vendor == "postgres":
            conn.execute("TRUNCATE jobs_lease, jobs_job, jobs_worker RESTART IDENTITY CASCADE")
            conn.commit()
        else:
            conn.execute("BEGIN IMMEDIATE")
            for table in ("jobs_lease", "jobs_job", "jobs_worker"):
                conn.execute(f"DELETE FROM {table}")
            conn.execute("COMMIT")
    finally:
        conn.close()
    if analyze_after_seed:
        insert_bulk(db.target, analyze_after_seed)
        conn = db.target.connect()
        try:
            if db.vendor == "postgres":
                conn.autocommit = True
                conn.execute("ANALYZE jobs_job")
                conn.execute("CHECKPOINT")  # so no checkpoint from the seeding lands mid-run
            else:
                conn.execute("ANALYZE jobs_job")
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            conn.close()


# --- Django subprocesses ---------------------------------------------------------------


def django_env(db: Database, tmp: Path, log_level: str = "WARNING") -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="bench.settings",
        DATABASE_URL=db.url,
        DJANGO_SECRET_KEY="holdfast-bench-not-a-secret",
        HOLDFAST_VAR_DIR=str(tmp / "var"),
        LOG_LEVEL=log_level,
        LOG_FORMAT="json",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    return env


def manage(db: Database, tmp: Path, *args: str) -> None:
    subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=django_env(db, tmp), check=True
    )


def inproc(db: Database, tmp: Path, command: str, n: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.inproc", command, str(n)],
        cwd=ROOT,
        env=django_env(db, tmp),
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- timing from the rows --------------------------------------------------------------


@dataclass
class Throughput:
    jobs: int  # jobs that succeeded
    rate: float  # jobs/s over the window where every worker was busy
    window: float  # seconds
    in_window: int  # jobs finished inside the window
    span: float  # first claim to last finish, seconds
    wall: float  # process start to the last exit, start-up included
    writes: Writes | None = None  # row writes and WAL over the run (PostgreSQL, if asked)

    @property
    def span_rate(self) -> float:
        return self.jobs / self.span if self.span else 0.0


@dataclass
class Writes:
    """Row writes (pg_stat_user_tables) and WAL bytes (pg_current_wal_lsn) over a run."""

    wal: int  # bytes, cluster-wide
    tables: dict[str, tuple[int, int, int, int]]  # table -> (ins, upd, del, hot_upd)

    @property
    def rows(self) -> int:
        return sum(ins + upd + dele for ins, upd, dele, _ in self.tables.values())

    def per_job(self, jobs: int) -> str:
        parts = []
        for table, (ins, upd, dele, hot) in sorted(self.tables.items()):
            got = [
                f"{label}{n / jobs:.2g}" for label, n in (("i", ins), ("u", upd), ("d", dele)) if n
            ]
            if upd:
                got.append(f"hot {hot / jobs:.2g}")
            if got:
                parts.append(f"{table.removeprefix('jobs_')} " + " ".join(got))
        return "; ".join(parts)


COUNTERS = """
SELECT relname, n_tup_ins, n_tup_upd, n_tup_del, n_tup_hot_upd FROM pg_stat_user_tables
"""


def pg_counters(db: Database) -> tuple[int, dict[str, tuple[int, int, int, int]]]:
    """(WAL position in bytes, per-table row counters), from a fresh connection.

    Backends report their counters when they go idle (at most once a second) and when they
    exit; this reads until two reads 0.3 s apart agree (at most 5 s), so the exits of the
    measured processes have been counted.
    """
    deadline = time.monotonic() + 5
    last: dict[str, tuple[int, int, int, int]] | None = None
    while True:
        conn = db.target.connect()
        try:
            conn.autocommit = True
            lsn = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()[0]
            tables = {r[0]: tuple(r[1:]) for r in conn.execute(COUNTERS).fetchall()}
        finally:
            conn.close()
        if tables == last or time.monotonic() > deadline:
            return int(lsn), tables  # type: ignore[return-value]
        last = tables
        time.sleep(0.3)


def writes_since(db: Database, before: tuple[int, dict[str, tuple[int, int, int, int]]]) -> Writes:
    lsn, tables = pg_counters(db)
    delta = {}
    for table, now in tables.items():
        was = before[1].get(table, (0, 0, 0, 0))
        diff = tuple(a - b for a, b in zip(now, was, strict=True))
        if any(diff):
            delta[table] = diff
    return Writes(lsn - before[0], delta)  # type: ignore[arg-type]


def _ts(value: Any) -> float:
    if isinstance(value, datetime):
        return value.timestamp()
    return datetime.fromisoformat(value).replace(tzinfo=UTC).timestamp()


def throughput(rows: list[tuple[Any, Any, Any]], wall: float) -> Throughput:
    """``rows``: (worker, started, finished) per job; see the module docstring."""
    per_worker: dict[str, tuple[float, float]] = {}
    spans = []
    for worker, started, finished in rows:
        s, f = _ts(started), _ts(finished)
        spans.append((s, f))
        first, last = per_worker.get(worker, (s, f))
        per_worker[worker] = (min(first, s), max(last, f))
    if not spans:
        raise RuntimeError("no job finished")
    t0 = max(first for first, _ in per_worker.values())  # every worker has started
    t1 = max(f for _, f in spans)  # the queue is drained
    span = t1 - min(s for s, _ in spans)
    in_window = sum(1 for _, f in spans if f > t0)
    window = t1 - t0
    if len(per_worker) == 1:  # first claim to last finish: every job counts
        in_window, window = len(spans), span
    rate = in_window / window if window > 0 else 0.0
    return Throughput(len(spans), rate, window, in_window, span, wall)


def fetch(db: Database, sql: str) -> list[tuple[Any, ...]]:
    conn = db.target.connect()
    try:
        return list(conn.execute(sql).fetchall())
    finally:
        conn.close()


def check_drained(db: Database, n: int, table: str = "jobs_job") -> None:
    counts = dict(fetch(db, f"SELECT state, count(*) FROM {table} GROUP BY state"))
    if counts != {"succeeded": n}:
        raise RuntimeError(f"expected {n} succeeded jobs, found {counts}")


def raw_workers(
    db: Database, n: int, workers: int, table: str = "jobs_job", counters: bool = False
) -> Throughput:
    """The raw claim/complete loop in ``workers`` processes on ``table``: Holdfast's own
    ``jobs_job`` or the minimal table (``bench/raw.py``)."""
    if table == "jobs_job":
        reset(db, analyze_after_seed=n)
    else:
        seed_minimal(db.target, n)
    before = pg_counters(db) if counters else None
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(workers)
    start = time.perf_counter()
    procs = [
        ctx.Process(target=claim_complete_loop, args=(db.target, f"raw-{i}", barrier, table))
        for i in range(workers)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(WORKER_TIMEOUT)
        if proc.exitcode != 0:
            raise RuntimeError(f"raw worker exited with {proc.exitcode}")
    wall = time.perf_counter() - start
    writes = writes_since(db, before) if before is not None else None
    check_drained(db, n, table)
    rows = fetch(db, f"SELECT leased_by, started_at, finished_at FROM {table}")
    got = throughput(rows, wall)
    got.writes = writes
    return got


def holdfast_workers(
    db: Database,
    tmp: Path,
    n: int,
    workers: int,
    log_level: str = "WARNING",
    counters: bool = False,
) -> Throughput:
    reset(db, analyze_after_seed=n)
    before = pg_counters(db) if counters else None
    env = django_env(db, tmp, log_level)
    logs = [tmp / f"worker-{db.vendor}-{workers}-{i}-{log_level}.log" for i in range(workers)]
    start = time.perf_counter()
    procs = []
    for i, log_path in enumerate(logs):
        with open(log_path, "w") as log_file:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "manage.py",
                        "runworker",
                        "--burst",
                        "--worker-id",
                        f"bench-{i}",
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
            )
    for proc, log_path in zip(procs, logs, strict=True):
        code = proc.wait(WORKER_TIMEOUT)
        if code != 0:
            tail = log_path.read_text()[-3000:]
            raise RuntimeError(f"runworker exited with {code}:\n{tail}")
    wall = time.perf_counter() - start
    writes = writes_since(db, before) if before is not None else None
    check_drained(db, n)
    rows = fetch(
        db,
        "SELECT worker_id, acquired_at, released_at FROM jobs_lease WHERE outcome = 'succeeded'",
    )
    got = throughput(rows, wall)
    got.writes = writes
    return got


def wake_latency(db: Database, tmp: Path, samples: int) -> list[float]:
    """Milliseconds from each job's insert to its claim by an idle worker, sorted.

    Jobs are enqueued one at a time while one ``runworker`` waits. On PostgreSQL the
    worker's poll interval is set to 5 s, so only LISTEN/NOTIFY can explain a fast claim;
    SQLite has no NOTIFY and shows the default 1 s polling.
    """
    reset(db)
    env = django_env(db, tmp)
    if db.vendor == "postgres":
        env["HOLDFAST_POLL_SECONDS"] = "5"
    log_path = tmp / f"worker-{db.vendor}-wake.log"
    with open(log_path, "w") as log_file:
        worker = subprocess.Popen(
            [sys.executable, "manage.py", "runworker", "--worker-id", "bench-idle"],
            cwd=ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while not fetch(db, "SELECT 1 FROM jobs_worker WHERE stopped_at IS NULL"):
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError(f"idle worker did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        time.sleep(1.0)  # let it reach its idle wait
        inproc(db, tmp, "enqueue-spaced", samples)
        deadline = time.monotonic() + 60
        query = "SELECT count(*) FROM jobs_job WHERE state = 'succeeded'"
        while fetch(db, query)[0][0] < samples:
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs not claimed:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
    finally:
        worker.terminate()
        worker.wait(30)
    rows = fetch(
        db,
        "SELECT l.acquired_at, j.created_at FROM jobs_lease l JOIN jobs_job j ON j.id = l.job_id",
    )
    return sorted((_ts(acquired) - _ts(created)) * 1000 for acquired, created in rows)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def median_of(runs: list[Throughput]) -> Throughput:
    return sorted(runs, key=lambda t: t.rate)[len(runs) // 2]


# --- the run ---------------------------------------------------------------------------


@dataclass
class Row:
    db: str
    what: str
    jobs: int
    seconds: float
    rate: float
    bound: float | None = None  # the raw figure this one is compared with
    note: str = ""
    checks: list[tuple[str, bool]] = field(default_factory=list)
    factor: float | None = None  # the x column of a row that is not a rate (a cost ratio)
    latency: float | None = None  # seconds per operation, for a row that is not a rate

    @property
    def ratio(self) -> float | None:
        if self.factor is not None:
            return self.factor
        return self.rate / self.bound if self.bound else None


@dataclass
class Options:
    jobs: int
    single_jobs: int
    bulk_jobs: int
    repeat: int
    info_logging: bool
    profile: bool
    keep: bool
    claim_scale: float = 1.0  # x the sizes (50,000 / 50,000 / 400,000) for claim rows
    history: int = 0  # finished jobs for the --history rows (0: none)


def measure(db: Database, tmp: Path, opts: Options, say: Any) -> tuple[list[Row], str]:
    rows: list[Row] = []
    pg = db.vendor == "postgres"
    say(f"[{db.vendor}] migrating a scratch database")
    manage(db, tmp, "migrate", "--noinput", "-v", "0")

    # Raw and Holdfast alternate, --repeat rounds, medians: one run each was at the mercy
    # of whatever else the machine was doing at that moment.
    raw_single, single_rates, raw_bulk, bulk_rates = [], [], [], []
    for attempt in range(opts.repeat):
        round_note = f" (round {attempt + 1} of {opts.repeat})" if opts.repeat > 1 else ""
        say(f"[{db.vendor}] enqueue, one job per transaction ({opts.single_jobs} jobs){round_note}")
        reset(db)
        raw_single.append(opts.single_jobs / insert_single(db.target, opts.single_jobs))
        reset(db)
        single_rates.append(inproc(db, tmp, "enqueue-single", opts.single_jobs)["rate"])
        say(f"[{db.vendor}] enqueue_many ({opts.bulk_jobs} jobs){round_note}")
        reset(db)
        raw_bulk.append(opts.bulk_jobs / insert_bulk(db.target, opts.bulk_jobs))
        reset(db)
        bulk_rates.append(inproc(db, tmp, "enqueue-bulk", opts.bulk_jobs)["rate"])
    rounds = f"median of {opts.repeat}; " if opts.repeat > 1 else ""
    rate = _median(single_rates)
    single_row = Row(
        db.vendor,
        "enqueue(): 1 job per transaction",
        opts.single_jobs,
        opts.single_jobs / rate,
        rate,
        _median(raw_single),
        f"{rounds}bound: raw INSERT + COMMIT loop",
    )
    if pg:
        single_row.checks.append(
            (
                f"≥ {TARGET_ENQUEUE_ONE:.2f}x bound",
                (single_row.ratio or 0.0) >= TARGET_ENQUEUE_ONE,
            )
        )
    rows.append(single_row)
    rate = _median(bulk_rates)
    bulk_row = Row(
        db.vendor,
        "enqueue_many(): one call",
        opts.bulk_jobs,
        opts.bulk_jobs / rate,
        rate,
        _median(raw_bulk),
        rounds + ("bound: raw COPY" if pg else "bound: raw executemany, 1 transaction"),
    )
    if pg:
        bulk_row.checks.append((f"≥ {TARGET_ENQUEUE_MANY:,} jobs/s", rate >= TARGET_ENQUEUE_MANY))
    else:
        bulk_row.checks.append(
            (
                f"≥ {TARGET_SQLITE_ENQUEUE_MANY:.2f}x bound",
                (bulk_row.ratio or 0.0) >= TARGET_SQLITE_ENQUEUE_MANY,
            )
        )
    rows.append(bulk_row)

    hold: dict[int, Throughput] = {}
    info_runs: list[Throughput] = []  # one worker at LOG_LEVEL=INFO, in the same rounds
    for workers in (1, 2):
        # Alternate raw and Holdfast runs so both sample the same machine conditions.
        raw_runs, hold_runs, minimal_runs = [], [], []
        for attempt in range(opts.repeat):
            round_note = f" (round {attempt + 1} of {opts.repeat})" if opts.repeat > 1 else ""
            say(
                f"[{db.vendor}] raw claim/complete bound, {workers} process(es), "
                f"{opts.jobs} jobs{round_note}"
            )
            count = pg and workers == 1  # row writes and WAL of the one-process runs
            raw_runs.append(raw_workers(db, opts.jobs, workers, counters=count))
            say(
                f"[{db.vendor}] raw claim/complete bound on the minimal table, "
                f"{workers} process(es), {opts.jobs} jobs{round_note}"
            )
            minimal_runs.append(raw_workers(db, opts.jobs, workers, MINIMAL_TABLE, count))
            say(f"[{db.vendor}] runworker --burst x {workers}, {opts.jobs} jobs{round_note}")
            hold_runs.append(holdfast_workers(db, tmp, opts.jobs, workers, counters=count))
            if workers == 1 and opts.info_logging:
                say(
                    f"[{db.vendor}] runworker x 1 with LOG_LEVEL=INFO, {opts.jobs} jobs{round_note}"
                )
                info_runs.append(holdfast_workers(db, tmp, opts.jobs, 1, "INFO"))
        raw, got = median_of(raw_runs), median_of(hold_runs)
        minimal = median_of(minimal_runs)
        hold[workers] = got
        plural = "es" if workers > 1 else ""
        rows.append(
            Row(
                db.vendor,
                f"raw bound: {workers} process{plural}",
                raw.jobs,
                raw.window,
                raw.rate,
                raw.rate,
                _window_note(raw, workers),
            )
        )
        rows.append(
            Row(
                db.vendor,
                f"raw bound, minimal table: {workers} process{plural}",
                minimal.jobs,
                minimal.window,
                minimal.rate,
                raw.rate,
                f"{MINIMAL_TABLE}: one partial index; {_window_note(minimal, workers)}",
            )
        )
        row = Row(
            db.vendor,
            f"runworker x {workers}",
            got.jobs,
            got.window,
            got.rate,
            raw.rate,
            _window_note(got, workers),
        )
        to_minimal = got.rate / minimal.rate if minimal.rate else 0.0
        row.note += f"; {to_minimal:.2f}x the minimal-table bound ({minimal.rate:,.0f}/s)"
        if pg and workers == 1:
            row.checks.append(
                (
                    f"≥ {TARGET_ONE_WORKER:.2f}x bound",
                    row.ratio is not None and row.ratio >= TARGET_ONE_WORKER,
                )
            )
            row.checks.append(
                (
                    f"≥ {TARGET_ONE_WORKER_MINIMAL:.2f}x minimal bound",
                    to_minimal >= TARGET_ONE_WORKER_MINIMAL,
                )
            )
        if not pg and workers == 1:
            row.checks.append(
                (
                    f"≥ {TARGET_SQLITE_WORKER:.2f}x bound",
                    row.ratio is not None and row.ratio >= TARGET_SQLITE_WORKER,
                )
            )
        if workers == 2:
            scaling = got.rate / hold[1].rate
            raw_scaling = raw.rate / next(r.rate for r in rows if r.what == "raw bound: 1 process")
            row.note += f"; {scaling:.2f}x one worker (raw: {raw_scaling:.2f}x)"
            if pg:
                row.checks.append(
                    (f"≥ {TARGET_SCALING:.2f}x one worker", scaling >= TARGET_SCALING)
                )
                row.checks.append(
                    (
                        f"scaling ≥ {TARGET_SCALING_OF_RAW:.2f}x the raw loop's",
                        scaling >= TARGET_SCALING_OF_RAW * raw_scaling,
                    )
                )
        rows.append(row)
        if pg and workers == 1:
            rows.append(writes_row(db, got, raw, minimal))

    if info_runs:
        info = median_of(info_runs)
        warning = hold[1]
        info_row = Row(
            db.vendor,
            "runworker x 1, LOG_LEVEL=INFO",
            info.jobs,
            info.window,
            info.rate,
            warning.rate,
            "JSON log lines to a file; x bound = over the same worker at WARNING, "
            f"alternated with it; {_window_note(info, 1)}",
        )
        if pg:
            info_row.checks.append(
                (
                    f"≥ {TARGET_INFO_LOGGING:.2f}x WARNING",
                    (info_row.ratio or 0.0) >= TARGET_INFO_LOGGING,
                )
            )
        rows.append(info_row)

    say(f"[{db.vendor}] wake-up latency of an idle worker, {WAKE_SAMPLES} jobs")
    latencies = wake_latency(db, tmp, WAKE_SAMPLES)
    p50, p90 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.9)]
    wake_row = Row(
        db.vendor,
        "idle worker: insert → claim",
        len(latencies),
        p50 / 1000,
        0.0,
        None,
        f"p50 {p50:.1f} ms, p90 {p90:.1f} ms, max {latencies[-1]:.1f} ms"
        + (" (LISTEN/NOTIFY; polling every 5 s)" if pg else " (polling every 1 s)"),
    )
    if pg:
        wake_row.checks.append((f"p50 ≤ {TARGET_WAKE_P50_MS:.0f} ms", p50 <= TARGET_WAKE_P50_MS))
    rows.append(wake_row)

    if pg:
        say(f"[{db.vendor}] PostgreSQL backends of one running worker process")
        rows.append(backends_row(db, tmp))
        sizes = [round(n * opts.claim_scale) for n in CLAIM_SIZES]
        say(f"[{db.vendor}] claim cost with {', '.join(f'{n:,}' for n in sizes)} jobs waiting")
        rows += claim_rows(db, tmp, sizes, opts.repeat, say)
        if opts.history:
            say(f"[{db.vendor}] history: {opts.history:,} finished jobs (bulk SQL)")
            rows += history_rows(db, tmp, opts.history)

    report = ""
    if opts.profile:
        say(f"[{db.vendor}] profiling WorkerProcess(burst=True) in-process, {opts.jobs} jobs")
        reset(db)
        result = inproc(db, tmp, "profile", opts.jobs)
        report = (
            f"in-process worker, no profiler: {result['plain_rate']:,.0f} jobs/s, "
            f"{result['plain_us_per_job']:,.0f} µs/job wall, "
            f"{result['plain_cpu_us_per_job']:,.0f} µs/job CPU in the worker process\n"
            f"under cProfile: {result['profiled_seconds']:.2f} s for {result['jobs']} jobs\n"
            + result["report"]
        )
    return rows, report


# --- issue 16: writes, connections, claim cost, history (PostgreSQL) --------------------

CLAIM_SIZES = (50_000, 50_000, 400_000)  # blocked by a lock, in a full lane, delayed


def writes_row(db: Database, got: Throughput, raw: Throughput, minimal: Throughput) -> Row:
    """Row writes and WAL bytes per job of the one-worker run, beside the raw loops'."""
    assert got.writes and raw.writes and minimal.writes
    jobs = got.jobs
    rows_per_job = got.writes.rows / jobs
    wal_per_job = got.writes.wal / jobs
    raw_rows, raw_wal = raw.writes.rows / raw.jobs, raw.writes.wal / raw.jobs
    row = Row(
        db.vendor,
        "row writes, WAL per job: runworker x 1",
        jobs,
        0.0,
        0.0,
        None,
        f"{rows_per_job:.2f} row writes/job ({got.writes.per_job(jobs)}), "
        f"{wal_per_job:,.0f} WAL bytes/job; raw loop {raw_rows:.2f} rows, {raw_wal:,.0f} B; "
        f"minimal table {minimal.writes.rows / minimal.jobs:.2f} rows, "
        f"{minimal.writes.wal / minimal.jobs:,.0f} B (WAL is cluster-wide)",
        factor=rows_per_job / raw_rows if raw_rows else None,
    )
    cut = 1 - TARGET_WRITES_CUT
    row.checks.append(
        (
            f"rows ≤ {cut:.2f}x today's {BASELINE_ROW_WRITES:.2f}",
            rows_per_job <= cut * BASELINE_ROW_WRITES,
        )
    )
    if BASELINE_WAL_BYTES is None:
        row.checks.append((f"WAL ≤ {cut:.2f}x today's (no baseline recorded)", False))
    else:
        row.checks.append(
            (
                f"WAL ≤ {cut:.2f}x today's {BASELINE_WAL_BYTES:,.0f} B",
                wal_per_job <= cut * BASELINE_WAL_BYTES,
            )
        )
    return row


BACKENDS_APP = "holdfast-bench-backends"  # PGAPPNAME of the counted worker
BACKENDS = f"""
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = '{BACKENDS_APP}'
"""


def backends_row(db: Database, tmp: Path) -> Row:
    """PostgreSQL backends of one ``runworker`` (not ``--burst``): idle, then while it runs
    a job. The worker runs with ``PGAPPNAME`` set, so libpq names each of its connections
    (``application_name``); the highest count over about 1.5 s is taken in each phase."""
    reset(db)
    log_path = tmp / "worker-postgres-backends.log"
    env = django_env(db, tmp)
    env["PGAPPNAME"] = BACKENDS_APP
    with open(log_path, "w") as log_file:
        worker = subprocess.Popen(
            [sys.executable, "manage.py", "runworker", "--worker-id", "bench-backends"],
            cwd=ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )

    def wait_for(query: str, what: str) -> None:
        deadline = time.monotonic() + 30
        while not fetch(db, query):
            if time.monotonic() > deadline or worker.poll() is not None:
                raise RuntimeError(f"worker {what}:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)

    def most() -> int:
        seen = 0
        for _ in range(8):
            seen = max(seen, fetch(db, BACKENDS)[0][0])
            time.sleep(0.2)
        return seen

    try:
        wait_for("SELECT 1 FROM jobs_worker WHERE stopped_at IS NULL", "did not start")
        time.sleep(1.0)
        idle = most()
        conn = db.target.connect()
        try:
            conn.execute(
                "INSERT INTO jobs_job (kind, lane, args, priority, state, attempts, max_attempts,"
                " lease_seconds, lease_token, cancel_requested, last_error, locks)"
                " VALUES ('bench.sleep', 'default', '{\"seconds\": 4}', 0, 'queued', 0, 1,"
                " 60, 0, false, '', '[]')"
            )
            conn.execute("SELECT pg_notify('holdfast_jobs', 'default')")
            conn.commit()
        finally:
            conn.close()
        wait_for("SELECT 1 FROM jobs_job WHERE state = 'running'", "did not claim the job")
        time.sleep(0.5)  # past the heartbeat's first beat
        busy = most()
    finally:
        worker.terminate()
        worker.wait(30)
    row = Row(
        db.vendor,
        "PostgreSQL backends per worker process",
        1,
        0.0,
        0.0,
        None,
        f"{busy} while it runs a job, {idle} idle (pg_stat_activity by application_name)",
    )
    row.checks.append((f"≤ {TARGET_BACKENDS} running a job", busy <= TARGET_BACKENDS))
    return row


def _latency_row(
    db: Database, what: str, waiting: int, got: dict[str, Any], empty: float, target: float
) -> Row:
    factor = got["median"] / empty if empty else None
    row = Row(
        db.vendor,
        what,
        waiting,
        0.0,
        0.0,
        None,
        f"median {got['median'] * 1000:.2f} ms, p90 {got['p90'] * 1000:.2f} ms "
        f"of {got['samples']}; empty {empty * 1000:.2f} ms",
        factor=factor,
        latency=got["median"],
    )
    row.checks.append((f"≤ {target:.2f}x empty", factor is not None and factor <= target))
    return row


def claim_rows(
    db: Database, tmp: Path, sizes: list[int], repeat: int, say: Callable[[str], None]
) -> list[Row]:
    """The claim of one runnable job: empty queue, then behind each kind of waiting job.

    Each waiting row is compared with an empty-queue claim of the same lane limits measured
    just before it (``bench.inproc.claim_cost``); the whole set runs ``repeat`` times and
    each row shows the run of its median ratio (one set alone moved by a third on a
    drifting VM)."""
    blocked, _, _ = sizes
    runs = []
    for attempt in range(repeat):
        if repeat > 1:
            say(f"[{db.vendor}] claim cost, round {attempt + 1} of {repeat}")
        runs.append(inproc(db, tmp, "claim-cost", blocked))
    of = f" of {repeat} rounds" if repeat > 1 else ""
    first = _median_run(runs, lambda got: got["empty"]["median"])
    empty = first["empty"]["median"]
    rows = [
        Row(
            db.vendor,
            "claim: otherwise empty queue",
            0,
            0.0,
            0.0,
            None,
            f"median {empty * 1000:.2f} ms, p90 {first['empty']['p90'] * 1000:.2f} ms "
            f"of {first['empty']['samples']}{of and ', the median' + of} (engine.claim, one "
            "runnable job; as in every claim row, commits do not wait for the flush)",
            latency=empty,
        )
    ]
    for key, what in (
        ("blocked", "claim: jobs blocked by a held lock"),
        ("full_lane", "claim: jobs in a lane at max_running"),
        ("delayed", "claim: delayed jobs, higher priority"),
    ):
        got = _median_run(runs, functools.partial(_ratio, key))
        row = _latency_row(
            db, what, got[key]["waiting"], got[key], got[key]["empty"], TARGET_CLAIM_WAITING
        )
        row.note += f" ({'its lane limits; ' if key == 'full_lane' else ''}measured just before"
        row.note += f" it; the median ratio{of}; {got[key]['median'] / empty:.2f}x the first row)"
        if key == "blocked":
            fresh = got["blocked_fresh"]["median"]
            row.note += (
                f"; after autovacuum's pass over the marked rows (before it: median "
                f"{fresh * 1000:.2f} ms, {fresh / got[key]['empty']:.2f}x)"
            )
        rows.append(row)
    return rows


def _ratio(key: str, got: dict[str, Any]) -> float:
    return float(got[key]["median"] / got[key]["empty"])


def _median_run(runs: list[dict[str, Any]], key: Callable[[dict[str, Any]], float]) -> Any:
    """The run whose ``key`` is the median (the lower middle of an even count)."""
    return sorted(runs, key=key)[(len(runs) - 1) // 2]


def history_rows(db: Database, tmp: Path, n: int) -> list[Row]:
    """``--history N``: what N finished jobs (with leases and events) cost the live paths."""
    got = inproc(db, tmp, "history", n)
    empty, full, prune = got["empty"], got["full"], got["prune"]
    rows = [
        _latency_row(
            db,
            "history: claim",
            n,
            full["claim"],
            empty["claim"]["median"],
            TARGET_CLAIM_HISTORY,
        )
    ]
    rows[0].note += f"; filled in {got['fill_seconds']:.1f} s"
    for key, what in (("queue_status", "history: queue_status"), ("scrape", "history: scrape")):
        ms = full[key]["median"] * 1000
        row = Row(
            db.vendor,
            what,
            n,
            0.0,
            0.0,
            None,
            f"median {ms:.1f} ms of {full[key]['samples']}; "
            f"empty table {empty[key]['median'] * 1000:.1f} ms"
            + ("" if key == "queue_status" else " (ops.metrics collector, in-process)"),
            factor=full[key]["median"] / empty[key]["median"] if empty[key]["median"] else None,
            latency=full[key]["median"],
        )
        row.checks.append((f"≤ {TARGET_READ_MS:.0f} ms", ms <= TARGET_READ_MS))
        rows.append(row)
    batches = prune["batches"]
    note = f"deleted {prune['deleted']:,} (the oldest day) in {len(batches)} batches"
    row = Row(db.vendor, f"history: prune_jobs, batch {prune['batch']:,}", n, 0.0, 0.0, None)
    if batches:
        first, last = batches[0], batches[-1]
        mid = sorted(batches)[len(batches) // 2]
        row.latency = mid
        row.factor = last / first if first else None
        note += (
            f": first {first * 1000:.1f} ms, last {last * 1000:.1f} ms, "
            f"median {mid * 1000:.1f} ms; x = last / first"
        )
        row.checks.append(("constant: last ≤ 1.50x first", last <= 1.5 * first))
    row.note = note
    rows.append(row)
    return rows


def _window_note(t: Throughput, workers: int) -> str:
    if workers == 1:
        return f"first claim→last finish; wall incl. start-up {t.wall:.1f} s"
    share = t.in_window / t.jobs if t.jobs else 0
    return f"window holds {share:.0%} of jobs; first claim→last finish {t.span_rate:,.0f}/s"


def render(rows: list[Row], headers: list[str]) -> str:
    table = [["db", "measurement", "jobs", "seconds", "jobs/s", "x bound", "target", "note"]]
    for r in rows:
        target = "; ".join(f"{label} {'OK' if ok else 'MISSED'}" for label, ok in r.checks)
        table.append(
            [
                r.db,
                r.what,
                f"{r.jobs:,}",
                f"{r.seconds:.2f}" if r.rate else ("" if r.latency is None else f"{r.latency:.4f}"),
                f"{r.rate:,.0f}" if r.rate else "",
                "" if r.ratio is None else f"{r.ratio:.2f}",
                target,
                r.note
                + ("" if r.bound is None or r.bound == r.rate else f" (bound {r.bound:,.0f}/s)"),
            ]
        )
    return format_table(table, headers, numeric={2, 3, 4, 5})


def format_table(table: list[list[str]], headers: list[str], numeric: set[int]) -> str:
    """Headers, then ``table`` in aligned columns (the ``numeric`` ones right-aligned)."""
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    out = [*headers, ""]
    for n, line in enumerate(table):
        cells = [
            c.rjust(w) if i in numeric and n else c.ljust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--jobs", type=int, help="jobs per worker measurement (default 5000)")
    parser.add_argument("--single-jobs", type=int, help="jobs for enqueue() (default 2000)")
    parser.add_argument("--bulk-jobs", type=int, help="jobs for enqueue_many (default 50000)")
    parser.add_argument(
        "--repeat",
        type=int,
        help="run each raw/Holdfast worker pair R times, report the medians (default 3)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: fewer jobs, no LOG_LEVEL=INFO row"
    )
    parser.add_argument(
        "--no-info-logging",
        action="store_true",
        help="skip the runworker x 1 row with LOG_LEVEL=INFO",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile an in-process worker and print the top costs",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the scratch databases (PostgreSQL) and temp dir"
    )
    parser.add_argument(
        "--claim-scale",
        type=float,
        help="claim-cost rows at this fraction of 50,000 / 50,000 / 400,000 waiting jobs "
        "(default 1; --quick: 0.1)",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=0,
        metavar="N",
        help="also fill N finished jobs (leases, events) and measure claim, queue_status, "
        "a metrics scrape and prune_jobs on them (PostgreSQL; not run by default)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    opts = Options(
        jobs=args.jobs or (1000 if quick else 5000),
        single_jobs=args.single_jobs or (300 if quick else 2000),
        bulk_jobs=args.bulk_jobs or (5000 if quick else 50000),
        repeat=max(1, args.repeat or (1 if quick else 3)),
        info_logging=not (quick or args.no_info_logging),
        profile=args.profile,
        keep=args.keep,
        claim_scale=args.claim_scale or (0.1 if quick else 1.0),
        history=max(0, args.history),
    )

    def say(message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)

    vendors = ["postgres", "sqlite"] if args.db == "both" else [args.db]
    tmp = Path(tempfile.mkdtemp(prefix="holdfast-bench-"))
    rows: list[Row] = []
    described: list[str] = []
    reports: list[str] = []
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    try:
        for vendor in vendors:
            cm = postgres_database(opts.keep) if vendor == "postgres" else sqlite_database(tmp)
            with cm as db:
                got, report = measure(db, tmp, opts, say)
                rows += got
                described.append(f"{db.vendor}: {db.version} ({db.notes})")
                if report:
                    reports.append(f"--- profile ({db.vendor}) ---\n{report}")
    finally:
        if opts.keep:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    headers = [
        f"Holdfast benchmark: handler bench.noop, {opts.jobs:,} jobs per worker run, "
        f"workers at LOG_LEVEL=WARNING unless noted, worker rows median of {opts.repeat}; "
        f"{os.cpu_count()} CPUs, load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after; took {time.perf_counter() - started:.0f} s",
        *described,
        "Worker rows: jobs/s from the rows' own timestamps (start-up excluded); "
        "x bound = ratio to the raw-SQL figure of the same database and process count.",
    ]
    if reports:
        print("\n".join(reports))
    print(render(rows, headers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
