"""Poison never stalls good data (issue 13): every reproduction of the issue, in one process
(the job handler's entry point, :func:`ingestion.spool.drain`), on both databases.

Each poison file among good ones ends in ``failed/`` with its reason and a reconciliation
issue, and every good file is applied; a batch the database refuses because of one file
is split and the rest applied; a refusal the files share leaves them all in place; files
that change are never deleted or quarantined on an old read; reads are bounded and never
block. The command's entry point runs the same pipeline: tests/process/test_spool_poison.py.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, connections
from structlog.testing import capture_logs

from ingestion import spool
from ingestion.ingester import ProgressEvents
from ingestion.models import Fact, IngestedSubmission, ReconciliationIssue
from ingestion.reconciliation import resolve
from ingestion.spool import Monitor, NotYet, Spool, Stuck, Writer, drain, read_entry
from ingestion.submissions import MAX_ERRORS, Limits, parse
from tests.conftest import on_postgres
from tests.support.races import decided_in_turn

pytestmark = pytest.mark.timeout(60)


def submission(lab: str = "lab-1", key: str = "run-1", **attributes: Any) -> dict[str, Any]:
    return {
        "schema": "holdfast.submission/v1",
        "lab": lab,
        "submitted_at": "2026-11-30T10:00:00Z",
        "facts": [{"entity": "run", "key": key, "attributes": attributes or {"ok": True}}],
    }


def raw_submission(attributes: str, submitted_at: str = "2026-11-30T10:00:00Z") -> bytes:
    """A submission whose attributes are given as JSON text (numbers as written)."""
    return (
        '{"schema": "holdfast.submission/v1", "lab": "lab-1", "submitted_at": '
        f'"{submitted_at}", "facts": [{{"entity": "run", "key": "raw", '
        f'"attributes": {attributes}}}]}}'
    ).encode()


@pytest.fixture
def the_spool(tmp_path: Path, settings: Any) -> Spool:
    settings.HOLDFAST_BLOB_DIR = tmp_path / "blobs"
    settings.HOLDFAST_SPOOL_SETTLE_SECONDS = 0
    root = Spool(tmp_path / "spool")
    root.ensure()
    return root


Drop = Callable[[str, Any], Path]


@pytest.fixture
def drop(the_spool: Spool) -> Drop:
    def write(name: str, content: dict[str, Any] | bytes) -> Path:
        data = json.dumps(content).encode() if isinstance(content, dict) else content
        staging = the_spool.root / f".{name}.partial"
        staging.write_bytes(data)
        return staging.rename(the_spool.incoming / name)

    return write


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def goods(drop: Drop, count: int = 3) -> None:
    for i in range(count):
        drop(f"good-{i}.json", submission(lab=f"lab-{i}", key=f"run-{i}"))


def assert_goods_applied(count: int = 3) -> None:
    applied = set(IngestedSubmission.objects.values_list("file_name", flat=True))
    assert {f"good-{i}.json" for i in range(count)} <= applied
    assert Fact.objects.filter(key__startswith="run-").count() == count


def reason(the_spool: Spool, name: str) -> dict[str, Any]:
    return dict(json.loads((the_spool.failed / f"{name}.reason.json").read_text()))


def deep(depth: int) -> str:
    return "[" * (depth - 4) + "]" * (depth - 4)


# --- the file's own errors: quarantined, the rest applied -------------------------------

POISON: dict[str, tuple[bytes, str, str]] = {
    # OverflowError in the conversion to UTC (the reader process used to die on it).
    "time-before-year-1": (
        raw_submission("{}", submitted_at="0001-01-01T00:00:00+01:00"),
        "semantic",
        "outside 1970-01-01",
    ),
    "time-after-year-9999": (
        raw_submission("{}", submitted_at="9999-12-31T23:59:59-01:00"),
        "semantic",
        "outside",
    ),
    "time-before-1970": (
        raw_submission("{}", submitted_at="1969-12-31T23:59:59Z"),
        "semantic",
        "outside",
    ),
    # Nesting: 65 levels is over the limit; 5,000 could not be handed to the writer; 20,000
    # is more than Python's parser takes (RecursionError): all the file's own.
    "depth-65": (raw_submission('{"a": ' + deep(65) + "}"), "limits", "deeper than"),
    "depth-5000": (raw_submission('{"a": ' + deep(5000) + "}"), "limits", "deeper than"),
    "depth-20000": (raw_submission('{"a": ' + deep(20000) + "}"), "json", "recursion"),
    "long-number": (raw_submission('{"n": 1.' + "1" * 200 + "}"), "json", "longer than"),
    "huge-integer": (raw_submission('{"n": ' + "9" * 5000 + "}"), "json", "invalid JSON"),
    "number-out-of-range": (raw_submission('{"n": 1e400}'), "json", "out of range"),
    "long-attribute-name": (
        raw_submission(json.dumps({"k" * 1001: 1})),
        "limits",
        "an attribute name of 1001 characters",
    ),
}


@pytest.mark.parametrize("case", sorted(POISON))
def test_poison_among_good_files_is_quarantined_and_the_rest_applied(
    case: str, db: None, the_spool: Spool, drop: Drop
) -> None:
    content, stage, message = POISON[case]
    goods(drop)
    drop(f"{case}.json", content)

    progress = drain(the_spool, stuck_after=10)

    assert names(the_spool.incoming) == []
    assert names(the_spool.failed) == [f"{case}.json", f"{case}.json.reason.json"]
    why = reason(the_spool, f"{case}.json")
    assert why["stage"] == stage, why
    assert message.lower() in why["error"].lower(), why
    issue = ReconciliationIssue.objects.get()
    assert (issue.kind, issue.subject, issue.status) == (
        "quarantined_submission",
        f"{case}.json",
        "open",
    )
    assert (progress.applied, progress.quarantined) == (3, 1)
    assert_goods_applied()


def test_numbers_are_stored_with_all_their_digits(db: None, the_spool: Spool, drop: Drop) -> None:
    numbers = {
        "big": "12345678901234567890.5",
        "precise": "0.1000000000000000000000001",
        "tiny": "1e-400",
        "integer": "123456789012345678901234567890",
        "plain": "1.5",
    }
    attributes = "{" + ", ".join(f'"{k}": {v}' for k, v in numbers.items()) + "}"
    drop("exact.json", raw_submission(attributes))
    assert drain(the_spool, stuck_after=10).applied == 1
    with connection.cursor() as cursor:  # what the database keeps, read back as text
        column = "attributes::text" if on_postgres() else "attributes"
        cursor.execute(f"SELECT {column} FROM facts WHERE key = 'raw'")
        (stored,) = cursor.fetchone()
    kept = json.loads(stored, parse_float=Decimal, parse_int=Decimal)
    assert {k: kept[k] for k in numbers} == {k: Decimal(v) for k, v in numbers.items()}


def test_a_reason_keeps_every_validation_error_and_their_count(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    facts = [{"entity": "run", "attributes": {}} for _ in range(80)]  # 80 missing keys
    drop("many.json", {"schema": "holdfast.submission/v1", "lab": "l", "facts": facts})
    drop("few.json", {"schema": "holdfast.submission/v1", "lab": 1, "facts": facts[:3]})
    drain(the_spool, stuck_after=10)

    many = reason(the_spool, "many.json")
    assert many["error_count"] == 81  # 80 keys and the submitted_at
    assert len(many["errors"]) == MAX_ERRORS
    assert "(81 errors in all" in many["error"]
    few = reason(the_spool, "few.json")
    assert few["error_count"] == 5 and len(few["errors"]) == 5  # lab, time, 3 keys
    assert any("'key' is a required property" in e for e in few["errors"])
    assert any("$.lab" in e for e in few["errors"])
    issue = ReconciliationIssue.objects.get(subject="few.json")
    assert issue.details["errors"] == few["errors"] and issue.details["error_count"] == 5


def test_a_reason_lists_every_fact_that_appears_twice(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    """It named the first duplicate only: a producer fixed one and was refused again for
    the next (audit)."""
    facts = [{"entity": "run", "key": key, "attributes": {}} for key in "abacbd"]
    drop("twice.json", {**submission(), "facts": facts})
    drain(the_spool, stuck_after=10)

    refused = reason(the_spool, "twice.json")
    assert refused["stage"] == "semantic" and refused["error_count"] == 2
    assert refused["errors"] == [
        "$.facts[2]: entity 'run' key 'a' appears twice",
        "$.facts[4]: entity 'run' key 'b' appears twice",
    ]
    assert refused["error"].endswith("(2 errors in all; the reason lists the first 2)")


def test_quarantining_the_same_bytes_again_opens_a_new_issue_and_logs_it(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    drop("bad.json", b"{not json")
    drain(the_spool, stuck_after=10)
    first = ReconciliationIssue.objects.get()
    resolve(first.pk, by="operator", comment="asked the lab")
    # Someone puts the same bytes back, unchanged.
    (the_spool.failed / "bad.json").rename(the_spool.incoming / "bad.json")
    (the_spool.failed / "bad.json.reason.json").unlink()
    with capture_logs() as logs:
        drain(the_spool, stuck_after=10)
    again = ReconciliationIssue.objects.exclude(pk=first.pk).get()
    assert again.status == "open"
    assert again.details["previous_issues"] == [first.pk]
    events = [e for e in logs if e["event"] == "submission_quarantined_again"]
    assert [(e["file"], e["previous_issues"]) for e in events] == [("bad.json", [first.pk])]


def test_bytes_put_back_while_their_issue_is_open_are_a_new_quarantine(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    """The documented recovery (move the file back unchanged, remove the reason) before
    anyone resolved the issue: a new issue and the event, not the old issue reused as if
    the first move were being retried."""
    drop("bad.json", b"{not json")
    drain(the_spool, stuck_after=10)
    first = ReconciliationIssue.objects.get()
    (the_spool.failed / "bad.json.reason.json").unlink()
    (the_spool.failed / "bad.json").rename(the_spool.incoming / "bad.json")
    with capture_logs() as logs:
        drain(the_spool, stuck_after=10)
    again = ReconciliationIssue.objects.exclude(pk=first.pk).get()
    assert again.details["previous_issues"] == [first.pk]
    assert [e["previous_issues"] for e in logs if e["event"] == "submission_quarantined_again"] == [
        [first.pk]
    ]
    reason = json.loads((the_spool.failed / "bad.json.reason.json").read_text())
    assert reason["issue_id"] == again.pk


# --- database refusals: split the batch --------------------------------------------------


@pytest.fixture
def refused_by_the_database() -> bytes:
    """A submission that passes validation (relaxed limits) but the database refuses for
    its data: PostgreSQL's numeric keeps at most 16,383 digits after the point (22003);
    SQLite's JSON check refuses nesting deeper than its limit (json_valid, mapped to 22032)."""
    if on_postgres():
        return raw_submission('{"n": 0.' + "0" * 20_000 + "1}")
    return raw_submission('{"a": ' + deep(2504) + "}")


RELAXED = Limits(max_depth=100_000, max_number_chars=100_000, max_decimals=10**9)


def test_a_batch_with_one_file_the_database_refuses_applies_the_rest(
    db: None, the_spool: Spool, drop: Drop, refused_by_the_database: bytes
) -> None:
    goods(drop, 6)
    drop("refused.json", refused_by_the_database)
    with capture_logs() as logs:
        progress = drain(the_spool, limits=RELAXED, stuck_after=20)
    assert names(the_spool.incoming) == []
    assert (progress.applied, progress.quarantined) == (6, 1)
    assert_goods_applied(6)
    why = reason(the_spool, "refused.json")
    assert why["stage"] == "database"
    assert "refused this submission alone" in why["error"]
    assert ("[22003]" if on_postgres() else "[22032]") in why["error"], why
    assert ReconciliationIssue.objects.get().subject == "refused.json"
    assert any(e["event"] == "spool_batch_split" for e in logs)


def test_a_file_refused_alone_with_nothing_else_to_compare_stays(
    db: None, the_spool: Spool, drop: Drop, refused_by_the_database: bytes
) -> None:
    """Refused alone, but no other file committed: the database may refuse every file,
    so it is not the file's fault yet. It stays, and is judged with the next files."""
    drop("refused.json", refused_by_the_database)
    with pytest.raises(Stuck, match=r"last error: (DataError|IntegrityError) \[22"):
        drain(the_spool, limits=RELAXED, stuck_after=1.5)
    assert names(the_spool.incoming) == ["refused.json"] and names(the_spool.failed) == []
    assert not ReconciliationIssue.objects.exists()

    goods(drop, 2)
    progress = drain(the_spool, limits=RELAXED, stuck_after=20)
    assert (progress.applied, progress.quarantined) == (2, 1)
    assert names(the_spool.failed) == ["refused.json", "refused.json.reason.json"]


def test_a_refused_file_that_cannot_be_moved_waits_for_the_move_not_the_database(
    db: None, the_spool: Spool, drop: Drop, refused_by_the_database: bytes
) -> None:
    """Its issue committed, the move refused (failed/ not writable): the file was then
    refused alone with nothing to compare, so "unconfirmed", and tried again at the
    database every 0.2 s for ever, the stuck reason naming the refusal, not the move
    (audit). Its committed issue confirms it: it waits, backing off, for the move."""
    goods(drop, 2)
    drop("refused.json", refused_by_the_database)
    real = spool.blobs.write_durably
    moves = 0

    def refuse(target: Path, data: bytes) -> None:
        nonlocal moves
        moves += 1
        raise PermissionError(13, "Permission denied", str(target))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spool.blobs, "write_durably", refuse)
        with pytest.raises(Stuck) as stuck:
            drain(the_spool, limits=RELAXED, stuck_after=2.5)
    assert "refused.json: cannot move it to failed/" in str(stuck.value)
    assert "Permission denied" in str(stuck.value)
    assert 2 <= moves <= 7, moves  # backed off: 0.2 s, 0.4 s, 0.8 s, ...
    assert names(the_spool.incoming) == ["refused.json"]
    progress = drain(the_spool, limits=RELAXED, stuck_after=20)
    assert progress.quarantined == 1
    assert names(the_spool.failed) == ["refused.json", "refused.json.reason.json"]
    assert ReconciliationIssue.objects.count() == 1  # the same file: its issue reused
    assert real is spool.blobs.write_durably


@pytest.fixture
def every_fact_refused() -> Iterator[str]:
    """The database refuses every file with a data exception: a trigger on PostgreSQL
    (SQLSTATE 22023), a length limit every attribute exceeds on SQLite (SQLITE_TOOBIG)."""
    if on_postgres():
        with connection.cursor() as cursor:
            cursor.execute(
                "CREATE FUNCTION refuse_facts() RETURNS trigger LANGUAGE plpgsql AS $$ "
                "BEGIN RAISE EXCEPTION 'facts are frozen' USING ERRCODE = '22023'; END $$"
            )
            cursor.execute(
                "CREATE TRIGGER refuse_facts BEFORE INSERT ON facts "
                "FOR EACH ROW EXECUTE FUNCTION refuse_facts()"
            )
        yield "22023"
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER refuse_facts ON facts")
            cursor.execute("DROP FUNCTION refuse_facts()")
        return
    import sqlite3

    connection.ensure_connection()
    raw = connection.connection
    usual = raw.getlimit(sqlite3.SQLITE_LIMIT_LENGTH)
    raw.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 3000)
    yield "54000"
    raw.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, usual)


def test_a_refusal_every_file_shares_leaves_the_whole_batch_in_place(
    db: None, the_spool: Spool, drop: Drop, every_fact_refused: str
) -> None:
    for i in range(4):
        drop(f"f{i}.json", submission(key=f"k{i}", pad="x" * 4000))
    before = names(the_spool.incoming)
    with pytest.raises(Stuck, match=every_fact_refused):
        drain(the_spool, stuck_after=1.5)
    assert names(the_spool.incoming) == before
    assert names(the_spool.failed) == []
    assert not ReconciliationIssue.objects.exists() and not IngestedSubmission.objects.exists()


# A constraint or a trigger the operator added refuses some rows: the refusal is a file's
# own when it reproduces alone and the rest commits (not only data exceptions).
REFUSALS: dict[str, tuple[list[str], list[str], str, str]] = {
    # Two facts of one file under a unique index that admits one: 23505 on both databases.
    "unique": (
        [
            "CREATE UNIQUE INDEX poison_once ON facts ((substr(key, 1, 0))) "
            "WHERE key LIKE 'poison%%'"
        ],
        ["DROP INDEX poison_once"],
        "23505",
        "23505",
    ),
    # A trigger refusing the row: RAISE in PL/pgSQL (P0001), RAISE(ABORT) in SQLite.
    "trigger": (
        [
            "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.key LIKE 'poison%%' THEN RAISE EXCEPTION 'no poison here'; END IF; "
            "RETURN NEW; END $$",
            "CREATE TRIGGER refuse_poison BEFORE INSERT ON facts "
            "FOR EACH ROW EXECUTE FUNCTION refuse_poison()",
        ],
        ["DROP TRIGGER refuse_poison ON facts", "DROP FUNCTION refuse_poison()"],
        "P0001",
        "P0001",
    ),
}
SQLITE_TRIGGER = (
    "CREATE TRIGGER refuse_poison BEFORE INSERT ON facts WHEN NEW.key LIKE 'poison%%' "
    "BEGIN SELECT RAISE(ABORT, 'no poison here'); END"
)


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_file_a_constraint_or_trigger_refuses_is_quarantined_and_the_rest_applied(
    db: None, the_spool: Spool, drop: Drop, case: str
) -> None:
    create, drop_it, postgres_code, sqlite_code = REFUSALS[case]
    if not on_postgres():
        create = [SQLITE_TRIGGER] if case == "trigger" else create
        drop_it = ["DROP TRIGGER refuse_poison"] if case == "trigger" else drop_it
    with connection.cursor() as cursor:
        for statement in create:
            cursor.execute(statement)
    try:
        goods(drop, 20)
        poison = submission(key="poison-a")
        poison["facts"].append({"entity": "run", "key": "poison-b", "attributes": {}})
        drop("poison.json", poison)
        progress = drain(the_spool, stuck_after=20)
    finally:
        with connection.cursor() as cursor:
            for statement in drop_it:
                cursor.execute(statement)
    assert names(the_spool.incoming) == []
    assert (progress.applied, progress.quarantined) == (20, 1)
    assert_goods_applied(20)
    why = reason(the_spool, "poison.json")
    assert why["stage"] == "database"
    expected = postgres_code if on_postgres() else sqlite_code
    assert f"[{expected}]" in why["error"], why
    assert ReconciliationIssue.objects.get().subject == "poison.json"


def test_a_transient_error_is_never_split_down_to_a_quarantine() -> None:
    """Serialization failures, lock timeouts, a lost connection, a schema we do not match:
    none of them is ever a file's own, however often it reproduces."""
    import sqlite3

    from django.db import OperationalError, ProgrammingError

    def wrapped(cause: BaseException, outer: type[Exception]) -> Exception:
        error = outer(str(cause))
        error.__cause__ = cause
        return error

    class Cause(Exception):
        def __init__(self, sqlstate: str) -> None:
            super().__init__(sqlstate)
            self.sqlstate = sqlstate

    for code in ("40001", "40P01", "55P03", "57014", "08006", "53100", "42703", "XX000"):
        assert spool.refusal_sqlstate(wrapped(Cause(code), OperationalError)) is None, code
    for code in ("22003", "23505", "23514", "44000", "54000", "P0001"):
        assert spool.refusal_sqlstate(wrapped(Cause(code), ProgrammingError)) == code
    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = sqlite3.SQLITE_BUSY
    assert spool.refusal_sqlstate(wrapped(busy, OperationalError)) is None


def test_batches_are_bounded_by_bytes(db: None, the_spool: Spool, drop: Drop) -> None:
    for i in range(12):
        drop(f"big-{i:02}.json", submission(key=f"k{i}", pad="y" * 100_000))
    writer = Writer(the_spool, max_bytes=350_000)
    with capture_logs() as logs:
        assert drain(the_spool, stuck_after=20, writer=writer).applied == 12
    batches = [e for e in logs if e["event"] == "spool_batch_applied"]
    assert len(batches) >= 4
    assert all(e["bytes"] <= 350_000 for e in batches), batches


def test_a_batch_being_retried_does_not_grow(db: None, the_spool: Spool, drop: Drop) -> None:
    writer = Writer(the_spool)
    writer.add(read_entry(the_spool, drop("a.json", submission()).name, Limits()))  # type: ignore[arg-type]
    writer.failures = 1  # as after a failed flush
    assert not writer.accepting
    writer.failures = 0
    assert writer.accepting


# --- the stuck rule on time, lab data never in the statement text -----------------------


@pytest.fixture
def facts_locked(transactional_db: None) -> Iterator[Callable[[], list[str]]]:
    """Another session holds a lock the writer needs; yields a function listing what other
    sessions are running (PostgreSQL: the statement texts the server logs)."""
    other = connections.create_connection("default")
    try:
        if other.vendor == "postgresql":
            other.set_autocommit(False)
            with other.cursor() as cursor:
                cursor.execute("LOCK TABLE facts IN ACCESS EXCLUSIVE MODE")

            import psycopg

            from tests.conftest import database_url

            url = database_url(connection.settings_dict)

            def running() -> list[str]:  # from any thread: a connection of its own
                with psycopg.connect(url, autocommit=True) as watcher:
                    rows = watcher.execute(
                        "SELECT query FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                        "AND datname = current_database() AND state = 'active'"
                    ).fetchall()
                return [row[0] for row in rows]

            yield running
            other.rollback()
        else:
            other.ensure_connection()
            other.connection.execute("BEGIN IMMEDIATE")
            yield list
            other.connection.execute("ROLLBACK")
    finally:
        other.close()


def test_the_job_path_stuck_exit_fires_on_time_under_a_table_lock(
    the_spool: Spool, drop: Drop, facts_locked: Callable[[], list[str]]
) -> None:
    marker = "lab-secret-marker-7f3a"
    for i in range(3):
        drop(f"s{i}.json", submission(lab=marker, key=f"k{i}", note=marker))
    seen: list[str] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            seen.extend(facts_locked())
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    try:
        with pytest.raises(Stuck, match=r"stuck: 3 file\(s\) pending"):
            drain(the_spool, stuck_after=2.0)
    finally:
        watching.set()
        watcher.join()
    took = time.monotonic() - started
    assert took < 2.0 + 4.0, f"the stuck exit took {took:.1f} s"
    assert names(the_spool.incoming) == ["s0.json", "s1.json", "s2.json"]
    if on_postgres():
        waiting = [q for q in seen if "INSERT INTO" in q or "jsonb" in q]
        assert waiting, seen  # the writer's statement was seen waiting on the lock
        assert all("$1" in q for q in waiting), waiting
        assert not any(marker in q for q in seen), "lab data inlined into the SQL text"


def test_a_refused_flush_reports_the_error_without_the_batch(
    db: None, the_spool: Spool, drop: Drop, refused_by_the_database: bytes
) -> None:
    """The database's reason names the error, not the batch's data (PostgreSQL echoes a
    bound parameter as '...' only; an inlined statement would carry the whole batch)."""
    drop("good.json", submission(lab="marker-lab-9c1"))
    drop("refused.json", refused_by_the_database)
    with capture_logs() as logs:
        drain(the_spool, limits=RELAXED, stuck_after=20)
    assert names(the_spool.failed) == ["refused.json", "refused.json.reason.json"]
    why = reason(the_spool, "refused.json")
    text = json.dumps(why) + json.dumps(logs, default=str)
    assert "marker-lab-9c1" not in text
    assert "0000000000" not in text  # nor the refused file's own 20,000 digits
    assert len(why["error"]) < 600


# --- files that change: never deleted or quarantined on an old read --------------------


def test_a_file_rewritten_in_place_after_it_was_read_is_not_deleted(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    path = drop("a.json", submission(key="old"))
    entry = read_entry(the_spool, "a.json", Limits())
    assert entry is not None
    inode = path.stat().st_ino
    with path.open("r+b") as handle:  # in place: same inode, new content
        handle.write(json.dumps(submission(key="new")).encode())
        handle.truncate()
    assert path.stat().st_ino == inode
    outcomes: list[tuple[str, str]] = []
    writer = Writer(the_spool, report=lambda n, o, d="", w=0.0: outcomes.append((n, o)))
    writer.add(entry)
    assert writer.flush()
    assert outcomes == [("a.json", "skipped")]  # the old bytes applied; the file kept
    assert path.exists()

    drain(the_spool, stuck_after=10)  # its new content is read and applied
    assert not path.exists()
    assert set(Fact.objects.values_list("key", flat=True)) == {"old", "new"}


def test_a_file_being_written_in_place_is_not_quarantined_half_written(
    db: None, the_spool: Spool
) -> None:
    body = json.dumps(submission(key="slow"))
    path = the_spool.incoming / "copying.json"
    path.write_text(body[:20])  # cp/scp: the name exists while the bytes arrive
    with pytest.raises(NotYet, match="settle"):
        read_entry(the_spool, "copying.json", Limits(), settle=30)
    finished = threading.Timer(0.8, lambda: path.write_text(body))
    finished.start()
    try:
        progress = drain(the_spool, stuck_after=15, settle=2)
    finally:
        finished.join()
    assert (progress.applied, progress.quarantined) == (1, 0)
    assert names(the_spool.failed) == []


def test_a_file_corrected_while_its_quarantine_is_written_is_applied_not_quarantined(
    db: None, the_spool: Spool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A corrected submission renamed over the bad one while the bad one's reason is
    written: the move to failed/ is checked after the file is taken out of incoming/, so
    the corrected file is put back and applied, and no reason is left behind (I6)."""
    bad = the_spool.incoming / "x.json"
    bad.write_text('{"schema": ')
    corrected = the_spool.root / "x.json.tmp"
    corrected.write_text(json.dumps(submission(key="corrected")))
    original = spool.blobs.write_durably
    replaced: list[Path] = []

    def write_durably(path: Path, data: bytes) -> None:
        if not replaced and path.name.endswith(spool.REASON_SUFFIX):
            os.rename(corrected, bad)  # the operator's mv, mid-quarantine
            replaced.append(path)
        original(path, data)

    monkeypatch.setattr(spool.blobs, "write_durably", write_durably)
    progress = drain(the_spool, stuck_after=15)
    assert replaced, "the quarantine did not write a reason"
    assert (progress.applied, progress.quarantined) == (1, 0)
    assert names(the_spool.failed) == [] and names(the_spool.incoming) == []
    assert Fact.objects.filter(key="corrected").exists()


def test_a_file_replaced_just_before_its_acked_predecessor_is_deleted_is_kept_and_applied(
    db: None, the_spool: Spool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New data renamed over a name right after the writer checked it, before the unlink:
    the file is taken aside by a rename and compared again, so the new one is put back
    and applied, never deleted on the strength of the old one's ack (I6)."""
    name = the_spool.incoming / "daily.json"
    name.write_text(json.dumps(submission(key="monday")))
    newer = the_spool.root / "daily.json.tmp"
    newer.write_text(json.dumps(submission(key="tuesday")))
    original = spool.acked_name  # called between remove()'s check and its rename
    replaced: list[bool] = []

    def acked_name(entry: spool.Entry) -> str:
        if not replaced:
            os.rename(newer, name)  # the producer's mv, between the check and the unlink
            replaced.append(True)
        return original(entry)

    monkeypatch.setattr(spool, "acked_name", acked_name)
    progress = drain(the_spool, stuck_after=15)
    assert replaced and progress.applied == 2
    assert set(Fact.objects.values_list("key", flat=True)) == {"monday", "tuesday"}
    assert names(the_spool.incoming) == []


def test_a_removal_a_crash_interrupted_is_put_back_and_read_again(
    db: None, the_spool: Spool
) -> None:
    (the_spool.incoming / ".late.json.acked").write_text(json.dumps(submission(key="late")))
    the_spool.ensure()
    assert names(the_spool.incoming) == ["late.json"]
    assert drain(the_spool, stuck_after=15).applied == 1


def test_a_quarantine_a_crash_interrupted_is_finished_at_start(db: None, the_spool: Spool) -> None:
    (the_spool.failed / ".bad.json.claim").write_text('{"schema": ')
    (the_spool.failed / "bad.json.reason.json").write_text("{}")
    the_spool.ensure()
    assert names(the_spool.failed) == ["bad.json", "bad.json.reason.json"]


def test_a_file_that_stays_malformed_is_quarantined_once_settled(
    db: None, the_spool: Spool
) -> None:
    (the_spool.incoming / "truncated.json").write_text('{"schema": ')
    started = time.monotonic()
    progress = drain(the_spool, stuck_after=15, settle=1)
    assert progress.quarantined == 1
    assert time.monotonic() - started >= 0.9


# --- bounded, safe reads ----------------------------------------------------------------


def test_a_huge_sparse_file_is_quarantined_at_once_without_being_read(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    goods(drop, 2)
    sparse = the_spool.incoming / "sparse.json"
    with sparse.open("wb") as handle:
        handle.truncate(8 * 1024**3)  # 8 GiB apparent, no blocks
    started = time.monotonic()
    progress = drain(the_spool, stuck_after=10)
    assert time.monotonic() - started < 5
    assert (progress.applied, progress.quarantined) == (2, 1)
    why = reason(the_spool, "sparse.json")
    assert why["stage"] == "limits" and why["hash"] is None and why["size"] == 8 * 1024**3


def test_symlinks_fifos_and_devices_are_quarantined_never_opened(
    db: None, the_spool: Spool, drop: Drop, tmp_path: Path
) -> None:
    goods(drop, 2)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps(submission(key="not-for-the-spool")))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (the_spool.incoming / "link.json").symlink_to(secret)
    (the_spool.incoming / "link-to-fifo.json").symlink_to(fifo)
    os.mkfifo(the_spool.incoming / "fifo.json")

    progress = drain(the_spool, stuck_after=10)  # returns: nothing blocks on a FIFO

    assert (progress.applied, progress.quarantined) == (2, 3)
    assert names(the_spool.incoming) == []
    assert reason(the_spool, "link.json")["stage"] == "file"
    assert "symbolic link" in reason(the_spool, "link.json")["error"]
    assert "FIFO" in reason(the_spool, "fifo.json")["error"]
    assert (the_spool.failed / "link.json").is_symlink()  # the link moved, not its target
    assert secret.exists() and not Fact.objects.filter(key="not-for-the-spool").exists()


def test_a_symlink_swapped_in_after_listing_is_not_followed(
    db: None, the_spool: Spool, drop: Drop, tmp_path: Path
) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    path = drop("swapped.json", submission())
    path.unlink()
    path.symlink_to(fifo)  # between the listing and the open
    started = time.monotonic()
    entry = read_entry(the_spool, "swapped.json", Limits())
    assert time.monotonic() - started < 2
    assert entry is not None and entry.submission is None and entry.stage == "file"


def test_a_file_that_grows_past_the_limit_is_read_no_further(the_spool: Spool) -> None:
    path = the_spool.incoming / "growing.json"
    path.write_bytes(b" " * 100)
    limits = Limits(max_file_bytes=1000)
    real_read = os.read
    reads: list[int] = []

    def growing_read(fd: int, n: int) -> bytes:
        reads.append(n)
        with path.open("ab") as handle:  # the producer keeps appending
            handle.write(b" " * 5000)
        return real_read(fd, n)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spool.os, "read", growing_read)
        with pytest.raises(NotYet, match="changed while it was read"):
            read_entry(the_spool, "growing.json", limits, settle=0)
    assert sum(reads) <= limits.max_file_bytes + 1


# --- bounded state, quiet idling ---------------------------------------------------------


def test_the_monitor_forgets_files_that_are_gone(the_spool: Spool) -> None:
    monitor = Monitor(the_spool, stuck_after=60, grace=0)
    for round_ in range(5):
        for i in range(200):
            (the_spool.incoming / f"r{round_}-{i}.json").write_text("{}")
        monitor.scan()
        taken = monitor.take(1000)
        assert len(taken) == 200
        for name in taken:
            monitor.outcome(name, "retry", "", 0.0)  # unreadable, say
            (the_spool.incoming / name).unlink()  # ...then removed by someone
        monitor.scan()
        assert len(monitor.files) == 0
    assert len(monitor.retries) <= 1000  # each pops once; vanished names are dropped then
    monitor.take(10, now=time.monotonic() + 10)
    assert monitor.retries == []


def test_an_idle_ingester_logs_no_progress() -> None:
    now = [0.0]
    events = ProgressEvents(interval=10.0, clock=lambda: now[0])
    figures = {"seen": 5, "applied": 5, "duplicates": 0, "quarantined": 0, "pending": 0}
    with capture_logs() as logs:
        for _ in range(6):  # an hour of nothing
            now[0] += 600
            events.update({**figures, "elapsed_s": now[0], "rate_files_per_s": 0.0})
        events.update({**figures, "applied": 6, "seen": 6})
    assert [e["applied"] for e in logs if e["event"] == "ingest_progress"] == [5, 6]


def test_any_exception_while_parsing_is_the_files_own() -> None:
    with pytest.MonkeyPatch.context() as patch:

        def explode(*args: Any, **kwargs: Any) -> Any:
            raise OverflowError("some odd corner")

        patch.setattr("ingestion.submissions.parse_time", explode)
        from ingestion.submissions import InvalidSubmission

        with pytest.raises(InvalidSubmission) as raised:
            parse(json.dumps(submission()).encode(), Limits())
    assert raised.value.stage == "parse" and "OverflowError" in raised.value.message


def test_a_file_name_that_is_not_utf8_is_quarantined_not_fatal(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    goods(drop, 2)
    name = os.fsdecode(b"bad-\xff.json")  # a producer's byte name: no database stores it
    (the_spool.incoming / name).write_text(json.dumps(submission(key="odd")))
    progress = drain(the_spool, stuck_after=10)
    assert (progress.applied, progress.quarantined) == (2, 1)
    assert names(the_spool.failed) == [name, f"{name}.reason.json"]
    assert reason(the_spool, name)["stage"] == "file"
    assert ReconciliationIssue.objects.get().subject == "bad-\ufffd.json"


def test_the_longest_identity_the_limits_allow_is_stored_on_both_databases(
    db: None, the_spool: Spool
) -> None:
    body = submission(key="\U00010000" * 450)
    body["facts"][0]["entity"] = "e" * 200  # 2,000 bytes together: the limit
    (the_spool.incoming / "long.json").write_text(json.dumps(body))
    progress = drain(the_spool, stuck_after=15)
    assert (progress.applied, progress.quarantined) == (1, 0)
    assert Fact.objects.get().key == "\U00010000" * 450


# --- two ingesters of one spool (the ingester and the spool-sweep job) -------------------


def _quarantine_during_the_move(
    the_spool: Spool, meanwhile: Callable[[spool.Entry], None]
) -> Path | None:
    """Quarantine ``bad.json``, running ``meanwhile`` between its reason's write and the move."""
    entry = read_entry(the_spool, "bad.json", Limits())
    assert entry is not None
    real_write = spool.blobs.write_durably
    ran: list[bool] = []

    def write_then_meanwhile(path: Path, data: bytes) -> None:
        real_write(path, data)
        if not ran:
            ran.append(True)
            meanwhile(entry)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spool.blobs, "write_durably", write_then_meanwhile)
        return spool.quarantine(the_spool, entry, 7)


def test_a_file_another_ingester_quarantined_meanwhile_is_left_to_it(
    the_spool: Spool, drop: Drop
) -> None:
    """The slower of two moves found the file gone: it raised, logged a false
    ``spool_finish_failed`` error and retried a file already in failed/ (audit)."""
    drop("bad.json", b"not json")
    moved: list[Path | None] = []
    assert _quarantine_during_the_move(
        the_spool, lambda entry: moved.append(spool.quarantine(the_spool, entry, 7))
    ) is None  # fmt: skip
    assert moved == [the_spool.failed / "bad.json"]
    assert sorted(p.name for p in the_spool.failed.iterdir()) == [
        "bad.json",
        "bad.json.reason.json",
    ]
    assert reason(the_spool, "bad.json")["issue_id"] == 7


def test_a_file_its_producer_deleted_before_the_move_leaves_no_reason(
    the_spool: Spool, drop: Drop
) -> None:
    drop("bad.json", b"not json")
    gone = _quarantine_during_the_move(
        the_spool, lambda entry: (the_spool.incoming / "bad.json").unlink()
    )
    assert gone is None
    assert list(the_spool.failed.iterdir()) == []


def test_two_ingesters_quarantining_one_file_open_one_issue(
    transactional_db: None, the_spool: Spool, drop: Drop
) -> None:
    """Each found no issue and opened its own: the file had two open issues (audit)."""
    drop("bad.json", b"not json")
    entry = read_entry(the_spool, "bad.json", Limits())
    assert entry is not None
    first, second = decided_in_turn(lambda: spool.quarantine_issue(entry, "default"))
    assert first == second
    assert ReconciliationIssue.objects.count() == 1
