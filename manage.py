#!/usr/bin/env python
"""Django's command-line utility for administrative tasks.

Beyond Django's own: bad configuration (a setting Holdfast cannot use) is one line on
stderr and exit 2, like any other bad input (DESIGN §8), not a traceback; a database
error that reaches this far (Django's own commands, ``migrate`` or ``runserver``, against a
server that is down) is one line and exit 1, as Holdfast's commands say it; and a closed
pipe (``manage.py list_jobs | head``) ends the command quietly with exit 141, as a Unix
tool killed by SIGPIPE would.
"""

import os
import sys

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    try:
        from django.core.exceptions import ImproperlyConfigured
        from django.core.management import execute_from_command_line
    except ImportError as exc:
        raise ImportError(
            "Couldn't import Django. Are you sure it's installed and "
            "available on your PYTHONPATH environment variable? Did you "
            "forget to activate a virtual environment? (scripts/bootstrap.sh makes .venv; "
            "run .venv/bin/python manage.py ...)"
        ) from exc
    from django.conf import settings
    from django.db import Error as DatabaseError

    try:
        settings.INSTALLED_APPS  # noqa: B018  (loads the settings: fail here, in one line)
        execute_from_command_line(sys.argv)
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


if __name__ == "__main__":
    main()
