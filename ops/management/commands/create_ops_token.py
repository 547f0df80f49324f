from typing import Any

from django.core.management.base import CommandParser

from jobs.management.base import JobsCommand
from ops import tokens
from ops.models import Scope


class Command(JobsCommand):
    help = "Create an API token. The token is printed once; only its hash is stored."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("name")
        parser.add_argument("--scope", choices=Scope.values, required=True)

    def handle(self, *args: Any, **options: Any) -> None:
        row, token = tokens.create(options["name"], options["scope"])
        if options["as_json"]:
            self.emit_json({"name": row.name, "scope": row.scope, "token": token})
            return
        self.stdout.write(f"token {row.name!r} ({row.scope}) created. Copy it now: it is not")
        self.stdout.write("stored and cannot be shown again.\n")
        self.stdout.write(token)
