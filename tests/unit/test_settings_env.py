"""The environment readers of config/settings.py: a value Holdfast cannot use is refused
(ImproperlyConfigured: one line and exit 2 from every command), never guessed."""

from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from config.settings import env_bool, env_duration, env_number


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_a_number_setting_must_be_finite(monkeypatch, value):
    monkeypatch.setenv("HOLDFAST_POLL_SECONDS", value)
    with pytest.raises(ImproperlyConfigured, match="HOLDFAST_POLL_SECONDS must be a finite"):
        env_number("HOLDFAST_POLL_SECONDS", 1)


@pytest.mark.parametrize("value", ["0", "0.05"])
def test_the_refresh_interval_is_refused_below_a_schedules_shortest(monkeypatch, value):
    """0 was accepted here, then refused by the scheduler's start as "schedule
    'holdfast.refresh': 'every' must be …", naming no variable (audit)."""
    monkeypatch.setenv("HOLDFAST_REFRESH_SECONDS", value)
    with pytest.raises(ImproperlyConfigured, match="HOLDFAST_REFRESH_SECONDS must be at least"):
        env_number("HOLDFAST_REFRESH_SECONDS", 300, minimum=0.1)


def test_the_refresh_settings_minimum_is_the_schedules():
    from jobs.options import MIN_EVERY

    source = (Path(__file__).parents[2] / "config" / "settings.py").read_text()
    assert f'env_number("HOLDFAST_REFRESH_SECONDS", 300, minimum={MIN_EVERY:g})' in source


@pytest.mark.parametrize("value", ["ture", "maybe", "2", "enabled"])
def test_a_flag_with_an_unknown_word_is_refused(monkeypatch, value):
    monkeypatch.setenv("HOLDFAST_BEHIND_TLS_PROXY", value)
    with pytest.raises(ImproperlyConfigured, match="HOLDFAST_BEHIND_TLS_PROXY must be"):
        env_bool("HOLDFAST_BEHIND_TLS_PROXY")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("Yes", True), (" on ", True), ("0", False), ("off", False), ("", None)],
)
def test_flags_read_the_usual_words(monkeypatch, value, expected):
    monkeypatch.setenv("DJANGO_DEBUG", value)
    default = object()
    assert env_bool("DJANGO_DEBUG", default) is (default if expected is None else expected)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name",
    ["HOLDFAST_WORKER_RETENTION_SECONDS", "HOLDFAST_SPOOL_GRACE_SECONDS", "HOLDFAST_X_SECONDS"],
)
def test_a_seconds_setting_is_at_most_a_century(monkeypatch, name):
    """1e308 is finite, but no timedelta or wait holds it: refused at start, not an
    OverflowError every pass of the worker's housekeeping."""
    monkeypatch.setenv(name, "1e308")
    with pytest.raises(ImproperlyConfigured, match=f"{name} must be at most 3.1536e\\+09"):
        env_number(name, 1)
    monkeypatch.setenv(name, str(100 * 365 * 86400))
    assert env_number(name, 1) == 100 * 365 * 86400


@pytest.mark.parametrize("value", ["1000000d", "3000000d", "5300w"])
def test_a_retention_longer_than_a_century_is_refused(monkeypatch, value):
    """Its cut-off would fall before year 1: a database error on every retention pass."""
    monkeypatch.setenv("HOLDFAST_RETAIN_DEAD", value)
    with pytest.raises(ImproperlyConfigured, match=r"HOLDFAST_RETAIN_DEAD: .* is too long"):
        env_duration("HOLDFAST_RETAIN_DEAD", "90d")


@pytest.mark.parametrize("value", ["0s", "0d", "0.0h"])
def test_a_retention_of_zero_is_refused(monkeypatch, value):
    """It deleted every job of that state at the next pass, seconds after it finished,
    before anyone could look at it (audit)."""
    monkeypatch.setenv("HOLDFAST_RETAIN_DEAD", value)
    with pytest.raises(ImproperlyConfigured, match="HOLDFAST_RETAIN_DEAD must be longer than 0"):
        env_duration("HOLDFAST_RETAIN_DEAD", "90d")


def test_the_spool_grace_is_read_from_the_environment(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HOLDFAST_SPOOL_GRACE_SECONDS": "12", "HOLDFAST_VAR_DIR": str(tmp_path)}
    read = subprocess.run(
        [
            sys.executable,
            "-c",
            "import config.settings as s; print(s.HOLDFAST_SPOOL_GRACE_SECONDS)",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert read.stdout.strip() == "12.0"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/srv/holdfast/manage.py", "runworker", "--lanes", "media"], "holdfast runworker"),
        (["manage.py", "runscheduler"], "holdfast runscheduler"),
        (["/venv/bin/gunicorn", "ops.wsgi"], "holdfast"),
        (["manage.py", "--version"], "holdfast"),
    ],
)
def test_connections_name_their_command_in_pg_stat_activity(monkeypatch, argv, expected):
    """docs/operations.md counts a fleet's connections by ``application_name``, which no
    process set unless the operator exported PGAPPNAME."""
    from config.settings import application_name

    monkeypatch.delenv("PGAPPNAME", raising=False)
    assert application_name(argv) == expected
    monkeypatch.setenv("PGAPPNAME", "worker-7")
    assert application_name(argv) == "worker-7"
