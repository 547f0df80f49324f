from typing import Any

from django.core.management.base import CommandParser

from jobs import scheduler
from jobs.management.base import JobsCommand
from jobs.serialization import timestamp


class Command(JobsCommand):
    help = "Pause a recurring schedule: no slot runs until it is resumed."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("name")

    def handle(self, *args: Any, **options: Any) -> None:
        row = scheduler.pause(options["name"], actor="cli")
        if options["as_json"]:
            self.emit_json(
                {"name": row.name, "paused": row.paused, "next_due_at": timestamp(row.next_due_at)}
            )
            return
        state = "paused" if row.paused else f"active, next slot {timestamp(row.next_due_at)}"
        self.stdout.write(f"schedule {row.name}: {state}")
