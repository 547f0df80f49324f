"""The ``jobs`` app in a project of its own (docs/django-tasks.md, "In another project"):
settings with none of Holdfast's, and every command a user of the app runs works on the
engine's defaults (``jobs.defaults``). ``runscheduler`` died with a traceback there
(``HOLDFAST_RETAIN_SUCCEEDED`` had no default), and ``runworker --with-scheduler`` logged
``background_step_failed`` twice a second.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import on_postgres

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(on_postgres(), reason="its own SQLite file: once is enough"),
]

REPO = Path(__file__).resolve().parents[2]

SETTINGS = """
SECRET_KEY = "x" * 50
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "shop", "jobs"]
DATABASES = {{"default": {{
    "ENGINE": "django.db.backends.sqlite3",
    "NAME": {db!r},
    "OPTIONS": {{"transaction_mode": "IMMEDIATE", "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"}},
}}}}
TASKS = {{"default": {{"BACKEND": "jobs.tasks_backend.HoldfastBackend"}}}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
"""

TASKS = """
from django.tasks import task


@task
def send_receipt(order_id: int) -> str:
    return f"sent {order_id}"
"""


def test_the_jobs_app_runs_in_a_project_without_holdfasts_settings(tmp_path: Path) -> None:
    (tmp_path / "shop").mkdir()
    (tmp_path / "shop" / "__init__.py").write_text("")
    (tmp_path / "shop" / "tasks.py").write_text(TASKS)
    (tmp_path / "shopsettings.py").write_text(SETTINGS.format(db=str(tmp_path / "db.sqlite3")))
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("HOLDFAST_", "DJANGO_", "DATABASE_URL", "LOG_"))
    }
    env.update(
        PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}",
        DJANGO_SETTINGS_MODULE="shopsettings",
        LOG_FORMAT="json",
    )

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "django", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr, done.stderr
        return done

    run("migrate", "-v", "0")
    run("shell", "-c", "from shop.tasks import send_receipt; send_receipt.enqueue(7)")
    run("runscheduler", "--once")  # the retention pass reads its defaults
    worked = run("runworker", "--burst", "--with-scheduler")
    assert "background_step_failed" not in worked.stderr, worked.stderr
    assert '"job_succeeded"' in worked.stderr, worked.stderr
