"""Every log event the code writes is named in the operators' docs (docs/*.md): "if an
operator cannot see it, it did not happen", and an event nobody can look up is half
seen. The events are read from the source (each ``log.<level>("event", ...)`` call)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO

LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
EVENT = re.compile(r"[a-z][a-z_]+")


def logged_events() -> dict[str, str]:
    """Event name → the first place that logs it."""
    found: dict[str, str] = {}
    for package in ("jobs", "ingestion", "ops"):
        for path in sorted((REPO / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                    and EVENT.fullmatch(node.args[0].value)
                ):
                    where = f"{path.relative_to(REPO)}:{node.lineno}"
                    found.setdefault(node.args[0].value, where)
    return found


def test_every_logged_event_is_documented() -> None:
    docs = "\n".join(path.read_text() for path in sorted(Path(REPO, "docs").glob("*.md")))
    events = logged_events()
    assert len(events) > 100, "the scan found too few events: it no longer reads the code"
    missing = {name: where for name, where in events.items() if not re.search(rf"\b{name}\b", docs)}
    assert not missing, f"log events no doc in docs/ names: {missing}"
