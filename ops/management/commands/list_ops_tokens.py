from typing import Any

from django.core.management.base import CommandParser

from jobs.management.base import JobsCommand
from ops import tokens


class Command(JobsCommand):
    help = (
        "List API tokens, newest first: name, scope, prefix, status (live, expired, "
        "revoked), created, last used, expires, revoked. Never a secret."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        rows = tokens.listing()
        if options["as_json"]:
            self.emit_json({"count": len(rows), "tokens": rows})
            return
        columns = ("name", "scope", "prefix", "status", "created_at", "last_used_at")
        header = f"{'name':<24} {'scope':<5} {'prefix':<8} {'status':<7} {'created':<25} "
        self.stdout.write(header + f"{'last used':<25} {'expires':<25} revoked")
        for row in rows:
            name, scope, prefix, status, created, used = (row[key] for key in columns)
            self.stdout.write(
                f"{name:<24} {scope:<5} {prefix:<8} {status:<7} {created or '-':<25} "
                f"{used or 'never':<25} {row['expires_at'] or 'never':<25} "
                f"{row['revoked_at'] or '-'}"
            )
        self.stdout.write(f"({len(rows)} token(s))")
