from typing import Any

from django.core.management.base import CommandParser

from jobs import engine
from jobs.management.base import JobsCommand, parse_duration


class Command(JobsCommand):
    help = (
        "Delete succeeded and cancelled jobs (with their attempts) that finished longer ago "
        "than --older-than. Queued and running jobs are never pruned; dead ones only with "
        "--include-dead."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--older-than", required=True, help="e.g. 14d, 12h, 30m")
        parser.add_argument("--include-dead", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        older_than = parse_duration(options["older_than"])
        deleted = engine.prune(older_than, include_dead=options["include_dead"])
        if options["as_json"]:
            self.emit_json(
                {
                    "deleted": deleted,
                    "older_than_s": older_than.total_seconds(),
                    "include_dead": options["include_dead"],
                }
            )
            return
        self.stdout.write(f"pruned {deleted} finished job(s) older than {options['older_than']}")
