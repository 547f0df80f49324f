"""The Django side of the benchmark, run by ``bench/run.py`` in a subprocess per database.

``python -m bench.inproc COMMAND N`` with ``DATABASE_URL`` and
``DJANGO_SETTINGS_MODULE=bench.settings`` set; prints one JSON object on stdout.

Commands:

* ``enqueue-single N``: N calls of ``jobs.engine.enqueue``, each its own transaction.
* ``enqueue-bulk N``: one ``jobs.engine.enqueue_many`` call with N jobs (also how the
  worker measurements seed their queue).
* ``profile N``: run ``WorkerProcess(burst=True).run()`` in this process over N queued
  no-op jobs, first plain (wall and CPU time per job), then under cProfile.
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
    from jobs.engine import enqueue

    enqueue(KIND, {"i": -1})  # warm up: handler discovery, connection, statement caches
    start = time.perf_counter()
    for i in range(n):
        enqueue(KIND, {"i": i})
    seconds = time.perf_counter() - start
    return {"jobs": n, "seconds": seconds, "rate": n / seconds}


def enqueue_bulk(n: int) -> dict[str, Any]:
    from jobs.engine import enqueue_many

    enqueue_many(KIND, [{"i": -1}])  # warm up
    args = [{"i": i} for i in range(n)]
    start = time.perf_counter()
    created = enqueue_many(KIND, args)
    seconds = time.perf_counter() - start
    assert len(created) == n
    return {"jobs": n, "seconds": seconds, "rate": n / seconds}


def profile(n: int, top: int = 30) -> dict[str, Any]:
    from django.db import connection

    from jobs.engine import enqueue_many
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

    from jobs.engine import enqueue

    for i in range(n):
        time.sleep(random.uniform(0.05, 0.15))
        enqueue(KIND, {"i": i})
    return {"jobs": n}


COMMANDS = {
    "enqueue-single": enqueue_single,
    "enqueue-spaced": enqueue_spaced,
    "enqueue-bulk": enqueue_bulk,
    "profile": profile,
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
