"""Two checkouts' workers side by side: ``runworker --burst`` over the same no-op jobs,
alternating between the checkouts round after round, so that a machine whose flush time
drifts (a VM) charges both alike. For "no regression beyond 5%" checks between commits.

    .venv/bin/python bench/compare.py OLD_CHECKOUT NEW_CHECKOUT [ROUNDS] [--jobs N]
                                      [--workers W]

Each checkout needs its own ``.venv`` (``scripts/bootstrap.sh``). Each run recreates the
scratch database ``holdfast_compare`` on the server of ``BENCH_DATABASE_URL`` (default
``postgres://postgres@127.0.0.1:5432``), migrates it with that checkout's code, enqueues
the jobs with its ``enqueue_many`` and drains them with ``W`` workers (default 1) at
``LOG_LEVEL=WARNING``. The figure is jobs/s from the rows' own timestamps (first claim to
last finish), as in ``bench/run.py``; medians and every round are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

NAME = "holdfast_compare"
ENQUEUE = """
import django
django.setup()
try:
    from jobs.enqueueing import enqueue_many
except ImportError:  # before the engine was split
    from jobs.engine import enqueue_many
enqueue_many("bench.noop", [{"i": i} for i in range(int(__import__("sys").argv[1]))])
"""


def server() -> str:
    url = os.environ.get("BENCH_DATABASE_URL", "").strip() or "postgres://postgres@127.0.0.1:5432"
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=""))


def run(checkout: Path, jobs: int, var_dir: str, workers: int = 1) -> float:
    """One round on one checkout: jobs/s of ``workers`` workers draining ``jobs`` no-op
    jobs."""
    base = server()
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {NAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {NAME}")
    url = f"{base}/{NAME}"
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "LOG_LEVEL": "WARNING",
        "HOLDFAST_VAR_DIR": var_dir,
    }
    python = str(checkout / ".venv" / "bin" / "python")
    quiet = {"cwd": checkout, "env": env, "check": True}
    subprocess.run([python, "manage.py", "migrate", "-v0"], **quiet)  # type: ignore[call-overload]
    subprocess.run([python, "-c", ENQUEUE, str(jobs)], **quiet)  # type: ignore[call-overload]
    procs = [
        subprocess.Popen(
            [python, "manage.py", "runworker", "--burst", "--worker-id", f"compare-{n}"],
            cwd=checkout,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for n in range(workers)
    ]
    codes = [proc.wait() for proc in procs]
    assert not any(codes), f"{checkout}: workers exited {codes}"
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT min(started_at), max(finished_at), count(*) FROM jobs_job"
            " WHERE state = 'succeeded'"
        ).fetchone()
    assert row is not None and row[2] == jobs, f"{checkout}: {row}"
    return float(jobs / (row[1] - row[0]).total_seconds())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("rounds", type=int, nargs="?", default=6)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    figures: dict[Path, list[float]] = {args.old: [], args.new: []}
    with tempfile.TemporaryDirectory(prefix="holdfast-compare-") as var_dir:
        for round_ in range(1, args.rounds + 1):
            for checkout, seen in figures.items():
                seen.append(run(checkout, args.jobs, var_dir, args.workers))
                print(f"round {round_}: {checkout} {seen[-1]:,.0f} jobs/s", file=sys.stderr)
    old, new = (statistics.median(figures[path]) for path in (args.old, args.new))
    for path, seen in figures.items():
        print(f"{path}: median {statistics.median(seen):,.0f} jobs/s, rounds", end=" ")
        print(", ".join(f"{figure:,.0f}" for figure in seen))
    print(f"new/old: {new / old:.3f} (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
