"""A worker whose database is unreachable: it waits (logging, with backoff) instead of
dying, and a SIGTERM still stops it promptly (DESIGN §3, §8)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.support.pgcluster import free_port
from tests.support.workers import WorkerPool

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


def unreachable_env(tmp_path: Path) -> dict[str, str]:
    """A PostgreSQL URL where nothing listens: every connection is refused."""
    env = dict(os.environ)
    env.pop("TEST_DATABASE_URL", None)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DATABASE_URL=f"postgres://postgres@127.0.0.1:{free_port()}/holdfast",
        HOLDFAST_VAR_DIR=str(tmp_path / "var"),
        LOG_FORMAT="json",
        HOLDFAST_POLL_SECONDS="0.2",
        HOLDFAST_RECLAIM_SECONDS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def test_sigterm_stops_a_worker_that_never_reached_its_database(tmp_path: Path) -> None:
    with WorkerPool(unreachable_env(tmp_path), tmp_path / "logs") as pool:
        worker = pool.start("orphan", wait_started=False)
        worker.wait_for_event("database_unavailable", timeout=20)
        time.sleep(1.0)  # a second retry round: the backoff has grown past the first step
        assert worker.alive, worker.describe()  # it waits for the database, it does not die

        sent = time.monotonic()
        worker.terminate()
        code = worker.wait_exit(timeout=6)
        elapsed = time.monotonic() - sent
        assert code == 0, worker.describe()
        assert elapsed < 3, f"took {elapsed:.1f} s to stop\n{worker.describe()}"
        assert worker.events("worker_stopping", signal="SIGTERM")
