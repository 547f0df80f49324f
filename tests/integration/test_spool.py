"""The spool's rules (I6, issue 5) on a real database, in one process: apply every valid
submission exactly once, quarantine only the submission's own errors, leave everything in
place on database errors. The multi-process command is in tests/process/test_spool_crash.py."""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from django.db import OperationalError

from ingestion import blobs, spool
from ingestion.handlers import ingest_spool
from ingestion.models import Fact, IngestedSubmission, Lab, ReconciliationIssue
from ingestion.spool import Overdue, Spool, Stuck, Writer, apply_batch, drain, read_entry
from ingestion.submissions import MIB, Limits
from jobs.enqueueing import enqueue
from jobs.models import Job, State

pytestmark = pytest.mark.timeout(30)


def submission(
    lab: str = "lab-berlin-3",
    submitted_at: str = "2026-11-30T10:00:00Z",
    facts: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    if facts is None:
        facts = [{"entity": "run", "key": "run-42", "attributes": {"status": "passed"}}]
    return {
        "schema": "holdfast.submission/v1",
        "lab": lab,
        "submitted_at": submitted_at,
        "facts": facts,
        **extra,
    }


@pytest.fixture
def the_spool(tmp_path: Path, settings: Any) -> Spool:
    settings.HOLDFAST_BLOB_DIR = tmp_path / "blobs"
    settings.HOLDFAST_SPOOL_SETTLE_SECONDS = 0  # the settle test sets its own
    root = Spool(tmp_path / "spool")
    root.ensure()
    return root


Drop = Callable[..., Path]


@pytest.fixture
def drop(the_spool: Spool) -> Drop:
    """Write a submission into incoming/ as a producer would (elsewhere, then rename)."""

    def write(name: str, content: dict[str, Any] | bytes | str) -> Path:
        if isinstance(content, dict):
            content = json.dumps(content)
        data = content.encode() if isinstance(content, str) else content
        staging = the_spool.root / ".drop.partial"  # not the name: it may be 255 bytes
        staging.write_bytes(data)
        target = the_spool.incoming / name
        staging.rename(target)
        return target

    return write


def incoming(the_spool: Spool) -> list[str]:
    return sorted(p.name for p in the_spool.incoming.iterdir())


def failed(the_spool: Spool) -> list[str]:
    return sorted(p.name for p in the_spool.failed.iterdir())


def facts() -> dict[tuple[str, str, str], tuple[dict[str, Any], datetime]]:
    return {
        (f.lab.name, f.entity, f.key): (f.attributes, f.submitted_at)
        for f in Fact.objects.select_related("lab")
    }


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- applying -------------------------------------------------------------------------


def test_a_valid_submission_is_acked_then_its_file_deleted(
    db: None, the_spool: Spool, drop: Drop, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = drop("a.json", submission(log_excerpt="line 1\nline 2\n"))
    digest = sha(path)
    removed: list[str] = []
    real_remove = spool.remove

    def remove_after_ack(root: Spool, entry: spool.Entry) -> bool:
        # The file goes only once its ack row has committed with its facts.
        assert IngestedSubmission.objects.filter(hash=entry.hash).exists()
        assert Fact.objects.filter(key="run-42").exists()
        removed.append(entry.name)
        return real_remove(root, entry)

    monkeypatch.setattr(spool, "remove", remove_after_ack)
    progress = drain(the_spool, stuck_after=5)

    assert removed == ["a.json"]
    assert incoming(the_spool) == [] and failed(the_spool) == []
    assert (progress.applied, progress.quarantined, progress.duplicates) == (1, 0, 0)
    ack = IngestedSubmission.objects.get()
    assert ack.hash == digest
    assert ack.file_name == "a.json"
    assert ack.submitted_at == datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
    assert ack.applied_at is not None
    assert ack.lab.name == "lab-berlin-3"
    assert ack.fact_count == 1
    assert blobs.read(ack.log_excerpt) == b"line 1\nline 2\n"
    assert facts() == {
        ("lab-berlin-3", "run", "run-42"): (
            {"status": "passed"},
            datetime(2026, 11, 30, 10, 0, tzinfo=UTC),
        )
    }


def test_many_files_from_several_labs_apply_in_batches(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    for i in range(30):
        drop(
            f"s{i:02}.json",
            submission(
                lab=f"lab-{i % 3}",
                facts=[
                    {"entity": "run", "key": f"run-{i}-{j}", "attributes": {"j": j}}
                    for j in range(10)
                ],
            ),
        )
    progress = drain(the_spool, stuck_after=5, writer=Writer(the_spool, max_files=7))
    assert progress.applied == 30
    assert incoming(the_spool) == []
    assert Lab.objects.count() == 3
    assert Fact.objects.count() == 300
    assert IngestedSubmission.objects.count() == 30


def test_names_other_than_incoming_json_are_ignored(db: None, the_spool: Spool, drop: Drop) -> None:
    (the_spool.incoming / "upload.json.tmp").write_text("{}")
    (the_spool.incoming / ".hidden.json").write_text("{}")
    (the_spool.incoming / "notes.txt").write_text("hello")
    (the_spool.incoming / "dir.json").mkdir()
    (the_spool.root / "stray.json").write_text("{}")
    drop("real.json", submission())
    drain(the_spool, stuck_after=5)
    assert incoming(the_spool) == [".hidden.json", "dir.json", "notes.txt", "upload.json.tmp"]
    assert failed(the_spool) == []
    assert IngestedSubmission.objects.count() == 1


# --- duplicates and ordering ----------------------------------------------------------


def test_the_same_bytes_twice_in_one_batch_or_later_apply_once(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    body = json.dumps(submission(facts=[{"entity": "run", "key": "r", "attributes": {"n": 1}}]))
    drop("first.json", body)
    drop("again.json", body)
    progress = drain(the_spool, stuck_after=5)
    assert incoming(the_spool) == []
    assert (progress.applied, progress.duplicates) == (1, 1)
    ack = IngestedSubmission.objects.get()

    # Meanwhile the fact changed through a newer submission; a late copy of the old bytes
    # is recognised by its hash and deleted without being applied again.
    drop(
        "newer.json",
        submission(
            submitted_at="2026-11-30T11:00:00Z",
            facts=[{"entity": "run", "key": "r", "attributes": {"n": 2}}],
        ),
    )
    drain(the_spool, stuck_after=5)
    drop("late-copy.json", body)
    progress = drain(the_spool, stuck_after=5)
    assert (progress.applied, progress.duplicates) == (0, 1)
    assert incoming(the_spool) == [] and failed(the_spool) == []
    assert IngestedSubmission.objects.count() == 2
    assert IngestedSubmission.objects.get(hash=ack.hash).applied_at == ack.applied_at
    assert Fact.objects.get(key="r").attributes == {"n": 2}


def test_an_older_submission_never_overwrites_a_newer_one(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    drop(
        "new.json",
        submission(
            submitted_at="2026-11-30T12:00:00+01:00",
            facts=[
                {"entity": "run", "key": "a", "attributes": {"v": "new"}},
            ],
        ),
    )
    drain(the_spool, stuck_after=5)
    drop(
        "old.json",
        submission(
            submitted_at="2026-11-30T10:30:00Z",
            facts=[
                {"entity": "run", "key": "a", "attributes": {"v": "old"}},
                {"entity": "run", "key": "b", "attributes": {"v": "old"}},
            ],
        ),
    )
    drain(the_spool, stuck_after=5)
    found = facts()
    assert found[("lab-berlin-3", "run", "a")] == (
        {"v": "new"},
        datetime(2026, 11, 30, 11, 0, tzinfo=UTC),
    )
    assert found[("lab-berlin-3", "run", "b")][0] == {"v": "old"}  # new keys still land
    assert IngestedSubmission.objects.count() == 2  # both applied, both acked


def test_out_of_order_in_one_batch_keeps_the_newest(db: None, the_spool: Spool, drop: Drop) -> None:
    newest = submission(
        submitted_at="2026-12-01T00:00:00Z",
        facts=[{"entity": "run", "key": "a", "attributes": {"v": 3}}],
    )
    drop("1-newest.json", newest)
    for hour, v in ((9, 1), (10, 2)):
        drop(
            f"{v + 1}-old.json",
            submission(
                submitted_at=f"2026-11-30T{hour:02}:00:00Z",
                facts=[{"entity": "run", "key": "a", "attributes": {"v": v}}],
            ),
        )
    drain(the_spool, stuck_after=5)
    assert Fact.objects.get(key="a").attributes == {"v": 3}
    assert IngestedSubmission.objects.count() == 3


# --- quarantine: the submission's own errors only -------------------------------------

POISON: dict[str, tuple[bytes | dict[str, Any], str, str]] = {
    "invalid-json": (b'{"schema": "holdfast.submission/v1", "lab": ', "json", "invalid JSON"),
    "not-utf8": (b'{"lab": "\xff"}', "json", "not UTF-8"),
    "nan": (
        b'{"schema": "holdfast.submission/v1", "lab": "l", "submitted_at": '
        b'"2026-11-30T10:00:00Z", "facts": [{"entity": "e", "key": "k", '
        b'"attributes": {"x": NaN}}]}',
        "json",
        "NaN",
    ),
    "not-an-object": (b"[1, 2, 3]", "schema", "is not of type 'object'"),
    "wrong-schema": (submission() | {"schema": "holdfast.submission/v9"}, "schema", "$.schema"),
    "missing-lab": (
        {k: v for k, v in submission().items() if k != "lab"},
        "schema",
        "'lab' is a required property",
    ),
    "extra-field": (submission(colour="blue"), "schema", "Additional properties"),
    "fact-without-key": (
        submission(facts=[{"entity": "run", "attributes": {}}]),
        "schema",
        "$.facts[0]: 'key' is a required property",
    ),
    "naive-time": (submission(submitted_at="2026-11-30T10:00:00"), "semantic", "no UTC offset"),
    "bad-time": (submission(submitted_at="yesterday at ten"), "semantic", "not an ISO 8601"),
    "nul-character": (
        submission(facts=[{"entity": "run", "key": "a\x00b", "attributes": {}}]),
        "semantic",
        "NUL",
    ),
    "lone-surrogate": (
        b'{"schema": "holdfast.submission/v1", "lab": "l\\ud800", "submitted_at": '
        b'"2026-11-30T10:00:00Z", "facts": []}',
        "semantic",
        "surrogate",
    ),
    "duplicate-key": (
        b'{"schema": "holdfast.submission/v1", "lab": "lab-a", "lab": "lab-evil", '
        b'"submitted_at": "2026-11-30T10:00:00Z", "facts": []}',
        "json",
        "names the key 'lab' twice",
    ),
    "too-many-decimals": (  # eight characters; PostgreSQL's numeric refuses it (22003)
        b'{"schema": "holdfast.submission/v1", "lab": "l", "submitted_at": '
        b'"2026-11-30T10:00:00Z", "facts": [{"entity": "e", "key": "k", '
        b'"attributes": {"x": 1e-20000}}]}',
        "json",
        "more than 16383 digits after the point",
    ),
    "same-fact-twice": (
        submission(facts=[{"entity": "run", "key": "a", "attributes": {}}] * 2),
        "semantic",
        "appears twice",
    ),
    "too-many-facts": (
        submission(facts=[{"entity": "run", "key": f"k{i}", "attributes": {}} for i in range(6)]),
        "limits",
        "6 facts, more than the limit of 5",
    ),
    "excerpt-too-large": (
        submission(log_excerpt="x" * 2001),
        "limits",
        "log_excerpt is 2001 bytes",
    ),
    "file-too-large": (
        submission(facts=[{"entity": "run", "key": "a", "attributes": {"pad": "y" * 5000}}]),
        "limits",
        "more than the limit of 4096",
    ),
}

SMALL = Limits(max_file_bytes=4096, max_facts=5, max_excerpt_bytes=2000)


@pytest.mark.parametrize("case", sorted(POISON))
def test_poison_alone_goes_to_failed_with_a_reason_and_an_issue(
    case: str, db: None, the_spool: Spool, drop: Drop
) -> None:
    content, stage, message = POISON[case]
    drop("good-1.json", submission(lab="lab-a"))
    bad = drop(f"{case}.json", content)
    digest = sha(bad)
    drop("good-2.json", submission(lab="lab-b"))

    progress = drain(the_spool, limits=SMALL, stuck_after=5)

    assert incoming(the_spool) == []
    assert failed(the_spool) == [f"{case}.json", f"{case}.json.reason.json"]
    assert sha(the_spool.failed / f"{case}.json") == digest  # moved, byte for byte
    reason = json.loads((the_spool.failed / f"{case}.json.reason.json").read_text())
    assert reason["stage"] == stage
    assert message in reason["error"], reason
    # A file over the size limit is judged by its size alone, never read nor hashed.
    hashed = digest if case != "file-too-large" else None
    assert reason["hash"] == hashed
    assert reason["file"] == f"{case}.json"
    assert datetime.fromisoformat(reason["quarantined_at"]).tzinfo is not None
    issue = ReconciliationIssue.objects.get()
    assert (issue.kind, issue.subject, issue.status) == (
        "quarantined_submission",
        f"{case}.json",
        "open",
    )
    assert issue.details["hash"] == (hashed or "")
    assert reason["issue_id"] == issue.pk
    # The rest of its batch applied.
    assert (progress.applied, progress.quarantined) == (2, 1)
    assert set(Lab.objects.values_list("name", flat=True)) == {"lab-a", "lab-b"}
    assert IngestedSubmission.objects.count() == 2


def test_a_second_poison_file_of_the_same_name_keeps_the_first(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    drop("x.json", b"not json")
    drain(the_spool, stuck_after=5)
    second = drop("x.json", b"still not json")
    digest = sha(second)
    drain(the_spool, stuck_after=5)
    assert set(failed(the_spool)) == {
        "x.json",
        "x.json.reason.json",
        f"x.{digest[:12]}.json",
        f"x.{digest[:12]}.json.reason.json",
    }
    assert ReconciliationIssue.objects.count() == 2


def test_a_file_named_like_a_reason_is_never_written_over(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    """``x.json.reason.json`` is a submission name like any other: once it is in
    failed/, the reason of a later ``x.json`` must go elsewhere, not over it."""
    first = drop("x.json.reason.json", b"precious, if not json")
    digest = sha(first)
    drain(the_spool, stuck_after=5)
    second = drop("x.json", b"not json either")
    second_digest = sha(second)
    drain(the_spool, stuck_after=5)
    assert sha(the_spool.failed / "x.json.reason.json") == digest  # still the submission
    moved = f"x.{second_digest[:12]}.json"
    assert sha(the_spool.failed / moved) == second_digest
    reason = json.loads((the_spool.failed / f"{moved}.reason.json").read_text())
    assert reason["file"] == "x.json"


def test_the_same_bad_bytes_again_under_a_taken_name_keep_every_copy(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    for _ in range(3):  # x.json, then x.<hash>.json, then x.<hash>.2.json
        drop("x.json", b"the same bad bytes")
        drain(the_spool, stuck_after=5)
    digest = hashlib.sha256(b"the same bad bytes").hexdigest()[:12]
    assert failed(the_spool) == sorted(
        f"{name}{suffix}"
        for name in ("x.json", f"x.{digest}.json", f"x.{digest}.2.json")
        for suffix in ("", ".reason.json")
    )
    issues = list(ReconciliationIssue.objects.order_by("pk"))
    assert len(issues) == 3
    assert issues[2].details["previous_issues"] == [issues[0].pk, issues[1].pk]


@pytest.mark.parametrize("length", [243, 250, 255])
def test_a_bad_file_with_a_long_name_is_quarantined_under_a_shorter_one(
    db: None, the_spool: Spool, drop: Drop, length: int
) -> None:
    """Linux takes names of up to 255 bytes: ``<name>.reason.json`` beside a 250-byte
    name would not fit, and the file used to stay in incoming/ for ever."""
    name = "b" * (length - len(".json")) + ".json"
    drop(name, b"not json")
    drop("good.json", submission())
    progress = drain(the_spool, stuck_after=5)
    assert (progress.applied, progress.quarantined) == (1, 1)
    assert incoming(the_spool) == []
    (moved,) = [n for n in failed(the_spool) if not n.endswith(".reason.json")]
    assert len(moved.encode()) + len(".reason.json") <= 255
    reason = json.loads((the_spool.failed / f"{moved}.reason.json").read_text())
    assert reason["file"] == name
    assert ReconciliationIssue.objects.get().subject == name


def test_a_file_that_cannot_be_moved_waits_with_its_reason_then_moves(
    db: None, the_spool: Spool, drop: Drop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """failed/ refusing the move (not writable, a full disk): the file stays, is tried
    again after a growing delay (not re-read at once, again and again), the stuck reason
    names the error, one issue is kept for it, and it moves once failed/ takes it."""
    drop("bad.json", b"not json")
    real = blobs.write_durably
    calls = 0

    def refuse(target: Path, data: bytes) -> None:
        nonlocal calls
        calls += 1
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(blobs, "write_durably", refuse)
    with pytest.raises(Stuck) as stuck:
        drain(the_spool, stuck_after=1.5)
    assert "bad.json: cannot move it to failed/" in str(stuck.value)
    assert "Permission denied" in str(stuck.value)
    assert calls <= 6, calls  # backed off: 0.2 s, 0.4 s, ... (it was about 10 a second)
    assert incoming(the_spool) == ["bad.json"]
    monkeypatch.setattr(blobs, "write_durably", real)
    drain(the_spool, stuck_after=5)
    assert failed(the_spool) == ["bad.json", "bad.json.reason.json"]
    assert ReconciliationIssue.objects.count() == 1  # the same file: its issue reused


# --- database errors: nothing moves, nothing acked, nothing deleted --------------------


def _refuse(entries: list[spool.Entry], using: str, *args: Any) -> spool.BatchResult:
    raise OperationalError("server closed the connection unexpectedly")


def test_a_database_error_on_flush_leaves_every_file_in_place_until_stuck(
    db: None, the_spool: Spool, drop: Drop, monkeypatch: pytest.MonkeyPatch
) -> None:
    drop("good.json", submission())
    drop("poison.json", b"{oops")
    before = {name: sha(the_spool.incoming / name) for name in incoming(the_spool)}
    calls: list[int] = []

    def refuse(entries: list[spool.Entry], using: str, *args: Any) -> spool.BatchResult:
        calls.append(len(entries))
        return _refuse(entries, using)

    monkeypatch.setattr(spool, "apply_batch", refuse)
    with pytest.raises(Stuck, match=r"stuck: 2 file\(s\) pending .*OperationalError: server"):
        drain(the_spool, stuck_after=1.0)

    assert len(calls) >= 3  # retried with backoff, not given up after one error
    # Even the poison file stays: its quarantine is part of the batch that failed.
    assert {name: sha(the_spool.incoming / name) for name in incoming(the_spool)} == before
    assert failed(the_spool) == []
    assert not IngestedSubmission.objects.exists()
    assert not Fact.objects.exists()
    assert not ReconciliationIssue.objects.exists()

    monkeypatch.setattr(spool, "apply_batch", apply_batch)  # the database is back
    progress = drain(the_spool, stuck_after=5)
    assert (progress.applied, progress.quarantined) == (1, 1)
    assert incoming(the_spool) == []


def test_an_error_after_the_facts_were_written_rolls_the_whole_batch_back(
    db: None, the_spool: Spool, drop: Drop, monkeypatch: pytest.MonkeyPatch
) -> None:
    drop("a.json", submission(lab="fresh-lab"))
    drop("poison.json", b"{oops")
    real_upsert = spool.upsert_facts
    failures = iter([True, True])

    def upsert_then_fail(rows: list[Any], using: str) -> None:
        real_upsert(rows, using)
        if next(failures, False):
            raise OperationalError("canceling statement due to lock timeout")

    monkeypatch.setattr(spool, "upsert_facts", upsert_then_fail)
    writer = Writer(the_spool)
    entries = [
        entry
        for name in incoming(the_spool)
        if (entry := read_entry(the_spool, name, Limits())) is not None
    ]
    for entry in entries:
        writer.add(entry)
    assert writer.flush() is False
    assert "lock timeout" in writer.last_error
    assert len(writer) == 2  # the batch is kept for the retry
    assert not Fact.objects.exists() and not Lab.objects.exists()
    assert not IngestedSubmission.objects.exists()
    assert not ReconciliationIssue.objects.exists()
    assert incoming(the_spool) == ["a.json", "poison.json"]
    assert failed(the_spool) == []

    progress = drain(the_spool, stuck_after=10)  # the second failure, then success
    assert (progress.applied, progress.quarantined) == (1, 1)
    assert Fact.objects.count() == 1


def test_an_unreadable_file_is_not_quarantined(
    db: None, the_spool: Spool, drop: Drop, monkeypatch: pytest.MonkeyPatch
) -> None:
    drop("a.json", submission(log_excerpt="some log"))

    def disk_full(data: bytes, base: Path | None = None) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(blobs, "store", disk_full)
    with pytest.raises(Stuck, match="No space left on device"):
        drain(the_spool, stuck_after=0.5)
    assert incoming(the_spool) == ["a.json"]
    assert failed(the_spool) == []
    assert not IngestedSubmission.objects.exists()


# --- crash between commit and unlink --------------------------------------------------


def test_after_a_crash_between_commit_and_unlink_the_next_scan_deletes_acked_files(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    drop("a.json", submission(facts=[{"entity": "run", "key": "a", "attributes": {"v": 1}}]))
    drop("b.json", submission(lab="lab-2"))
    drop("poison.json", b"nope")
    entries = [read_entry(the_spool, name, Limits()) for name in incoming(the_spool)]
    apply_batch([entry for entry in entries if entry is not None])  # committed; then "crash"
    assert incoming(the_spool) == ["a.json", "b.json", "poison.json"]
    acks = dict(IngestedSubmission.objects.values_list("hash", "applied_at"))
    assert len(acks) == 2

    progress = drain(the_spool, stuck_after=5)

    assert incoming(the_spool) == []
    assert failed(the_spool) == ["poison.json", "poison.json.reason.json"]
    assert (progress.applied, progress.duplicates, progress.quarantined) == (0, 2, 1)
    assert dict(IngestedSubmission.objects.values_list("hash", "applied_at")) == acks
    assert Fact.objects.count() == 2
    assert ReconciliationIssue.objects.count() == 1  # the issue is not recorded twice


# --- the blob store -------------------------------------------------------------------


def test_blobs_are_content_addressed_and_storing_twice_is_harmless(tmp_path: Path) -> None:
    base = tmp_path / "blobs"
    digest = blobs.store(b"excerpt", base)
    assert digest == hashlib.sha256(b"excerpt").hexdigest()
    path = blobs.path_for(digest, base)
    assert path == base / digest[:2] / digest[2:4] / digest
    assert blobs.store(b"excerpt", base) == digest
    assert blobs.read(digest, base) == b"excerpt"
    assert [p.name for p in path.parent.iterdir()] == [digest]  # no temporary files left
    with pytest.raises(ValueError):
        blobs.path_for("../../etc/passwd", base)


def test_an_excerpt_of_exactly_the_limit_is_accepted(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    drop("big.json", submission(log_excerpt="é" * (MIB // 2)))  # 1 MiB of UTF-8
    progress = drain(the_spool, stuck_after=10)
    assert progress.applied == 1
    assert len(blobs.read(IngestedSubmission.objects.get().log_excerpt)) == MIB


# --- the grace period ----------------------------------------------------------------


Later = Callable[[float], None]


@pytest.fixture
def later(monkeypatch: pytest.MonkeyPatch) -> Later:
    """Move the spool's wall clock ``seconds`` on: every file is that much older. (A file's
    age counts from its ctime, which no producer can set back: see test_copied_mtime.)"""

    def move(seconds: float) -> None:
        monkeypatch.setattr(spool, "wall_clock", lambda: time.time() + seconds)

    return move


def age(path: Path, seconds: float) -> None:
    """Set a file's mtime in the past, as cp -p or rsync -a would."""
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_a_file_older_than_the_grace_period_alerts_and_stays(
    db: None, the_spool: Spool, drop: Drop, settings: Any, later: Later
) -> None:
    settings.HOLDFAST_SPOOL_GRACE_SECONDS = 600
    drop("old.json", submission())
    drop("new.json", submission(lab="lab-2"))
    later(900)
    with pytest.raises(
        Overdue, match=r"incoming/\w+\.json has waited 9\d\d s.*grace period of 600 s"
    ):
        drain(the_spool, stuck_after=5)
    assert incoming(the_spool) == ["new.json", "old.json"] and failed(the_spool) == []
    assert not IngestedSubmission.objects.exists() and not Fact.objects.exists()

    assert drain(the_spool, stuck_after=5, grace=0).applied == 2, "grace 0: the check is off"
    assert incoming(the_spool) == []


def test_a_file_within_the_grace_period_applies(
    db: None, the_spool: Spool, drop: Drop, later: Later
) -> None:
    drop("a.json", submission())
    later(500)
    assert drain(the_spool, stuck_after=5, grace=600).applied == 1


def test_a_copied_old_mtime_is_not_an_old_file(
    db: None, the_spool: Spool, drop: Drop, settings: Any
) -> None:
    """cp -p / rsync -a keep the producer's mtime: two hours old, just arrived. The age
    counts from the arrival (ctime), so it applies and nothing alerts."""
    settings.HOLDFAST_SPOOL_GRACE_SECONDS = 3600
    age(drop("copied.json", submission()), 7200)
    assert the_spool.backlog()["stale"] is False
    assert (the_spool.age("copied.json") or 0) < 60
    assert drain(the_spool, stuck_after=5).applied == 1


def test_the_backlog_reports_the_oldest_file_and_whether_it_is_past_grace(
    the_spool: Spool, drop: Drop, later: Later
) -> None:
    empty = the_spool.backlog(grace=600)
    assert empty == {
        "pending": 0,
        "oldest_file": None,
        "oldest_age_s": None,
        "grace_s": 600,
        "stale": False,
    }
    drop("b.json", submission(lab="x"))
    time.sleep(0.02)  # a later ctime
    drop("a.json", submission())
    (the_spool.incoming / ".c.json.partial").write_text("{}")
    later(700)
    backlog = the_spool.backlog(grace=600)
    assert (backlog["pending"], backlog["oldest_file"], backlog["stale"]) == (2, "b.json", True)
    assert 699 <= backlog["oldest_age_s"] <= 720
    assert the_spool.backlog(grace=800)["stale"] is False
    assert the_spool.backlog(grace=0)["stale"] is False, "0: the check is off"


def test_queue_status_shows_the_spool_section(
    db: None, tmp_path: Path, settings: Any, later: Later
) -> None:
    from django.core.management import call_command

    settings.HOLDFAST_SPOOL_DIR = tmp_path / "spool"
    settings.HOLDFAST_SPOOL_GRACE_SECONDS = 60
    root = Spool.from_settings()
    root.ensure()
    (root.incoming / "late.json").write_text("{}")
    later(120)

    out = io.StringIO()
    call_command("queue_status", "--json", stdout=out)
    section = json.loads(out.getvalue())["spool"]
    assert (section["pending"], section["oldest_file"], section["grace_s"]) == (1, "late.json", 60)
    assert section["stale"] is True

    out = io.StringIO()
    call_command("queue_status", stdout=out)
    line = [ln for ln in out.getvalue().splitlines() if ln.startswith("spool:")]
    assert len(line) == 1 and "1 pending, oldest late.json waiting 12" in line[0]
    assert "(grace 60s)  OVERDUE" in line[0]


def test_health_flags_a_spool_past_its_grace_period(
    db: None, tmp_path: Path, settings: Any, later: Later
) -> None:
    from django.test import Client

    from ops import tokens

    settings.HOLDFAST_SPOOL_DIR = tmp_path / "spool"
    settings.HOLDFAST_SPOOL_GRACE_SECONDS = 60
    incoming_dir = tmp_path / "spool" / "incoming"
    incoming_dir.mkdir(parents=True)
    (incoming_dir / "a.json").write_text("{}")
    _, secret = tokens.create("reader", "read")
    headers = {"Authorization": f"Bearer {secret}"}

    def health() -> dict[str, Any]:
        response = Client().get("/internal/v1/health/", headers=headers)
        assert response.status_code == 503  # no live worker here (and later: overdue)
        return dict(response.json()["spool"])

    assert set(health()) == {"pending", "oldest_age_s"}, "within the grace period: as before"
    age(incoming_dir / "a.json", 7200)  # an old mtime (cp -p) is not an old file
    assert "stale" not in health()
    later(120)  # arrived two minutes ago
    spool_health = health()
    assert (spool_health["pending"], spool_health["stale"], spool_health["grace_s"]) == (
        1,
        True,
        60,
    )


# --- through the job engine -----------------------------------------------------------


def test_the_ingest_spool_job_drains_the_spool(
    run_worker: Callable[..., int], the_spool: Spool, drop: Drop
) -> None:
    drop("a.json", submission())
    drop("poison.json", b"[]")
    job = enqueue("ingestion.ingest_spool", {"spool": str(the_spool.root)})
    assert run_worker() == 1
    job = Job.objects.get(pk=job.pk)
    assert job.state == State.SUCCEEDED, job.last_error
    assert job.result["applied"] == 1
    assert job.result["quarantined"] == 1
    assert incoming(the_spool) == []


def test_the_ingest_spool_job_stops_when_its_lease_is_lost(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    """A drain whose lease is gone stops at once and leaves the files to the job's next
    holder: two ingesters on one spool raced for every file (duplicate quarantine issues,
    false ``spool_finish_failed`` errors) and the lost one drained on to the end."""
    drop("a.json", submission())
    lost = SimpleNamespace(cancel_requested=False, lease_lost=True)
    result = ingest_spool(lost, spool=str(the_spool.root))  # type: ignore[arg-type]
    assert result["applied"] == 0
    assert result["pending"] == 1
    assert incoming(the_spool) == ["a.json"]


def test_a_reason_left_by_a_crash_before_the_move_is_rewritten_not_orphaned(
    db: None, the_spool: Spool, drop: Drop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reason is written first, then the file moved: a crash between them leaves the
    reason alone in failed/. The retried quarantine puts the file beside it, under its own
    name, instead of taking that reason for someone else's and moving aside."""
    drop("bad.json", b"not json")
    real_rename = os.rename

    def crash(*args: Any, **kwargs: Any) -> None:
        raise SystemExit("crash between the reason and the move")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(SystemExit):
        drain(the_spool, stuck_after=5)
    assert failed(the_spool) == ["bad.json.reason.json"]
    monkeypatch.setattr(os, "rename", real_rename)
    drain(the_spool, stuck_after=5)
    assert failed(the_spool) == ["bad.json", "bad.json.reason.json"]
    assert ReconciliationIssue.objects.count() == 1


def test_a_large_reason_left_by_a_crash_is_still_known_as_this_quarantines(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    """A reason quoting many long errors (non-ASCII escaped) passes 64 KiB: it is read
    whole, so it is still this quarantine's, not a name taken by someone else."""
    drop("bad.json", b"not json")
    entry = read_entry(the_spool, "bad.json", Limits())
    assert entry is not None
    reason = spool.reason_of(entry, 7)
    reason["errors"] = ["\U0001f600" * 400] * 60  # about 186 KB once escaped
    path = the_spool.failed / "bad.json.reason.json"
    path.write_text(json.dumps(reason, indent=2))
    assert path.stat().st_size > 64 * 1024
    assert spool.own_reason(path, entry, 7)
    assert not spool.own_reason(path, entry, 8)


def test_a_fifo_where_a_reason_would_go_is_never_opened_for_reading(
    db: None, the_spool: Spool, drop: Drop
) -> None:
    os.mkfifo(the_spool.failed / "x.json.reason.json")  # a FIFO submission, quarantined
    drop("x.json", b"not json")
    drain(the_spool, stuck_after=5)  # would hang on opening the FIFO
    assert "x.json.reason.json" in failed(the_spool)
    assert any(
        name.startswith("x.")
        and name.endswith(".json.reason.json")
        and name != "x.json.reason.json"
        for name in failed(the_spool)
    )


def test_a_batch_transaction_is_ended_by_the_server_if_its_process_freezes(
    transactional_db: None, the_spool: Spool, drop: Drop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: an ingester frozen inside its batch (a paused VM, a stopped process
    group) held its row locks for ever, and another ingester of the same facts was stuck
    on them at every run (helper-27 #3). Its batch sets the idle limit the scheduler's
    slots and handler blocks set, local to the transaction."""
    from django.db import connection

    from ingestion import spool

    if connection.vendor != "postgresql":
        pytest.skip("SQLite: workers and the scheduler kill a frozen holder of the lock")
    seen: list[str] = []

    def look() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SHOW idle_in_transaction_session_timeout")
            seen.append(cursor.fetchone()[0])

    monkeypatch.setitem(spool.FAULTS, "db_error", look)
    drop("a.json", submission())
    entries = [read_entry(the_spool, name, Limits()) for name in incoming(the_spool)]
    apply_batch([entry for entry in entries if entry is not None])
    assert seen == ["10s"]
    with connection.cursor() as cursor:  # local to the batch's transaction
        cursor.execute("SHOW idle_in_transaction_session_timeout")
        assert cursor.fetchone()[0] != "10s"
