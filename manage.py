#!/usr/bin/env python
"""Django's command-line utility for administrative tasks.

Beyond Django's own: bad configuration (a setting Holdfast cannot use) is one line on
stderr and exit 2, like any other bad input (DESIGN §8), not a traceback; a database
error that reaches this far (Django's own commands, ``migrate`` or ``runserver``, against a
server that is down) is one line and exit 1, as Holdfast's commands say it; and a closed
pipe (``manage.py list_jobs | head``) ends the command quietly with exit 141, as a Unix
tool killed by SIGPIPE would. ``--settings`` and ``--pythonpath`` are applied before the
settings load (as Django's own utility does; loading them early here had ignored both),
an unknown command is a usage error (one line, exit 2), and text the terminal's encoding
cannot show is escaped rather than failing the command half-way through its output.
"""

import os
import sys
from typing import Any

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    try:
        from django.core.exceptions import ImproperlyConfigured
    except ImportError as exc:
        raise ImportError(
            "Couldn't import Django. Are you sure it's installed and "
            "available on your PYTHONPATH environment variable? Did you "
            "forget to activate a virtual environment? (scripts/bootstrap.sh makes .venv; "
            "run .venv/bin/python manage.py ...)"
        ) from exc
    from django.conf import settings
    from django.db import Error as DatabaseError

    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        _default_options(sys.argv[2:])
        try:
            settings.INSTALLED_APPS  # noqa: B018  (loads the settings: fail here, in one line)
        except ImportError as exc:
            module = os.environ["DJANGO_SETTINGS_MODULE"]
            raise ImproperlyConfigured(f"cannot import settings {module!r}: {exc}") from None
        _utility()(sys.argv).execute()
    except ImproperlyConfigured as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"configuration error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except DatabaseError as exc:
        if "--traceback" in sys.argv:
            raise
        lines = str(exc).strip().splitlines()
        message = " ".join(lines[0].split()) if lines else type(exc).__name__
        print(f"database error: {message}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    except BrokenPipeError:
        # Whoever read our output stopped reading: say nothing more. Point stdout at
        # /dev/null so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(EXIT_BROKEN_PIPE)


def _default_options(args: list[str]) -> None:
    """Apply ``--settings`` and ``--pythonpath`` now, before anything reads the settings,
    as ``ManagementUtility.execute`` does (a malformed command line is left to it)."""
    from django.core.management.base import CommandError, CommandParser, handle_default_options

    parser = CommandParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--settings")
    parser.add_argument("--pythonpath")
    try:
        options, _ = parser.parse_known_args(args)
    except CommandError:
        return
    handle_default_options(options)


def _utility() -> type:
    from django.core.management import ManagementUtility, get_commands

    class Utility(ManagementUtility):
        """Django's, but a misspelt command is a usage error: one line and exit 2 (Django
        says two lines and exits 1, which a script reads as a failed operation)."""

        def fetch_command(self, subcommand: str) -> Any:
            commands = get_commands()
            if subcommand not in commands:
                import difflib

                close = difflib.get_close_matches(subcommand, commands, n=1)
                hint = f"did you mean {close[0]}?" if close else "manage.py help lists them"
                print(f"unknown command {subcommand!r} ({hint})", file=sys.stderr)
                sys.exit(EXIT_BAD_INPUT)
            return super().fetch_command(subcommand)

    return Utility


if __name__ == "__main__":
    main()
