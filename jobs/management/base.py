"""What every Holdfast command shares: ``--json`` output and the exit-code contract.

Exit 0 on success, 1 when the operation failed (or conflicts with a job's state), 2 for
usage errors and bad input, always with a one-line reason on stderr and no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import re
import signal
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, NoReturn, TextIO

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper
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


class Interrupted(KeyboardInterrupt):
    """SIGTERM (a service stop, a timeout) or SIGINT (Ctrl-C) ended a command's work."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


HOLDFAST_APPS = ("jobs", "ingestion", "ops")  # whose migrations this code's processes need


def refuse_unmigrated() -> None:
    """Exit 1, naming them, if the database lacks migrations of Holdfast's apps that this
    code has: a worker or scheduler started before ``manage.py migrate`` met "no such
    column" on every step and logged it as ``database_unavailable`` for ever, which reads
    like an outage. Other apps' migrations (a host project's own, run after the deploy)
    are not Holdfast's to require. A database that cannot answer is the process's to wait
    out, as before."""
    from django.db import connection
    from django.db.migrations.exceptions import MigrationSchemaMissing, NodeNotFoundError
    from django.db.migrations.executor import MigrationExecutor

    try:
        executor = MigrationExecutor(connection)
        targets = [node for node in executor.loader.graph.leaf_nodes() if node[0] in HOLDFAST_APPS]
        plan = executor.migration_plan(targets)
    except (DatabaseError, MigrationSchemaMissing):
        return
    except NodeNotFoundError as exc:
        raise failed(f"the migrations cannot be read: {exc}") from None
    if not plan:
        return
    by_app: dict[str, list[str]] = {}
    for migration, _ in plan:
        by_app.setdefault(migration.app_label, []).append(migration.name)
    missing = "; ".join(
        f"{app}: {len(names)} from {app}.{names[0]}" for app, names in sorted(by_app.items())
    )
    raise failed(
        f"the database is not migrated for this code (not applied: {missing}): "
        "run manage.py migrate first"
    )


def interrupted(exc: KeyboardInterrupt, done: str = "") -> CommandError:
    """Exit 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM), with one line
    saying what was done before it, instead of a traceback (or, for SIGTERM, nothing)."""
    signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
    detail = f"; {done}" if done else ""
    return CommandError(
        f"interrupted by {signal.Signals(signum).name}{detail}", returncode=128 + signum
    )


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside: SIGTERM raises :class:`Interrupted`, so a long command's ``finally`` blocks
    run (a batch's transaction rolls back, what was done is logged) instead of the process
    dying where it stands."""

    def stop(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# Django's own options: not the command's input.
DJANGO_OPTIONS = frozenset(
    {"settings", "pythonpath", "traceback", "no_color", "force_color", "verbosity", "skip_checks"}
)


class JobsCommand(BaseCommand):
    """A command with ``--json`` whose engine errors map onto the exit-code contract.

    Every text argument is checked before the command runs: an empty or blank one is bad
    input (it used to mean "not given", so ``--lane ''`` chose the default lane and
    ``--expires-in ''`` a token that never expires), and so is one that is not valid
    UTF-8 (bytes a shell passed through, which no database column takes). A usage error
    is one line on stderr, as every other refusal.
    """

    requires_system_checks: list[str] = []

    def __init__(
        self,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        no_color: bool = False,
        force_color: bool = False,
    ) -> None:
        super().__init__(stdout, stderr, no_color, force_color)
        self.stdout = PrintableOutput(stdout or sys.stdout)
        self.stderr = PrintableOutput(stderr or sys.stderr)
        self.stderr.style_func = self.style.ERROR  # as Django's (plain without colour)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", dest="as_json", help="print JSON")

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        # No prefixes: ``requeue_dead --a`` meant ``--all``, and a new option sharing a
        # prefix would silently change what an existing script's abbreviation does.
        kwargs.setdefault("allow_abbrev", False)
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        self.names = {
            action.dest: (action.option_strings[-1] if action.option_strings else action.dest)
            for action in parser._actions
        }
        parser.error = functools.partial(one_line_error, parser)  # type: ignore[method-assign]
        refuse_repeats(parser)
        return parser

    def execute(self, *args: Any, **options: Any) -> str | None:
        for name in ("stdout", "stderr"):  # call_command(stdout=…): ours, not Django's
            if options.get(name):
                setattr(self, name, PrintableOutput(options.pop(name)))
        try:
            self.check_text(options)
            return super().execute(*args, **options)
        except CommandError:
            raise
        except KeyboardInterrupt as exc:
            raise interrupted(exc) from None
        except BAD_INPUT as exc:
            raise bad_input(str(exc)) from None
        except FAILED as exc:
            raise failed(str(exc)) from None
        except DatabaseError as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise failed(f"database error: {first_line}") from None

    def check_text(self, options: dict[str, Any]) -> None:
        names = getattr(self, "names", {})
        for dest, value in options.items():
            if dest in DJANGO_OPTIONS:
                continue
            name = names.get(dest, dest)
            for text in value if isinstance(value, list) else [value]:
                if not isinstance(text, str):
                    continue
                if not text.strip():
                    raise bad_input(f"{name} must not be empty")
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise bad_input(f"{name} is not valid UTF-8 text") from None

    def emit_json(self, data: Any) -> None:
        self.stdout.write(json.dumps(data, indent=2, default=str))


#: Control characters a terminal acts on (ESC sequences set the title, clear the screen,
#: recolour; a carriage return overwrites the line): C0 but newline and tab, DEL, C1.
CONTROL_CHARACTERS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with each control character a terminal would act on written as
    ``\\u001b`` (also a valid escape inside a JSON string, so ``--json`` output stays
    the same document)."""
    return CONTROL_CHARACTERS.sub(lambda found: f"\\u{ord(found.group()):04x}", text)


class PrintableOutput(OutputWrapper):
    """A command's stdout or stderr that never passes a control character through: the
    text it prints comes from outside (a fetched page's title, a spool file's name, a
    job's error, an operator's mistyped argument), and raw, an escape sequence in it took
    over the operator's terminal. The command's own styles are applied after."""

    def write(  # type: ignore[override]  # OutputWrapper's own signature (django-stubs)
        self, msg: str = "", style_func: Any = None, ending: str | None = None
    ) -> None:
        super().write(printable(msg), style_func, ending)


def write_controls(output: OutputWrapper, text: str) -> None:
    """Write ``text`` holding the command's own control sequences (a status line redrawn
    in place), unstyled and as it is: ``PrintableOutput`` would escape them."""
    OutputWrapper.write(output, text, style_func=str, ending="")
    output.flush()


def one_line_error(parser: CommandParser, message: str) -> NoReturn:
    """argparse's error, as one line (its usage block went before the reason)."""
    if not parser.called_from_command_line:
        raise CommandError(f"Error: {message}", returncode=2)
    parser.exit(2, f"{parser.prog}: error: {message} (see --help)\n")


# Actions meant to be given more than once.
REPEATABLE = (
    argparse._AppendAction,
    argparse._AppendConstAction,
    argparse._CountAction,
    argparse._HelpAction,
    argparse._VersionAction,
)


def refuse_repeats(parser: CommandParser) -> None:
    """An option given twice is a usage error, not "the last one wins": ``--scope write
    --scope read`` must not quietly create a read token, nor ``--lane a --lane b`` enqueue
    into ``b`` alone."""
    given: set[str] = set()
    for action in parser._actions:
        if action.option_strings and not isinstance(action, REPEATABLE):
            action.__class__ = _once(type(action))
            action.given = given  # type: ignore[attr-defined]
    parse_known_args = parser.parse_known_args

    def parse_once(*args: Any, **kwargs: Any) -> Any:
        given.clear()
        return parse_known_args(*args, **kwargs)

    parser.parse_known_args = parse_once  # type: ignore[method-assign]


def _once(action: type[argparse.Action]) -> type[argparse.Action]:
    class Once(action):  # type: ignore[valid-type,misc]
        given: set[str]

        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: Any,
            option_string: str | None = None,
        ) -> None:
            if self.dest in self.given:
                parser.error(f"{'/'.join(self.option_strings)} given more than once")
            self.given.add(self.dest)
            super().__call__(parser, namespace, values, option_string)

    Once.__name__ = f"Once{action.__name__}"
    return Once


def whole_number(text: str, what: str = "a whole number") -> int:
    """argparse type for an integer option: ASCII digits (and a sign) only; ``int()``
    also takes ``' 5'`` and Arabic-Indic or other scripts' digits."""
    if not re.fullmatch(r"[-+]?[0-9]{1,19}", text, re.ASCII):
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}")
    return int(text)


def decimal_number(text: str) -> float:
    """argparse type for a number of seconds and the like: ASCII, finite (``float()``
    also takes ``' 5'``, other scripts' digits, ``'nan'`` and ``'inf'``)."""
    if not re.fullmatch(r"[-+]?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?", text, re.ASCII):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"out of range: {text!r}")
    return value + 0.0  # -0 is 0: stored and shown as "-0" it read as a negative


def parse_duration(text: str) -> timedelta:
    """``14d``, ``12h``, ``30m``, ``90s`` or ``2w`` as a timedelta; bad input otherwise."""
    try:
        return durations.parse(text)
    except ValueError as exc:
        raise bad_input(str(exc)) from None


MAX_ROW_ID = 2**63 - 1


def row_id(text: str) -> int:
    """argparse type for a job or issue id: a whole number the database can hold."""
    value = whole_number(text, "an id")
    if not 1 <= value <= MAX_ROW_ID:
        raise argparse.ArgumentTypeError(f"no such id: {text}")
    return value


def limit(text: str) -> int:
    """argparse type for --limit: 1 to 100,000 rows."""
    value = whole_number(text, "a number")
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError("--limit must be from 1 to 100000")
    return value
