"""The edges of every command, in real processes: bad configuration is one line and exit 2,
Django's venv hint survives, a closed pipe ends a command quietly, and ``manage.py check``
on a clean start reports the Tasks backend's checks (holdfast.E010-E012)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import enqueueing
from tests.conftest import REPO, on_postgres, subprocess_env

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

MANAGE = str(REPO / "manage.py")


def start(argv: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=kwargs.pop("stdout", subprocess.PIPE),
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=60)
    return process.returncode, out or "", err


def test_bad_configuration_is_one_line_and_exit_2(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    base = subprocess_env("", tmp_path)
    base.pop("DATABASE_URL")
    base["DJANGO_SETTINGS_MODULE"] = "config.settings"
    cases = {
        "HOLDFAST_LEASE_SECONDS": ("abc", "HOLDFAST_LEASE_SECONDS"),
        "LOG_FORMAT": ("xml", "LOG_FORMAT"),
        "DATABASE_URL": ("mysql://user@db.example/holdfast", "DATABASE_URL"),
        "HOLDFAST_VAR_DIR": (str(a_file / "var"), "HOLDFAST_VAR_DIR"),
        # Accepted once, then failing at run time: an OverflowError every pass, a database
        # error from a cut-off before year 1.
        "HOLDFAST_WORKER_RETENTION_SECONDS": ("1e308", "HOLDFAST_WORKER_RETENTION_SECONDS"),
        "HOLDFAST_RETAIN_DEAD": ("3000000d", "HOLDFAST_RETAIN_DEAD"),
        "HOLDFAST_SPOOL_GRACE_SECONDS": ("-1", "HOLDFAST_SPOOL_GRACE_SECONDS"),
    }
    commands = [["queue_status"], ["runworker", "--burst"], ["migrate"]]
    running = []
    for variable, (value, named) in cases.items():
        for command in commands:
            env = {**base, variable: value}
            running.append((variable, named, start([sys.executable, MANAGE, *command], env)))
    for variable, named, process in running:
        code, out, err = finish(process)
        assert code == 2, (variable, process.args, err)
        assert len(err.strip().splitlines()) == 1, (variable, err)
        assert err.startswith("configuration error: ") and named in err, err
        assert "Traceback" not in err and out == ""


def test_manage_py_without_django_keeps_the_venv_hint(tmp_path: Path) -> None:
    # -S: no site-packages, as a python outside the venv would be.
    code, _, err = finish(start([sys.executable, "-S", MANAGE, "check"], dict(os.environ)))
    assert code == 1
    assert "Did you forget to activate a virtual environment?" in err


def test_bad_spool_paths_are_exit_2_in_one_line(worker_env: dict[str, str], tmp_path: Path):
    a_file = tmp_path / "spool-file"
    a_file.write_text("")
    running = [
        (
            what,
            start(
                [sys.executable, MANAGE, "ingest_submissions", "--once", "--spool", str(path)],
                worker_env,
            ),
        )
        for what, path in (("does not exist", tmp_path / "missing"), ("not a dir", a_file))
    ]
    # The setting naming a file: the same one line, naming the setting.
    setting = start(
        [sys.executable, MANAGE, "ingest_submissions", "--once"],
        {**worker_env, "HOLDFAST_SPOOL_DIR": str(a_file)},
    )
    for what, process in running:
        code, _, err = finish(process)
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1 and "--spool" in err, err
        assert what.split()[-1] in err
    code, _, err = finish(setting)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "HOLDFAST_SPOOL_DIR" in err and "Not a directory" in err, err


def test_django_commands_against_a_server_that_is_down_say_so_in_one_line(
    tmp_path: Path,
) -> None:
    """migrate, showmigrations and the like are Django's own, not JobsCommand: a database
    that does not answer was a page of traceback; now one line and exit 1."""
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = subprocess_env("", tmp_path)
    env["DATABASE_URL"] = f"postgres://postgres@127.0.0.1:{port}/nowhere"
    env["DJANGO_SETTINGS_MODULE"] = "config.settings"
    running = [
        start([sys.executable, MANAGE, *command], env)
        for command in (["migrate"], ["showmigrations"])
    ]
    for process in running:
        code, _, err = finish(process)
        assert code == 1, (process.args, err)
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith("database error: ") and str(port) in err, err
        assert "Traceback" not in err


def test_a_closed_pipe_ends_a_command_quietly(worker_env: dict[str, str]) -> None:
    job = enqueueing.enqueue("test.echo")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (`| head`) is gone before anything is written
    try:
        process = start(
            [sys.executable, MANAGE, "show_job", str(job.pk)], worker_env, stdout=write_end
        )
    finally:
        os.close(write_end)
    code, _, err = finish(process)
    assert code == 141, err
    assert err == "", err


def test_check_reports_the_tasks_backend_checks_on_a_clean_start(tmp_path: Path) -> None:
    (tmp_path / "bad_tasks.py").write_text(
        "from tests.settings import *  # noqa\n"
        "TASKS = {'default': {'BACKEND': 'jobs.tasks_backend.HoldfastBackend',\n"
        "                     'QUEUES': ['nowhere'], 'OPTIONS': {'max_attempts': 0}}}\n"
    )
    (tmp_path / "no_jobs.py").write_text(
        "from config.settings import *  # noqa\n"
        "INSTALLED_APPS = ['django.contrib.contenttypes', 'django.contrib.auth',\n"
        "                  'rest_framework', 'ops']\n"
        "ROOT_URLCONF = 'no_urls'\n"
    )
    (tmp_path / "no_urls.py").write_text("urlpatterns = []\n")
    env = subprocess_env("", tmp_path)
    env.pop("DATABASE_URL")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
    bad = start([sys.executable, MANAGE, "check"], {**env, "DJANGO_SETTINGS_MODULE": "bad_tasks"})
    missing = start([sys.executable, MANAGE, "check"], {**env, "DJANGO_SETTINGS_MODULE": "no_jobs"})
    code, _, err = finish(bad)
    assert code == 1 and "holdfast.E011" in err and "holdfast.E012" in err, err
    code, _, err = finish(missing)
    assert code == 1 and "holdfast.E010" in err, err


def test_check_deploy_is_clean_in_the_documented_production_environment(tmp_path: Path):
    """deploy/systemd/holdfast.env.example, with a real key, passes `check --deploy`."""
    import secrets

    env = {key: value for key, value in os.environ.items() if not key.startswith("DJANGO_")}
    env.pop("DATABASE_URL", None)
    for line in (REPO / "deploy" / "systemd" / "holdfast.env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    env.update(
        DJANGO_SETTINGS_MODULE="config.settings",
        DJANGO_SECRET_KEY=secrets.token_urlsafe(50),
        HOLDFAST_VAR_DIR=str(tmp_path / "var"),
        HOLDFAST_SPOOL_DIR=str(tmp_path / "var" / "spool"),
        HOLDFAST_BLOB_DIR=str(tmp_path / "var" / "blobs"),
    )
    assert env["HOLDFAST_BEHIND_TLS_PROXY"] == "1" and env["DJANGO_DEBUG"] == "0"
    code, out, err = finish(start([sys.executable, MANAGE, "check", "--deploy"], env))
    assert code == 0, err
    assert "System check identified no issues" in out + err, out + err


@pytest.mark.skipif(on_postgres(), reason="its own SQLite file: once is enough")
def test_a_worker_or_scheduler_on_a_database_not_migrated_for_it_says_so(tmp_path: Path) -> None:
    """Started before ``manage.py migrate`` (the deploy's steps out of order), a worker
    met "no such column" on every step and logged ``database_unavailable`` for ever, as
    if the database were down."""
    env = subprocess_env("", tmp_path)
    env.pop("DATABASE_URL")
    env["HOLDFAST_VAR_DIR"] = str(tmp_path / "var")
    migrate = subprocess.run(
        [sys.executable, MANAGE, "migrate", "jobs", "0002", "-v", "0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert migrate.returncode == 0, migrate.stderr
    for command in (["runworker", "--burst"], ["runscheduler", "--once"]):
        code, _, err = finish(start([sys.executable, MANAGE, *command], env))
        assert code == 1, err
        assert "not migrated for this code" in err and "jobs.0003" in err, err
        assert "run manage.py migrate first" in err and "Traceback" not in err, err
