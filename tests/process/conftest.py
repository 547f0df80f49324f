"""Fixtures for tests that run real worker processes (``manage.py runworker``).

The test process enqueues committed jobs (``transactional_db``) and reads results through
the ORM; the workers are subprocesses on the same test database (``worker_env``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import call_command

from tests.support.workers import WorkerPool


@pytest.fixture
def workers(worker_env: dict[str, str], tmp_path: Path) -> Iterator[WorkerPool]:
    """A pool of worker subprocesses on the test database; all killed at teardown.

    Teardown runs before ``transactional_db`` flushes the tables, so no worker is left
    holding a lock (or a SIGSTOPped connection) when it does.
    """
    pool = WorkerPool(worker_env, tmp_path / "logs")
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def migrated_forward(transactional_db: None) -> Iterator[None]:
    """Whatever a migration test left, later tests see every migration applied."""
    yield
    call_command("migrate", "jobs", verbosity=0)
