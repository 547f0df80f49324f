"""The spool ingester's benchmark (issue 5): files/s and facts/s next to a raw upsert bound.

    .venv/bin/python bench/ingest.py [--files N] [--big-files M] [--scale-files K]
                                     [--repeat R] [--quick]

On PostgreSQL only, in a scratch database (``holdfast_bench`` on the server of
``BENCH_DATABASE_URL``, as ``bench/run.py``; it is dropped and recreated), migrated with
``manage.py migrate``. Two variants, each with 10 facts per submission:

* ``small``: N submissions (default 5000), no log excerpt;
* ``1 MiB excerpts``: M submissions (default 200), each with a 1 MiB ``log_excerpt``
  (distinct bytes per file, so every one is a new blob, fsynced like in production).

For each variant, the spool is filled (not timed) and ``manage.py ingest_submissions
--spool DIR --once --workers W --json`` runs with 1 and 2 reader processes. The figure is
files (and facts) applied divided by the ingester's own ``elapsed_s``: from the moment
its reader and writer processes are started to the moment the spool is empty and the
writer has exited, so Python and Django start-up are excluded (the wall time including
them is in the note).

The bound is measured in the same run on the same tables: the same facts written by a
plain psycopg loop with no files, no parsing and no ack rows: the labs, then one upsert
``INSERT … SELECT … ON CONFLICT … DO UPDATE … WHERE`` per commit of 20 000 facts (the
writer's batch limit), in two forms:

* ``jsonb``: the rows as one JSON document (``jsonb_to_recordset``), the ingester's own
  statement (``ingestion.sql``); the faster of the two, so the target is judged on it;
* ``arrays``: the rows as five arrays (``unnest``), the ingester's statement when the
  target was set and the first figures were taken, kept so they stay comparable.

Target: with 2 readers, at least 40% of the bound (``small``).

**Scale** (issue 13): the same small submissions at N (default 5,000) and K (default
100,000) files, through both entry points of the one pipeline:

* ``command``: ``ingest_submissions --once --workers 2`` (its own ``elapsed_s``);
* ``drain``: :func:`ingestion.spool.drain` in one process, the job ``ingestion.ingest_spool``'s
  entry point (its own ``elapsed_s``, run through ``manage.py shell``).

Target: at K files each entry point drains at no less than 80% of its rate at N files
(``x at N`` column), i.e. the cost per file does not grow with the spool.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from bench.run import (  # noqa: E402
    Database,
    django_env,
    format_table,
    manage,
    postgres_database,
)

FACTS_PER_FILE = 10
LABS = 10
MIB = 1024 * 1024
BOUND_FACTS_PER_COMMIT = 20_000  # the writer's max_facts
TARGET_RATIO = 0.40  # 2 readers x the bound
SCALE_TARGET = 0.80  # rate at K files / rate at N files, per entry point
SCALE_FILES = 100_000

DRAIN = """
import json, os
from pathlib import Path
from ingestion.spool import Spool, drain
progress = drain(Spool(Path(os.environ["HOLDFAST_BENCH_SPOOL"])), stuck_after=120, grace=0)
print(json.dumps(progress.as_dict()))
"""

GUARD = (
    "ON CONFLICT (lab_id, entity, key) DO UPDATE "
    "SET attributes = excluded.attributes, submitted_at = excluded.submitted_at "
    "WHERE excluded.submitted_at >= facts.submitted_at"
)
# The same text as ingestion.sql.POSTGRES_UPSERT (this script does not set Django up).
UPSERT_JSONB = (
    "INSERT INTO facts (lab_id, entity, key, attributes, submitted_at) "
    "SELECT lab_id, entity, key, attributes, submitted_at FROM jsonb_to_recordset(%s::jsonb) "
    "AS r(lab_id bigint, entity text, key text, attributes jsonb, submitted_at timestamptz) "
    f"{GUARD}"
)
UPSERT_ARRAYS = (
    "INSERT INTO facts (lab_id, entity, key, attributes, submitted_at) "
    "SELECT * FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::jsonb[], "
    f"%s::timestamptz[]) {GUARD}"
)
STAMP = "2026-11-30T10:00:00Z"


@dataclass(frozen=True)
class Variant:
    name: str
    files: int
    excerpt_bytes: int


@dataclass
class Row:
    variant: str
    what: str
    files: int
    seconds: float
    note: str = ""
    bound: float | None = None  # files/s of the bound, for the ratio
    base: float | None = None  # files/s of the same entry point at N files (scale rows)

    @property
    def files_per_s(self) -> float:
        return self.files / self.seconds if self.seconds else 0.0

    @property
    def facts_per_s(self) -> float:
        return self.files_per_s * FACTS_PER_FILE

    @property
    def ratio(self) -> float | None:
        return None if not self.bound else self.files_per_s / self.bound

    @property
    def scale(self) -> float | None:
        return None if not self.base else self.files_per_s / self.base


def fact(i: int, j: int) -> dict[str, Any]:
    return {
        "entity": "run",
        "key": f"run-{i}-{j}",
        "attributes": {"status": "passed", "i": i, "j": j, "duration_ms": 1000 + j},
    }


def submission(i: int, excerpt_bytes: int) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema": "holdfast.submission/v1",
        "lab": f"lab-{i % LABS}",
        "submitted_at": STAMP,
        "facts": [fact(i, j) for j in range(FACTS_PER_FILE)],
    }
    if excerpt_bytes:
        line = f"submission {i}: log line of a realistic length, mostly ASCII text\n"
        doc["log_excerpt"] = (line * (excerpt_bytes // len(line) + 1))[:excerpt_bytes]
    return doc


def fill(spool: Path, variant: Variant, sync: bool = False) -> None:
    incoming = spool / "incoming"
    shutil.rmtree(spool, ignore_errors=True)
    incoming.mkdir(parents=True)
    for i in range(variant.files):
        (incoming / f"s{i:06}.json").write_text(json.dumps(submission(i, variant.excerpt_bytes)))
    if sync:
        # Written back before the clock starts, at every size alike: a 5,000-file spool
        # would otherwise never reach the disk before it is unlinked, while a 100,000-file
        # one does (the kernel's 30 s writeback), and the rows would compare page cache
        # with disk rather than the ingester at two sizes.
        os.sync()


def truncate(db: Database) -> None:
    with psycopg.connect(db.target.dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE facts, ingested_submissions, labs RESTART IDENTITY CASCADE")


def counts(db: Database) -> tuple[int, int]:
    with psycopg.connect(db.target.dsn) as conn:
        facts = conn.execute("SELECT count(*) FROM facts").fetchone()
        acks = conn.execute("SELECT count(*) FROM ingested_submissions").fetchone()
    assert facts is not None and acks is not None
    return int(facts[0]), int(acks[0])


def upsert_params(form: str, rows: list[tuple[int, str, str, dict[str, Any], str]]) -> list[Any]:
    """The parameters of the ``form`` (``jsonb`` or ``arrays``) upsert of ``rows``."""
    if form == "jsonb":
        keys = ("lab_id", "entity", "key", "attributes", "submitted_at")
        return [json.dumps([dict(zip(keys, row, strict=True)) for row in rows])]
    return [
        [row[0] for row in rows],
        [row[1] for row in rows],
        [row[2] for row in rows],
        [json.dumps(row[3]) for row in rows],
        [row[4] for row in rows],
    ]


def bound(db: Database, variant: Variant, form: str) -> float:
    """Seconds for a plain psycopg upsert of the variant's facts (labs first, no files)."""
    truncate(db)
    started = time.perf_counter()
    with psycopg.connect(db.target.dsn) as conn:
        with conn.transaction():
            conn.execute(
                "INSERT INTO labs (name, created_at) SELECT unnest(%s::text[]), now() "
                "ON CONFLICT (name) DO NOTHING",
                [[f"lab-{n}" for n in range(LABS)]],
            )
        lab_ids: dict[str, int] = dict(conn.execute("SELECT name, id FROM labs").fetchall())
        per_commit = BOUND_FACTS_PER_COMMIT // FACTS_PER_FILE
        statement = UPSERT_JSONB if form == "jsonb" else UPSERT_ARRAYS
        for start in range(0, variant.files, per_commit):
            rows = [
                (lab_ids[f"lab-{i % LABS}"], f["entity"], f["key"], f["attributes"], STAMP)
                for i in range(start, min(start + per_commit, variant.files))
                for f in (fact(i, j) for j in range(FACTS_PER_FILE))
            ]
            with conn.transaction():
                conn.execute(statement, upsert_params(form, rows))
    seconds = time.perf_counter() - started
    assert counts(db)[0] == variant.files * FACTS_PER_FILE
    return seconds


def ingest(
    db: Database, tmp: Path, variant: Variant, workers: int, entry: str = "command"
) -> tuple[float, float]:
    """(the ingester's elapsed_s, wall seconds with start-up) for one drain of the spool,
    through ``entry``: ``command`` (``ingest_submissions --once``) or ``drain`` (the job
    handler's entry point, in one process)."""
    truncate(db)
    spool = tmp / "spool"
    fill(spool, variant, sync=variant.name.startswith("scale"))
    if entry == "command":
        argv = ["manage.py", "ingest_submissions", "--spool", str(spool), "--once"]
        argv += ["--workers", str(workers), "--json", "--grace", "0"]
    else:
        argv = ["manage.py", "shell", "-c", DRAIN]
    env = django_env(db, tmp)
    env["HOLDFAST_BENCH_SPOOL"] = str(spool)
    env["HOLDFAST_SPOOL_SETTLE_SECONDS"] = "0"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{entry} failed:\n{done.stderr[-3000:]}")
    out = done.stdout.strip()
    result = json.loads(out if entry == "command" else out.splitlines()[-1])
    facts, acks = counts(db)
    if (result["applied"], acks, facts) != (
        variant.files,
        variant.files,
        variant.files * FACTS_PER_FILE,
    ):
        raise SystemExit(f"not everything applied: {result}, {acks} acks, {facts} facts")
    return float(result["elapsed_s"]), wall


def measure_scale(
    db: Database, tmp: Path, files: int, scale_files: int, repeat: int, say: Any
) -> list[Row]:
    """The scale rows: each entry point at ``files`` and at ``scale_files`` small files."""
    rows: list[Row] = []
    for entry, what in (("command", "ingest_submissions --workers 2"), ("drain", "drain")):
        base: float | None = None
        for count in (files, scale_files):
            variant = Variant(f"scale {count:,}", count, 0)
            say(f"scale: {what} at {count:,} files")
            runs = [ingest(db, tmp, variant, 2, entry) for _ in range(repeat)]
            elapsed = statistics.median(r[0] for r in runs)
            wall = statistics.median(r[1] for r in runs)
            row = Row(variant.name, what, count, elapsed, note=f"wall {wall:.1f} s", base=base)
            rows.append(row)
            base = base or row.files_per_s
    return rows


def measure(db: Database, tmp: Path, variants: list[Variant], repeat: int, say: Any) -> list[Row]:
    rows: list[Row] = []
    for variant in variants:
        facts = variant.files * FACTS_PER_FILE
        bound_rate = 0.0
        for form in ("arrays", "jsonb"):
            say(f"{variant.name}: bound ({form} psycopg upsert of {facts:,} facts)")
            bound_s = statistics.median(bound(db, variant, form) for _ in range(repeat))
            bound_rate = max(bound_rate, variant.files / bound_s)
            what = f"bound: {form} upsert, no files"
            rows.append(Row(variant.name, what, variant.files, bound_s))
        for workers in (1, 2):
            say(f"{variant.name}: ingest_submissions --once --workers {workers}")
            runs = [ingest(db, tmp, variant, workers) for _ in range(repeat)]
            elapsed = statistics.median(r[0] for r in runs)
            wall = statistics.median(r[1] for r in runs)
            rows.append(
                Row(
                    variant.name,
                    f"ingest_submissions --workers {workers}",
                    variant.files,
                    elapsed,
                    note=f"wall incl. start-up {wall:.1f} s",
                    bound=bound_rate,
                )
            )
    return rows


def render(rows: list[Row], headers: list[str]) -> str:
    table = [
        [
            "variant",
            "measurement",
            "files",
            "seconds",
            "files/s",
            "facts/s",
            "x bound",
            "x at N",
            "note",
        ]
    ]
    for r in rows:
        ratio, scale = r.ratio, r.scale
        target = ""
        if ratio is not None and r.variant == "small" and r.what.endswith("2"):
            target = f"  target {TARGET_RATIO:.0%}: {'OK' if ratio >= TARGET_RATIO else 'MISSED'}"
        if scale is not None:
            target = f"  target {SCALE_TARGET:.0%}: {'OK' if scale >= SCALE_TARGET else 'MISSED'}"
        table.append(
            [
                r.variant,
                r.what,
                f"{r.files:,}",
                f"{r.seconds:.2f}",
                f"{r.files_per_s:,.0f}",
                f"{r.facts_per_s:,.0f}",
                "" if ratio is None else f"{ratio:.2f}",
                "" if scale is None else f"{scale:.2f}",
                r.note + target,
            ]
        )
    return format_table(table, headers, numeric={2, 3, 4, 5, 6, 7})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, help="small submissions (default 5000)")
    parser.add_argument("--big-files", type=int, help="submissions with 1 MiB excerpts (200)")
    parser.add_argument(
        "--scale-files", type=int, help=f"the scale rows' large spool (default {SCALE_FILES:,})"
    )
    parser.add_argument("--no-scale", action="store_true", help="skip the scale rows")
    parser.add_argument("--repeat", type=int, help="runs per row, median reported (default 3)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer files, once")
    parser.add_argument("--keep", action="store_true", help="keep the scratch database and dir")
    args = parser.parse_args(argv)
    quick = args.quick
    variants = [
        Variant("small", args.files or (500 if quick else 5000), 0),
        Variant("1 MiB excerpts", args.big_files or (20 if quick else 200), MIB),
    ]
    repeat = max(1, args.repeat or (1 if quick else 3))

    def say(message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="holdfast-bench-ingest-"))
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    try:
        with postgres_database(args.keep) as db:
            manage(db, tmp, "migrate", "--noinput", "-v0")
            rows = measure(db, tmp, variants, repeat, say)
            if not args.no_scale:
                scale_files = args.scale_files or (2000 if quick else SCALE_FILES)
                rows += measure_scale(db, tmp, variants[0].files, scale_files, repeat, say)
            described = f"postgres: {db.version} ({db.notes})"
    finally:
        if args.keep:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    headers = [
        f"Holdfast ingestion benchmark: {FACTS_PER_FILE} facts per submission, {LABS} labs, "
        f"median of {repeat}; {os.cpu_count()} CPUs, load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after; took {time.perf_counter() - started:.0f} s",
        described,
        "Ingester rows: the command's own elapsed_s (children started to spool empty); "
        "x bound = files/s over the faster bound's files/s for the same facts; "
        "x at N = files/s over the same entry point's files/s at N files.",
    ]
    print(render(rows, headers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
