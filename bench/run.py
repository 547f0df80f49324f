"""Holdfast's benchmark: one command, its own scratch databases, one table of figures.

    .venv/bin/python bench/run.py [--db sqlite|postgres|both] [--jobs N] [--quick]

For each database it creates a scratch database (PostgreSQL: ``holdfast_bench`` on the
server of ``BENCH_DATABASE_URL``, default ``postgres://postgres@127.0.0.1:5432``; SQLite: a
file in a temporary directory), migrates it with ``manage.py migrate``, and measures:

* enqueue rate: ``jobs.engine.enqueue`` one job per transaction, and ``enqueue_many``;
  next to raw inserts of the same rows (one per commit; ``COPY``/``executemany`` in bulk);
* processed jobs/s of a no-op handler with 1 and 2 real ``manage.py runworker --burst``
  processes, next to the raw claim/complete bound (``bench/raw.py``) with as many
  processes, measured in the same run on the same table.

Throughput is read from the timestamps the run wrote into the rows, not from process wall
time, so Python and Django start-up are excluded: the window runs from the moment the
last worker made its first claim (every worker is running) to the last finish (the
queue is drained), and the figure is the jobs finished in that window divided by its
length. With one worker that is first claim to last finish. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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

from bench.raw import Target, claim_complete_loop, insert_bulk, insert_single  # noqa: E402

DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432/holdfast_bench"
WORKER_TIMEOUT = 600

# Targets from the issue (PostgreSQL only).
TARGET_ONE_WORKER = 0.8  # x the raw bound with one process
TARGET_SCALING = 1.8  # two workers x one worker
TARGET_ENQUEUE_MANY = 50_000  # jobs/s
TARGET_WAKE_P50_MS = 50.0  # an idle PostgreSQL worker claims a new job within this (p50)
WAKE_SAMPLES = 40


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

    @property
    def span_rate(self) -> float:
        return self.jobs / self.span if self.span else 0.0


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


def check_drained(db: Database, n: int) -> None:
    counts = dict(fetch(db, "SELECT state, count(*) FROM jobs_job GROUP BY state"))
    if counts != {"succeeded": n}:
        raise RuntimeError(f"expected {n} succeeded jobs, found {counts}")


def raw_workers(db: Database, n: int, workers: int) -> Throughput:
    reset(db, analyze_after_seed=n)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(workers)
    start = time.perf_counter()
    procs = [
        ctx.Process(target=claim_complete_loop, args=(db.target, f"raw-{i}", barrier))
        for i in range(workers)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(WORKER_TIMEOUT)
        if proc.exitcode != 0:
            raise RuntimeError(f"raw worker exited with {proc.exitcode}")
    wall = time.perf_counter() - start
    check_drained(db, n)
    rows = fetch(db, "SELECT leased_by, started_at, finished_at FROM jobs_job")
    return throughput(rows, wall)


def holdfast_workers(
    db: Database, tmp: Path, n: int, workers: int, log_level: str = "WARNING"
) -> Throughput:
    reset(db, analyze_after_seed=n)
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
    check_drained(db, n)
    rows = fetch(
        db,
        "SELECT worker_id, acquired_at, released_at FROM jobs_lease WHERE outcome = 'succeeded'",
    )
    return throughput(rows, wall)


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

    @property
    def ratio(self) -> float | None:
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


def measure(db: Database, tmp: Path, opts: Options, say: Any) -> tuple[list[Row], str]:
    rows: list[Row] = []
    pg = db.vendor == "postgres"
    say(f"[{db.vendor}] migrating a scratch database")
    manage(db, tmp, "migrate", "--noinput", "-v", "0")

    say(f"[{db.vendor}] enqueue, one job per transaction ({opts.single_jobs} jobs)")
    reset(db)
    raw_single = opts.single_jobs / insert_single(db.target, opts.single_jobs)
    reset(db)
    single = inproc(db, tmp, "enqueue-single", opts.single_jobs)
    rows.append(
        Row(
            db.vendor,
            "enqueue(): 1 job per transaction",
            single["jobs"],
            single["seconds"],
            single["rate"],
            raw_single,
            "bound: raw INSERT + COMMIT loop",
        )
    )

    say(f"[{db.vendor}] enqueue_many ({opts.bulk_jobs} jobs)")
    reset(db)
    raw_bulk = opts.bulk_jobs / insert_bulk(db.target, opts.bulk_jobs)
    reset(db)
    bulk = inproc(db, tmp, "enqueue-bulk", opts.bulk_jobs)
    bulk_row = Row(
        db.vendor,
        "enqueue_many(): one call",
        bulk["jobs"],
        bulk["seconds"],
        bulk["rate"],
        raw_bulk,
        "bound: raw COPY" if pg else "bound: raw executemany, 1 transaction",
    )
    if pg:
        bulk_row.checks.append(
            (f"≥ {TARGET_ENQUEUE_MANY:,} jobs/s", bulk["rate"] >= TARGET_ENQUEUE_MANY)
        )
    rows.append(bulk_row)

    hold: dict[int, Throughput] = {}
    for workers in (1, 2):
        # Alternate raw and Holdfast runs so both sample the same machine conditions.
        raw_runs, hold_runs = [], []
        for attempt in range(opts.repeat):
            round_note = f" (round {attempt + 1} of {opts.repeat})" if opts.repeat > 1 else ""
            say(
                f"[{db.vendor}] raw claim/complete bound, {workers} process(es), "
                f"{opts.jobs} jobs{round_note}"
            )
            raw_runs.append(raw_workers(db, opts.jobs, workers))
            say(f"[{db.vendor}] runworker --burst x {workers}, {opts.jobs} jobs{round_note}")
            hold_runs.append(holdfast_workers(db, tmp, opts.jobs, workers))
        raw, got = median_of(raw_runs), median_of(hold_runs)
        hold[workers] = got
        rows.append(
            Row(
                db.vendor,
                f"raw bound: {workers} process{'es' if workers > 1 else ''}",
                raw.jobs,
                raw.window,
                raw.rate,
                raw.rate,
                _window_note(raw, workers),
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
        if pg and workers == 1:
            row.checks.append(
                (
                    f"≥ {TARGET_ONE_WORKER:.2f}x bound",
                    row.ratio is not None and row.ratio >= TARGET_ONE_WORKER,
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
        rows.append(row)

    if opts.info_logging:
        say(f"[{db.vendor}] runworker x 1 with LOG_LEVEL=INFO, {opts.jobs} jobs")
        info = holdfast_workers(db, tmp, opts.jobs, 1, "INFO")  # one run: indicative
        raw_one = next(r.rate for r in rows if r.what == "raw bound: 1 process")
        rows.append(
            Row(
                db.vendor,
                "runworker x 1, LOG_LEVEL=INFO",
                info.jobs,
                info.window,
                info.rate,
                raw_one,
                f"JSON log lines to a file; {_window_note(info, 1)}",
            )
        )

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
                f"{r.seconds:.2f}" if r.rate else "",
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
