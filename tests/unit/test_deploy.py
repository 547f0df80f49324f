"""What deploy/ ships: the Prometheus rules pass promtool (syntax and their unit tests), the
Grafana dashboard's queries parse and name only exported metrics, and the systemd units
are valid and stop workers gracefully within the shutdown grace."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import get_commands

from ops.metrics import METRIC_NAMES
from tests.conftest import REPO

DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "holdfast-rules.yml"
DASHBOARD = DEPLOY / "grafana" / "holdfast-dashboard.json"
UNITS = DEPLOY / "systemd"
METRIC = re.compile(r"\bholdfast_[a-z_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def tool(name: str) -> str:
    """The path of ``name``; CI installs promtool (.ci/run), elsewhere it may be missing."""
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI") and name == "promtool":
            pytest.fail("promtool is missing on CI: .ci/run installs the prometheus package")
        pytest.skip(f"{name} is not installed (apt-get install prometheus)")
    return found


def exported(name: str) -> bool:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in METRIC_NAMES:
            return True
    return name in METRIC_NAMES


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_the_rules_and_their_unit_tests_pass_promtool():
    promtool = tool("promtool")
    checked = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [promtool, "test", "rules", "holdfast-rules.test.yml"],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_rules_alert_on_what_the_issue_asks_and_name_only_exported_metrics():
    text = RULES.read_text()
    alerts = set(re.findall(r"alert: (\w+)", text))
    assert {
        "HoldfastDeadJobsRising",
        "HoldfastQueueBacklogOld",
        "HoldfastNoLiveWorker",
        "HoldfastSpoolOverdue",
        "HoldfastIngesterStuck",
    } <= alerts
    named = set(METRIC.findall(text))
    assert named and all(exported(name) for name in named), named


def test_the_dashboard_names_only_exported_metrics():
    queries = dashboard_queries()
    assert len(queries) >= 10
    named = {name for query in queries for name in METRIC.findall(query)}
    unknown = {name for name in named if not exported(name)}
    assert not unknown, f"the dashboard names metrics metrics/ does not export: {unknown}"
    assert {name.removesuffix("_bucket") for name in named} >= set(METRIC_NAMES)


def test_the_dashboard_queries_parse(tmp_path: Path):
    promtool = tool("promtool")
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for number, query in enumerate(dashboard_queries()):
        lines += [f"      - record: dashboard:query_{number}", f"        expr: {json.dumps(query)}"]
    rules = tmp_path / "dashboard-rules.yml"
    rules.write_text("\n".join(lines) + "\n")
    checked = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNITS / name)
    return parser


def test_workers_stop_gracefully_within_the_shutdown_grace():
    worker = unit("holdfast-worker@.service")["Service"]
    grace = float(settings.HOLDFAST_SHUTDOWN_GRACE_SECONDS)
    assert worker["KillSignal"] == "SIGTERM"
    assert worker["KillMode"] == "mixed"
    assert float(worker["TimeoutStopSec"]) >= grace + 10, "systemd must not SIGKILL a release"
    env = (UNITS / "holdfast.env.example").read_text()
    assert f"HOLDFAST_SHUTDOWN_GRACE_SECONDS={grace:g}" in env
    api = unit("holdfast-api.service")["Service"]
    assert float(api["TimeoutStopSec"]) > 25, "gunicorn's graceful_timeout is 25 s"


def test_every_unit_runs_a_command_that_exists():
    commands = get_commands()
    for path in sorted(UNITS.glob("*.service")):
        exec_start = shlex.split(unit(path.name)["Service"]["ExecStart"])
        if exec_start[1] == "manage.py":
            assert exec_start[2] in commands, (path.name, exec_start)
        else:
            assert exec_start[0].endswith("/gunicorn"), exec_start
            assert (REPO / exec_start[exec_start.index("-c") + 1]).is_file()


def test_the_units_pass_systemd_analyze_verify(tmp_path: Path):
    analyze = tool("systemd-analyze")
    names = []
    for path in [*UNITS.glob("*.service"), *UNITS.glob("*.target")]:
        text = path.read_text().replace("/opt/holdfast", str(REPO))
        (tmp_path / path.name).write_text(text)
        names.append(path.name)
    for instance in ("1", "2"):  # instances of the template
        template = (tmp_path / "holdfast-worker@.service").read_text()
        (tmp_path / f"holdfast-worker@{instance}.service").write_text(template)
    names = [name for name in names if name != "holdfast-worker@.service"]
    names.append("holdfast-worker@1.service")
    verified = subprocess.run(
        [analyze, "verify", *names], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert verified.returncode == 0 and not verified.stderr.strip(), verified.stderr


def test_the_documented_enable_commands_start_every_process_at_boot():
    """Each unit docs/deployment.md enables reaches multi-user.target through [Install]
    WantedBy= links that are themselves enabled: a worker instance is wanted by
    holdfast-workers.target, which must be enabled too, or no worker starts at boot."""
    guide = (REPO / "docs" / "deployment.md").read_text()
    enabled: set[str] = set()
    for line in guide.splitlines():
        words = line.split("#")[0].split()
        if words[:3] == ["sudo", "systemctl", "enable"]:
            for word in words[3:]:
                if word.startswith("--"):
                    continue
                names = [word.replace("{1..4}", n) for n in "1234"] if "{" in word else [word]
                enabled.update(name if "." in name else f"{name}.service" for name in names)

    def wanted_by(name: str) -> list[str]:
        file = re.sub(r"@[^.]+\.", "@.", name)  # an instance reads its template
        return unit(file)["Install"]["WantedBy"].split()

    def at_boot(name: str) -> bool:
        return any(
            target == "multi-user.target" or (target in enabled and at_boot(target))
            for target in wanted_by(name)
        )

    for name in (
        "holdfast-api.service",
        "holdfast-scheduler.service",
        "holdfast-ingester.service",
        *(f"holdfast-worker@{n}.service" for n in "1234"),
    ):
        assert name in enabled and at_boot(name), name
    # The target wants no fixed instances: disabling one really stops it for good.
    assert "Wants" not in unit("holdfast-workers.target")["Unit"]
