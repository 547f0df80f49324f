"""The settings for running behind a transaction-mode pooler (config/settings.py):
``HOLDFAST_PREPARED_STATEMENTS=off`` leaves nothing that keeps server-session state, and
``HOLDFAST_LISTEN_DATABASE_URL`` names the direct connection for LISTEN."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

READ = """
import json
from config import settings as s
db = s.DATABASES["default"]
print(json.dumps({
    "prepared": s.HOLDFAST_PREPARED_STATEMENTS,
    "threshold": db["OPTIONS"].get("prepare_threshold", "unset"),
    "no_server_cursors": db.get("DISABLE_SERVER_SIDE_CURSORS", False),
    "listen": s.HOLDFAST_LISTEN_DATABASE and {
        k: s.HOLDFAST_LISTEN_DATABASE[k] for k in ("NAME", "HOST", "PORT")},
    "retention": s.HOLDFAST_WORKER_RETENTION_SECONDS,
}))
"""


def settings_with(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {
        **{k: v for k, v in os.environ.items() if not k.startswith("HOLDFAST_")},
        "HOLDFAST_VAR_DIR": str(tmp_path),
        "DATABASE_URL": "postgres://holdfast@pgbouncer:6432/holdfast",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-c", READ], cwd=REPO, env=environ, capture_output=True, text=True
    )


def test_prepared_statements_off_leaves_no_session_state(tmp_path: Path) -> None:
    done = settings_with(
        tmp_path,
        HOLDFAST_PREPARED_STATEMENTS="off",
        HOLDFAST_LISTEN_DATABASE_URL="postgres://holdfast@db-primary:5432/holdfast",
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "prepared": False,
        "threshold": None,
        "no_server_cursors": True,
        "listen": {"NAME": "holdfast", "HOST": "db-primary", "PORT": 5432},
        "retention": 7 * 86400,
    }


def test_the_defaults_prepare_and_listen_on_database_url(tmp_path: Path) -> None:
    done = settings_with(tmp_path, HOLDFAST_WORKER_RETENTION_SECONDS="3600")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert (figures["prepared"], figures["no_server_cursors"], figures["listen"]) == (
        True,
        False,
        None,
    )
    assert figures["retention"] == 3600


def test_a_bad_switch_is_refused(tmp_path: Path) -> None:
    done = settings_with(tmp_path, HOLDFAST_PREPARED_STATEMENTS="sometimes")
    assert done.returncode != 0
    assert "HOLDFAST_PREPARED_STATEMENTS must be 1/true/yes/on or 0/false/no/off" in done.stderr
