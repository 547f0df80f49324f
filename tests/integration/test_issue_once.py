"""One open reconciliation issue per condition (``issue_open_once``), also when two
processes record it at once; open duplicates an older release left are resolved by the
migration that adds the index, the oldest kept."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction

from ingestion.models import IssueKind, ReconciliationIssue
from ingestion.reconciliation import record, record_unless_open

pytestmark = pytest.mark.django_db(transaction=True)

URL = "https://example.org/x"


def open_issues(kind: str = IssueKind.GONE_AT_SOURCE) -> list[tuple[int, dict]]:
    found = ReconciliationIssue.objects.filter(kind=kind, subject=URL, status="open")
    return list(found.order_by("pk").values_list("pk", "details"))


def test_the_database_refuses_a_second_open_issue_of_a_condition():
    record(IssueKind.GONE_AT_SOURCE, URL, "src")
    with pytest.raises(IntegrityError), transaction.atomic():
        record(IssueKind.GONE_AT_SOURCE, URL, "src")
    record(IssueKind.GONE_AT_SOURCE, URL, "other-source")  # another condition
    ReconciliationIssue.objects.update(status="resolved")
    record(IssueKind.GONE_AT_SOURCE, URL, "src")  # it came back: a new issue
    # A file quarantined again under its name is a new issue by design.
    record(IssueKind.QUARANTINED_SUBMISSION, URL)
    record(IssueKind.QUARANTINED_SUBMISSION, URL)
    assert len(open_issues(IssueKind.QUARANTINED_SUBMISSION)) == 2


@pytest.mark.postgres
def test_two_processes_recording_one_condition_at_once_open_one_issue():
    """A inserts and holds its transaction; B checks (sees nothing committed) and inserts,
    waiting on A's index entry; A commits; B's insert is refused and B's transaction goes
    on. Before the index both committed an open issue (audit)."""
    a_inserted, a_may_commit = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def caller(name: str) -> None:
        try:
            with transaction.atomic():
                if name == "B":
                    a_inserted.wait(10)
                issue = record_unless_open(IssueKind.GONE_AT_SOURCE, URL, "src", {"who": name})
                results[name] = None if issue is None else issue.pk
                if name == "A":
                    a_inserted.set()
                    a_may_commit.wait(10)
                results[name + " went on"] = ReconciliationIssue.objects.count() >= 0
        except BaseException as exc:  # reported below, not lost in the thread
            results[name] = exc
        finally:
            connection.close()

    a = threading.Thread(target=caller, args=("A",))
    b = threading.Thread(target=caller, args=("B",))
    a.start()
    b.start()
    assert a_inserted.wait(10)
    threading.Timer(1.0, a_may_commit.set).start()  # B is blocked on A's entry by then
    a.join(20)
    b.join(20)
    rows = open_issues()
    assert [details["who"] for _, details in rows] == ["A"], results
    assert results["A"] == rows[0][0] and results["B"] is None
    assert results["B went on"] is True


@pytest.fixture
def migrated_forward() -> Iterator[None]:
    yield
    call_command("migrate", "ingestion", verbosity=0)


def test_the_migration_resolves_open_duplicates_keeping_the_oldest(migrated_forward):
    call_command("migrate", "ingestion", "0007_i14_sources_hardening", verbosity=0)
    for who in ("first", "second", "third"):
        ReconciliationIssue.objects.create(
            kind=IssueKind.GONE_AT_SOURCE, source="src", subject=URL, details={"who": who}
        )
    for _ in range(2):  # quarantines are left alone
        ReconciliationIssue.objects.create(kind=IssueKind.QUARANTINED_SUBMISSION, subject=URL)
    call_command("migrate", "ingestion", verbosity=0)
    assert [details["who"] for _, details in open_issues()] == ["first"]
    first = open_issues()[0][0]
    resolved = ReconciliationIssue.objects.filter(kind=IssueKind.GONE_AT_SOURCE, status="resolved")
    assert {(issue.resolved_by, issue.comment) for issue in resolved} == {
        ("holdfast", f"a duplicate of issue {first}, still open")
    }
    assert len(open_issues(IssueKind.QUARANTINED_SUBMISSION)) == 2
