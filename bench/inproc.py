"""The Django side of the benchmark, run by ``bench/run.py`` in a subprocess per database.

``python -m bench.inproc COMMAND N`` with ``DATABASE_URL`` and
``DJANGO_SETTINGS_MODULE=bench.settings`` set; prints one JSON object on stdout.

Commands:

* ``enqueue-single N``: N calls of ``jobs.enqueueing.enqueue``, each its own transaction.
* ``enqueue-bulk N``: one ``jobs.enqueueing.enqueue_many`` call with N jobs (also how the
  worker measurements seed their queue).
* ``profile N``: run ``WorkerProcess(burst=True).run()`` in this process over N queued
  no-op jobs, first plain (wall and CPU time per job), then under cProfile.
* ``claim-cost N`` (PostgreSQL): the latency of ``jobs.engine.claim`` taking one runnable
  job, on an otherwise empty queue and behind N queued jobs blocked by a held resource
  lock, N queued in a lane at its ``max_running``, and 8N delayed jobs of a higher
  priority (seeded by bulk SQL), each after an empty-queue baseline of its own.
* ``history N`` (PostgreSQL): claim cost, ``queue_status``, a metrics scrape and
  ``prune_jobs`` batches on an empty table, then with N finished jobs (each with its lease
  row, which is also its two events, seeded by bulk SQL).
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time
from typing import Any

KIND = "bench.noop"


def _setup() -> None:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    django.setup()


def enqueue_single(n: int) -> dict[str, Any]:
    from jobs.enqueueing import enqueue

    enqueue(KIND, {"i": -1})  # warm up: handler discovery, connection, statement caches
    start = time.perf_counter()
    for i in range(n):
        enqueue(KIND, {"i": i})
    seconds = time.perf_counter() - start
    return {"jobs": n, "seconds": seconds, "rate": n / seconds}


def enqueue_bulk(n: int) -> dict[str, Any]:
    from jobs.enqueueing import enqueue_many

    enqueue_many(KIND, [{"i": -1}])  # warm up
    args = [{"i": i} for i in range(n)]
    start = time.perf_counter()
    created = enqueue_many(KIND, args)
    seconds = time.perf_counter() - start
    assert len(created) == n
    return {"jobs": n, "seconds": seconds, "rate": n / seconds}


def profile(n: int, top: int = 30) -> dict[str, Any]:
    from django.db import connection

    from jobs.enqueueing import enqueue_many
    from jobs.worker import WorkerProcess

    def seed() -> None:
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM jobs_lease")
            cursor.execute("DELETE FROM jobs_job")
        enqueue_many(KIND, [{"i": i} for i in range(n)])

    seed()
    wall, cpu = time.perf_counter(), time.process_time()
    WorkerProcess(worker_id="bench-profile-plain", burst=True).run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu

    seed()
    profiler = cProfile.Profile()
    pwall = time.perf_counter()
    profiler.enable()
    WorkerProcess(worker_id="bench-profile", burst=True).run()
    profiler.disable()
    pwall = time.perf_counter() - pwall

    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return {
        "jobs": n,
        "plain_seconds": wall,
        "plain_rate": n / wall,
        "plain_us_per_job": wall / n * 1e6,
        "plain_cpu_us_per_job": cpu / n * 1e6,
        "profiled_seconds": pwall,
        "report": out.getvalue(),
    }


def enqueue_spaced(n: int) -> dict[str, Any]:
    """One job at a time, 50-150 ms apart, for an idle worker to pick up (wake latency)."""
    import random

    from jobs.enqueueing import enqueue

    for i in range(n):
        time.sleep(random.uniform(0.05, 0.15))
        enqueue(KIND, {"i": i})
    return {"jobs": n}


# --- claim cost and history (PostgreSQL) ------------------------------------------------

CLAIM_SAMPLES = 20
WARM_UP = 3

SEED_JOBS = """
INSERT INTO jobs_job (kind, lane, args, priority, state, run_at, attempts, max_attempts,
                      lease_seconds, lease_token, leased_by, lease_expires_at, cancel_requested,
                      last_error, locks)
SELECT %(kind)s, %(lane)s, jsonb_build_object('i', g), %(priority)s, %(state)s,
       now() + %(run_in)s * interval '1 second', %(attempts)s, 1, 60, %(attempts)s,
       CASE WHEN %(state)s = 'running' THEN 'bench-holder' END,
       CASE WHEN %(state)s = 'running' THEN now() + interval '1 day' END,
       false, '', %(locks)s::jsonb
FROM generate_series(1, %(n)s) AS g
RETURNING id
"""


def _seed(
    n: int,
    *,
    lane: str = "default",
    priority: int = 0,
    state: str = "queued",
    run_in: float = -3600.0,
    locks: tuple[str, ...] = (),
) -> list[int]:
    """Insert n jobs by one bulk statement; their ids."""
    from django.db import connection

    params = {
        "kind": KIND,
        "lane": lane,
        "priority": priority,
        "state": state,
        "run_in": run_in,
        "attempts": 1 if state == "running" else 0,
        "locks": json.dumps(sorted(locks)),
        "n": n,
    }
    with connection.cursor() as cursor:
        cursor.execute(SEED_JOBS, params)
        ids = [row[0] for row in cursor.fetchall()]
        if state == "running" and locks:  # the holder holds its locks (I8)
            cursor.execute(
                "INSERT INTO jobs_joblock (resource, job_id, lease_token, acquired_at)"
                " SELECT r, j, 1, now() FROM unnest(%s::text[]) AS r, unnest(%s::bigint[]) AS j",
                [sorted(locks), ids],
            )
    return ids


def _empty_tables() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE jobs_joblock, jobs_jobevent, jobs_lease, jobs_job, jobs_worker,"
            " jobs_outcomecount RESTART IDENTITY CASCADE"
        )


def _analyze() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("VACUUM (ANALYZE) jobs_job, jobs_lease, jobs_jobevent, jobs_joblock")


def _vacuum() -> None:
    """What autovacuum does after a mass update: the dead index entries go."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("VACUUM jobs_job")


def _stats(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {
        "median": ordered[len(ordered) // 2],
        "p90": ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))],
        "samples": len(ordered),
    }


def _claim_samples(
    limits: dict[str, int] | None = None, k: int = CLAIM_SAMPLES, warm_up: int = WARM_UP
) -> dict[str, Any]:
    """Seconds for ``engine.claim`` (a worker serving every lane) to take one runnable job,
    enqueued just before at priority 0 behind whatever is seeded; median and p90 of k.
    Each claimed job is completed (not timed), so every sample finds one runnable job.

    The session commits without waiting for the flush (``synchronous_commit`` off): the
    flush is the same for every row, and on a VM whose flushes vary by half from one
    second to the next (the seeding of the row before still being written out) it hid
    the claim's own work, which is what these rows compare."""
    from django.db import connection

    from jobs import engine
    from jobs import lanes as lane_config

    # The limits a worker serving every lane claims with (HOLDFAST_LANES), plus the row's.
    limits = {**lane_config.running_limits(None), **(limits or {})}
    with connection.cursor() as cursor:
        cursor.execute("SET synchronous_commit TO off")
    samples = []
    for i in range(warm_up + k):
        (job_id,) = _seed(1, run_in=0.0)
        start = time.perf_counter()
        job = engine.claim("bench-claim", None, limits)
        took = time.perf_counter() - start
        if job is None or job.id != job_id:
            raise RuntimeError(f"claimed {job and job.id}, expected the runnable job {job_id}")
        engine.complete(job)
        if i >= warm_up:
            samples.append(took)
    with connection.cursor() as cursor:
        cursor.execute("RESET synchronous_commit")
    return _stats(samples)


def claim_cost(n: int) -> dict[str, Any]:
    """Each waiting row with its own baseline: the claim on an otherwise empty queue with
    the row's lane limits, measured just before the row is seeded (``empty``), so that the
    VM's drift between rows and the claim shape of a limited lane are not charged to what
    waits."""
    result: dict[str, Any] = {}

    def baseline(limits: dict[str, int] | None = None) -> float:
        _empty_tables()
        _analyze()
        return float(_claim_samples(limits)["median"])

    _empty_tables()
    _analyze()
    result["empty"] = {**_claim_samples(), "waiting": 0}  # also the blocked row's baseline
    empty = result["empty"]["median"]
    _empty_tables()
    _seed(1, state="running", locks=("source:big",))
    _seed(n, locks=("source:big",))
    _analyze()
    # The first claim walks the backlog once and marks it blocked (out of the runnable
    # index). Until a vacuum the index keeps the marked rows' dead entries, which every
    # probe steps over: measured as "blocked_fresh", then after the pass autovacuum makes
    # (off in the benchmark's server) as the row's figure.
    result["blocked_fresh"] = {**_claim_samples(), "waiting": n, "empty": empty}
    _vacuum()
    result["blocked"] = {**_claim_samples(warm_up=1), "waiting": n, "empty": empty}

    empty = baseline({"limited": 1})
    _empty_tables()
    _seed(1, state="running", lane="limited")
    _seed(n, lane="limited")
    _analyze()
    result["full_lane"] = {**_claim_samples({"limited": 1}), "waiting": n, "empty": empty}

    empty = baseline()
    _empty_tables()
    _seed(8 * n, priority=10, run_in=86400.0)
    _analyze()
    result["delayed"] = {**_claim_samples(), "waiting": 8 * n, "empty": empty}
    _empty_tables()
    return result


HISTORY_CHUNK = 1_000_000
HISTORY_DAYS = 10  # finished_at spread evenly over the last 10 days

HISTORY_JOBS = f"""
INSERT INTO jobs_job (kind, lane, args, priority, state, run_at, attempts, max_attempts,
                      lease_seconds, lease_token, cancel_requested, last_error, locks,
                      created_at, updated_at, started_at, finished_at, result)
SELECT %(kind)s, 'default', jsonb_build_object('i', g), 0, 'succeeded', t, 1, 1, 60, 1, false,
       '', '[]'::jsonb, t, t + interval '5 ms', t, t + interval '5 ms', 'null'::jsonb
FROM (SELECT g, now() - interval '{HISTORY_DAYS} days' * (g::float8 / %(total)s) AS t
      FROM generate_series(%(first)s, %(last)s) AS g) AS slots
"""

# Each lease row is also its attempt's claimed and settled events (jobs.events), as a
# worker writes it: no jobs_jobevent rows for a plain successful attempt.
HISTORY_LEASES = """
INSERT INTO jobs_lease (job_id, attempt, lease_token, worker_id, acquired_at, expires_at,
                        released_at, outcome, error_class, error_message, traceback, context,
                        settled_state, cancel_requested)
SELECT id, 1, 1, 'bench-history', started_at, started_at + interval '60 s', finished_at,
       'succeeded', '', '', '', '{}'::jsonb, 'succeeded', false
FROM jobs_job WHERE id BETWEEN %(low)s AND %(high)s
"""


def _fill_history(n: int) -> None:
    from django.db import connection, transaction

    done = 0
    while done < n:
        last = min(n, done + HISTORY_CHUNK)
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT COALESCE(max(id), 0) FROM jobs_job")
            low = cursor.fetchone()[0] + 1
            cursor.execute(
                HISTORY_JOBS, {"kind": KIND, "total": n, "first": done + 1, "last": last}
            )
            cursor.execute("SELECT max(id) FROM jobs_job")
            bounds = {"low": low, "high": cursor.fetchone()[0]}
            cursor.execute(HISTORY_LEASES, bounds)
        done = last


def _reads(k: int = 5) -> dict[str, Any]:
    """Seconds for ``queue_status()`` and for one scrape of the metrics collector."""
    from prometheus_client import generate_latest

    from jobs.status import queue_status
    from ops.metrics import registry

    status, scrape = [], []
    for i in range(k + 1):
        start = time.perf_counter()
        queue_status()
        if i:
            status.append(time.perf_counter() - start)
        start = time.perf_counter()
        generate_latest(registry())
        if i:
            scrape.append(time.perf_counter() - start)
    return {"queue_status": _stats(status), "scrape": _stats(scrape)}


def _prune_batches(n: int) -> dict[str, Any]:
    """``prune_jobs``' batches deleting the oldest day of history: seconds per batch."""
    from datetime import timedelta

    from jobs import retention

    day = n // HISTORY_DAYS
    batch = max(1, min(retention.BATCH, day // 4))
    rules = {"succeeded": timedelta(days=HISTORY_DAYS - 1)}
    seconds, deleted = [], 0
    while True:
        start = time.perf_counter()
        got = retention.prune(rules, batch=batch, max_batches=1)["succeeded"]
        took = time.perf_counter() - start
        if not got:
            break
        seconds.append(took)
        deleted += got
    return {"batch": batch, "batches": seconds, "deleted": deleted}


def history(n: int) -> dict[str, Any]:
    _empty_tables()
    _analyze()
    empty = {"claim": _claim_samples(), **_reads()}
    _empty_tables()
    start = time.perf_counter()
    _fill_history(n)
    _analyze()
    fill = time.perf_counter() - start
    full = {"claim": _claim_samples(), **_reads()}
    prune = _prune_batches(n)
    _empty_tables()
    return {"jobs": n, "fill_seconds": fill, "empty": empty, "full": full, "prune": prune}


COMMANDS = {
    "enqueue-single": enqueue_single,
    "enqueue-spaced": enqueue_spaced,
    "enqueue-bulk": enqueue_bulk,
    "profile": profile,
    "claim-cost": claim_cost,
    "history": history,
}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in COMMANDS:
        print(f"usage: python -m bench.inproc {{{'|'.join(COMMANDS)}}} N", file=sys.stderr)
        return 2
    _setup()
    result = COMMANDS[argv[0]](int(argv[1]))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
