"""Fixtures shared by every test layer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from django.conf import settings

from jobs.worker import WorkerProcess

REPO = Path(__file__).resolve().parent.parent


def on_postgres() -> bool:
    return settings.DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if on_postgres():
        return
    skip = pytest.mark.skip(reason="PostgreSQL only; scripts/test.sh also runs the suite there")
    for item in items:
        if "postgres" in item.keywords:
            item.add_marker(skip)


def database_url(settings_dict: dict) -> str:
    """A DATABASE_URL naming the database the tests use (the test database)."""
    if settings_dict["ENGINE"] == "django.db.backends.sqlite3":
        return f"sqlite:///{Path(settings_dict['NAME']).resolve()}"
    user = quote(settings_dict.get("USER") or "postgres")
    password = settings_dict.get("PASSWORD")
    auth = f"{user}:{quote(password)}" if password else user
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or 5432
    return f"postgres://{auth}@{host}:{port}/{settings_dict['NAME']}"


def subprocess_env(database: str, tmp_path: Path) -> dict[str, str]:
    """Environment for a subprocess (worker or command) using ``database`` (a URL).

    Short poll and reclaim intervals keep the process tests fast; JSON logs let them read
    the events a process wrote.
    """
    env = dict(os.environ)
    env.pop("TEST_DATABASE_URL", None)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DATABASE_URL=database,
        HOLDFAST_VAR_DIR=str(tmp_path / "var"),
        LOG_FORMAT="json",
        LOG_LEVEL="INFO",
        HOLDFAST_POLL_SECONDS="0.2",
        HOLDFAST_RECLAIM_SECONDS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture
def worker_env(tmp_path: Path, transactional_db: None) -> dict[str, str]:
    """Environment for a subprocess using the test database."""
    from django.db import connection

    return subprocess_env(database_url(connection.settings_dict), tmp_path)


@pytest.fixture
def run_worker(transactional_db: None) -> Iterator[object]:
    """Run an in-process burst worker until nothing is runnable; returns jobs processed.

    The worker's lease keeper thread has its own connection, so the test's rows must be
    committed: this fixture implies ``transactional_db``.
    """

    def run(**kwargs: object) -> int:
        worker = WorkerProcess(burst=True, poll_seconds=0.05, **kwargs)  # type: ignore[arg-type]
        worker.run()
        return worker.processed

    yield run


@pytest.fixture
def blob_dir(settings: Any, tmp_path: Path) -> Path:  # pytest-django's settings fixture
    """A blob store of the test's own (HOLDFAST_BLOB_DIR), so no test sees another's blobs."""
    settings.HOLDFAST_BLOB_DIR = tmp_path / "blobs"
    return settings.HOLDFAST_BLOB_DIR
