"""What every Holdfast command shares: ``--json`` output and the exit-code contract.

Exit 0 on success, 1 when the operation failed (or conflicts with a job's state), 2 for
usage errors and bad input, always with a one-line reason on stderr and no traceback.
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from jobs import durations
from jobs.exceptions import (
    InvalidJob,
    JobNotFound,
    LaneFull,
    LaneRefused,
    StateConflict,
    UnknownKind,
)

# LookupError covers every "no such id" error (jobs, issues, tokens); ImproperlyConfigured
# is a settings mistake the operator must fix (the one-line reason names it).
BAD_INPUT = (
    InvalidJob,
    JobNotFound,
    LaneRefused,
    UnknownKind,
    ValueError,
    OverflowError,
    LookupError,
    ImproperlyConfigured,
)
FAILED = (StateConflict, LaneFull)


def bad_input(message: str) -> CommandError:
    return CommandError(message, returncode=2)


def failed(message: str) -> CommandError:
    return CommandError(message, returncode=1)


class JobsCommand(BaseCommand):
    """A command with ``--json`` whose engine errors map onto the exit-code contract."""

    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", dest="as_json", help="print JSON")

    def execute(self, *args: Any, **options: Any) -> str | None:
        try:
            return super().execute(*args, **options)
        except CommandError:
            raise
        except BAD_INPUT as exc:
            raise bad_input(str(exc)) from None
        except FAILED as exc:
            raise failed(str(exc)) from None
        except DatabaseError as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise failed(f"database error: {first_line}") from None

    def emit_json(self, data: Any) -> None:
        self.stdout.write(json.dumps(data, indent=2, default=str))


def parse_duration(text: str) -> timedelta:
    """``14d``, ``12h``, ``30m``, ``90s`` or ``2w`` as a timedelta; bad input otherwise."""
    try:
        return durations.parse(text)
    except ValueError as exc:
        raise bad_input(str(exc)) from None


MAX_ROW_ID = 2**63 - 1


def row_id(text: str) -> int:
    """argparse type for a job or issue id: a whole number the database can hold."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an id: {text!r}") from None
    if not 1 <= value <= MAX_ROW_ID:
        raise argparse.ArgumentTypeError(f"no such id: {text}")
    return value


def limit(text: str) -> int:
    """argparse type for --limit: 1 to 100,000 rows."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError("--limit must be from 1 to 100000")
    return value
