"""The spool ingester on its own database alias (``HOLDFAST_INGESTER_DATABASE_URL``), run
as operators run it: every database access goes through the alias, and on PostgreSQL a
login role granted by :mod:`ingestion.grants` is enough to ingest, and is refused the rest.

The ``default`` database of the command is made unusable (a database that does not
exist), so any access that bypassed the alias would fail the run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from ingestion.grants import grant_ingester
from ingestion.models import Fact, IngestedSubmission, Lab, ReconciliationIssue
from tests.conftest import database_url
from tests.support.workers import CommandResult, WorkerPool

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

GOOD = {
    "schema": "holdfast.submission/v1",
    "lab": "lab-alias",
    "submitted_at": "2026-11-30T10:00:00Z",
    "facts": [{"entity": "run", "key": "run-1", "attributes": {"status": "passed"}}],
}


@pytest.fixture
def pool(worker_env: dict[str, str], tmp_path: Path) -> Iterator[WorkerPool]:
    workers = WorkerPool(worker_env, tmp_path / "logs")
    try:
        yield workers
    finally:
        workers.close()


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    """A spool holding one good submission and one that is not JSON."""
    root = tmp_path / "spool"
    (root / "incoming").mkdir(parents=True)
    (root / "incoming" / "good.json").write_text(json.dumps(GOOD))
    (root / "incoming" / "poison.json").write_text("{not json")
    return root


def unusable_default(tmp_path: Path) -> str:
    """A DATABASE_URL that fails on first use: the run must never need ``default``."""
    if connection.vendor == "sqlite":
        return f"sqlite:///{tmp_path / 'no-such-dir' / 'default.sqlite3'}"
    settings = {**connection.settings_dict, "NAME": "holdfast_no_such_database"}
    return database_url(settings)


def ingest(pool: WorkerPool, spool: Path, tmp_path: Path, ingester_url: str) -> CommandResult:
    return pool.command(
        "ingest_submissions",
        "--spool",
        str(spool),
        "--once",
        "--json",
        env={
            "DATABASE_URL": unusable_default(tmp_path),
            "HOLDFAST_INGESTER_DATABASE_URL": ingester_url,
        },
        timeout=60,
    )


def assert_ingested(result: CommandResult, spool: Path) -> None:
    assert result.returncode == 0, result.describe()
    figures: dict[str, Any] = result.json()
    assert (figures["applied"], figures["quarantined"]) == (1, 1), result.describe()
    assert list((spool / "incoming").iterdir()) == []
    assert (spool / "failed" / "poison.json").exists()
    lab = Lab.objects.get(name="lab-alias")
    assert Fact.objects.get(lab=lab, key="run-1").attributes == {"status": "passed"}
    assert IngestedSubmission.objects.get().file_name == "good.json"
    assert ReconciliationIssue.objects.get().subject == "poison.json"


def test_every_database_access_of_the_ingester_goes_through_its_alias(
    pool: WorkerPool, spool: Path, tmp_path: Path
) -> None:
    result = ingest(pool, spool, tmp_path, database_url(connection.settings_dict))
    assert_ingested(result, spool)


def test_without_the_alias_an_unusable_default_stops_the_run(
    pool: WorkerPool, spool: Path, tmp_path: Path
) -> None:
    """The counter-check of the test above: the broken default really is broken."""
    result = pool.command(
        "ingest_submissions",
        "--spool",
        str(spool),
        "--once",
        "--stuck-after",
        "3",
        env={"DATABASE_URL": unusable_default(tmp_path)},
        timeout=60,
    )
    assert result.returncode == 1, result.describe()
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in (spool / "incoming").iterdir()) == ["good.json", "poison.json"]


# --- PostgreSQL: a login role with the ingester's grants, and nothing more -------------


@pytest.fixture
def ingester_role(transactional_db: None) -> Iterator[str]:
    """A login role (unique to this run: roles are shared by the whole server) granted the
    ingester's privileges on the test database; dropped afterwards."""
    role = f"holdfast_ingest_test_{os.getpid()}"
    with connection.cursor() as cursor:
        cursor.execute(f"DROP ROLE IF EXISTS {role}")
        cursor.execute(f"CREATE ROLE {role} LOGIN")
    try:
        grant_ingester(connection, role)
        yield role
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP OWNED BY {role}")
            cursor.execute(f"DROP ROLE {role}")


@pytest.mark.postgres
def test_the_ingester_role_ingests_through_the_alias_and_is_refused_the_job_tables(
    pool: WorkerPool, spool: Path, tmp_path: Path, ingester_role: str
) -> None:
    as_role = database_url({**connection.settings_dict, "USER": ingester_role, "PASSWORD": ""})
    result = ingest(pool, spool, tmp_path, as_role)
    assert_ingested(result, spool)

    with psycopg.connect(as_role, autocommit=True) as conn:
        assert conn.execute("SELECT current_user").fetchone() == (ingester_role,)
        for statement in (
            "SELECT count(*) FROM jobs_job",
            "DELETE FROM facts",
            "UPDATE ingested_submissions SET file_name = 'x'",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
