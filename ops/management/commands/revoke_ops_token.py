from typing import Any

from django.core.management.base import CommandParser

from jobs.management.base import JobsCommand
from jobs.serialization import timestamp
from ops import tokens


class Command(JobsCommand):
    help = "Revoke an API token by name: requests with it get 401 from now on."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("name")

    def handle(self, *args: Any, **options: Any) -> None:
        row = tokens.revoke(options["name"])
        if options["as_json"]:
            self.emit_json(
                {"name": row.name, "scope": row.scope, "revoked_at": timestamp(row.revoked_at)}
            )
            return
        self.stdout.write(f"token {row.name!r} revoked")
