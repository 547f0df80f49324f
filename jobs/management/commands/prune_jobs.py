from typing import Any

from django.core.management.base import CommandParser

from jobs import operations, retention
from jobs.management.base import JobsCommand, interrupted, parse_duration, sigterm_interrupts
from jobs.models import State


class Command(JobsCommand):
    help = (
        "Delete succeeded and cancelled jobs (with their attempts) that finished longer ago "
        "than --older-than. Queued and running jobs are never pruned; dead ones only with "
        "--include-dead. --dry-run counts what would go and deletes nothing. (The scheduler "
        "also prunes by itself: HOLDFAST_RETAIN_* settings, docs/operations.md.)"
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--older-than", required=True, help="e.g. 14d, 12h, 30m")
        parser.add_argument("--include-dead", action="store_true")
        parser.add_argument(
            "--dry-run", action="store_true", help="count what would be deleted; delete nothing"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        older_than = parse_duration(options["older_than"])
        include_dead = options["include_dead"]
        if options["dry_run"]:
            states = [State.SUCCEEDED, State.CANCELLED] + ([State.DEAD] if include_dead else [])
            found = retention.prune(dict.fromkeys(states, older_than), dry_run=True)
            count = sum(found.values())
        else:
            tally: dict[str, int] = {}
            try:
                with sigterm_interrupts():
                    count = operations.prune(older_than, include_dead=include_dead, tally=tally)
            except KeyboardInterrupt as exc:
                done = f"{sum(tally.values())} finished job(s) were pruned before it"
                raise interrupted(exc, done) from None
        if options["as_json"]:
            self.emit_json(
                {
                    "deleted": 0 if options["dry_run"] else count,
                    "would_delete": count if options["dry_run"] else None,
                    "dry_run": options["dry_run"],
                    "older_than_s": older_than.total_seconds(),
                    "include_dead": include_dead,
                }
            )
            return
        if options["dry_run"]:
            self.stdout.write(
                f"would prune {count} finished job(s) older than {options['older_than']} "
                "(dry run: nothing deleted)"
            )
            return
        self.stdout.write(f"pruned {count} finished job(s) older than {options['older_than']}")
