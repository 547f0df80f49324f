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
        header = f"{'name':<24} {'scope':<5} {'prefix':<8} {'status':<7} {'created':<20} "
        self.stdout.write(header + f"{'last used':<20} {'expires':<20} revoked")
        for row in rows:
            name, scope, prefix, status, created, used = (row[key] for key in columns)
            self.stdout.write(
                f"{name:<24} {scope:<5} {prefix:<8} {status:<7} {_short(created, '-'):<20} "
                f"{_short(used, 'never'):<20} {_short(row['expires_at'], 'never'):<20} "
                f"{_short(row['revoked_at'], '-')}"
            )
        self.stdout.write(f"({len(rows)} token(s))")


def _short(stamp: str | None, missing: str) -> str:
    """A listing's timestamp to the second, in UTC (--json keeps the full value)."""
    if not stamp:
        return missing
    return stamp[:19].replace("T", " ") + "Z" if stamp.endswith("+00:00") else stamp
