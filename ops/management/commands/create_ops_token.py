from typing import Any

from django.core.management.base import CommandParser

from jobs.management.base import JobsCommand, parse_duration
from jobs.serialization import timestamp
from ops import tokens
from ops.models import Scope


class Command(JobsCommand):
    help = (
        "Create an API token. The token is printed once; only its hash is stored. With "
        "--expires-in it is refused (401, like a revoked one) once that time has passed."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("name")
        parser.add_argument("--scope", choices=Scope.values, required=True)
        parser.add_argument(
            "--expires-in", help="e.g. 90d, 12h, 30m (as prune_jobs reads durations)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        expires_in = None
        if options["expires_in"] is not None:  # given (an empty one is refused before)
            expires_in = parse_duration(options["expires_in"])  # at most 100 years
        row, token = tokens.create(options["name"], options["scope"], expires_in=expires_in)
        if options["as_json"]:
            self.emit_json(
                {
                    "name": row.name,
                    "scope": row.scope,
                    "token": token,
                    "prefix": row.prefix,
                    "expires_at": timestamp(row.expires_at),
                }
            )
            return
        expiry = f", expires {timestamp(row.expires_at)}" if row.expires_at else ""
        self.stdout.write(f"token {row.name!r} ({row.scope}{expiry}) created. Copy it now: it")
        self.stdout.write("is not stored and cannot be shown again.\n")
        self.stdout.write(token)
